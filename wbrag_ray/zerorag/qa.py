"""Zero-RAG's mastery score of a sentence: the mean exact match of the target model's closed-book answers
to QA pairs answerable from it, written by the QA generator (`llm`; unparsable output kept with a status) or as
`cloze` blanks."""

from __future__ import annotations

import json
import re

import pandas as pd

from wbrag_ray.metrics import exact_match, normalize_answer, substring_match

OK, UNPARSEABLE, NOT_IN_SENTENCE = "ok", "unparseable", "answer_not_in_sentence"
BLANK = "____"

# --- cloze mode -----------------------------------------------------------------------------------------

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
# Ordered by how specific (and so how checkable by exact match) an answer of that kind is.
_SPAN_PATTERNS = [
    ("date", re.compile(rf"\b(?:\d{{1,2}} (?:{_MONTHS})(?: \d{{3,4}})?|(?:{_MONTHS}) \d{{1,2}}(?:, \d{{3,4}})?)\b")),
    ("number", re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\w])")),
    # Runs of capitalized words (allowing 'of', 'de', ... inside): names of people, places and works.
    ("name", re.compile(r"\b[A-Z][\w'\-]*(?:\s+(?:of|de|the|von|van|and|la|le|du)?\s*[A-Z][\w'\-]*)*")),
]
# Capitalized words that name nothing when they stand alone.
_NOT_NAMES = {
    "The", "A", "An", "In", "On", "At", "It", "He", "She", "They", "This", "That", "These", "Those", "His", "Her",
    "Its", "Their", "After", "Before", "During", "When", "While", "As", "But", "And", "Or", "For", "From", "By",
    "With", "There", "Here", "Some", "Many", "Most", "One", "Also", "However", "Although", "Since", "If", "We", "I",
}


def cloze_spans(sentence: str, n: int) -> list[str]:
    """Up to `n` distinct answer spans: dates, numbers, then names, in reading order, none inside another."""
    taken: list[tuple[int, int]] = []
    spans: list[str] = []
    for kind, pattern in _SPAN_PATTERNS:
        for m in pattern.finditer(sentence):
            text = m.group(0).strip(" ,")
            start, end = m.start(), m.start() + len(text)
            if kind == "name":
                words = text.split()
                while words and words[0] in _NOT_NAMES:  # "The Beatles" -> "Beatles"; "In Paris" -> "Paris"
                    start += len(words[0]) + 1
                    words = words[1:]
                text = " ".join(words)
                if not text or (len(words) == 1 and start == 0 and len(text) < 4):
                    continue
            if len(text) < 2 or any(s < end and start < e for s, e in taken):
                continue
            if normalize_answer(text) in {normalize_answer(s) for s in spans} or not normalize_answer(text):
                continue
            taken.append((start, end))
            spans.append(text)
            if len(spans) == n:
                return spans
    return spans


def cloze_pairs(title: str, sentence: str, n: int) -> list[dict]:
    """QA rows for one sentence in cloze mode: the sentence with one span blanked, the span as the answer."""
    rows = []
    for i, span in enumerate(cloze_spans(sentence, n)):
        blanked = sentence.replace(span, BLANK, 1)
        question = f"{title}: {blanked}" if title else blanked
        rows.append({"qa_index": i, "question": question, "answer": span, "status": OK, "raw": ""})
    if not rows:  # nothing recallable in the sentence: recorded, not silently skipped
        rows.append({"qa_index": 0, "question": "", "answer": "", "status": UNPARSEABLE, "raw": sentence})
    return rows


# --- llm mode -------------------------------------------------------------------------------------------

_QA_LINES = re.compile(
    r"(?:^|\n)\s*(?:\d+[.)]\s*)?Q(?:uestion)?\s*\d*\s*[:.)]\s*(?P<q>.+?)\s*\n\s*(?:\d+[.)]\s*)?A(?:nswer)?\s*\d*\s*[:.)]\s*(?P<a>[^\n]+)",
    re.IGNORECASE,
)


def parse_qa_output(raw: str) -> list[tuple[str, str]]:
    """(question, answer) pairs from JSON objects, else `Q: ... / A: ...` lines; empty when nothing parses."""
    text = raw.strip()
    start = min([i for i in (text.find("["), text.find("{")) if i >= 0], default=-1)
    if start >= 0:
        for end in range(len(text), start, -1):  # the longest prefix that decodes: models trail off
            if text[end - 1] not in "]}":
                continue
            try:
                data = json.loads(text[start:end])
            except json.JSONDecodeError:
                continue
            items = [d for d in (data if isinstance(data, list) else [data]) if isinstance(d, dict)]
            pairs = [(str(d.get("question", "")).strip(), str(d.get("answer", "")).strip()) for d in items]
            pairs = [(q, a) for q, a in pairs if q and a]
            if pairs:
                return pairs
            break
    return [(m.group("q").strip(), m.group("a").strip().strip('"')) for m in _QA_LINES.finditer("\n" + text)]


def llm_pairs(sentence: str, raw: str, n: int, completion_prefix: str = "") -> list[dict]:
    """QA rows for one sentence from the QA generator's output; every row keeps the raw output."""
    pairs = parse_qa_output(completion_prefix + raw)[:n]
    if not pairs:
        return [{"qa_index": 0, "question": "", "answer": "", "status": UNPARSEABLE, "raw": raw}]
    norm_sentence = normalize_answer(sentence)
    rows = []
    for i, (q, a) in enumerate(pairs):
        in_sentence = bool(normalize_answer(a)) and normalize_answer(a) in norm_sentence
        rows.append({"qa_index": i, "question": q, "answer": a, "status": OK if in_sentence else NOT_IN_SENTENCE,
                     "raw": raw})
    return rows


# --- scoring --------------------------------------------------------------------------------------------


def score_answers(qa: pd.DataFrame) -> pd.DataFrame:
    """Add `em` and `acc` to answered QA rows; unanswered rows get nulls."""
    qa = qa.copy()
    ok = (qa["status"] == OK).to_numpy()
    for name, fn in (("em", exact_match), ("acc", substring_match)):
        qa[name] = pd.array([fn(p, [a]) if k else None for p, a, k in zip(qa["prediction"], qa["answer"], ok, strict=True)],
                            dtype="Float64").astype("float64")
    return qa


def mastery_scores(sentences: pd.DataFrame, qa: pd.DataFrame, metric: str = "em") -> pd.DataFrame:
    """One row per sentence: n_qa, n_valid, mastery = mean `metric` over valid pairs (null when none)."""
    groups = qa.groupby("sid")
    out = sentences[["sid", "title", "text"]].copy()
    out["n_qa"] = out["sid"].map(groups.size()).fillna(0).astype("int32")
    out["n_valid"] = out["sid"].map(groups["status"].apply(lambda s: int((s == OK).sum()))).fillna(0).astype("int32")
    out["mastery"] = out["sid"].map(groups[metric].mean()).astype("float64")  # NaN-skipping mean over valid pairs
    return out
