"""WriteBack-RAG's distiller in two steps over the kept examples: extract (answer-relevant sentences, grounded
verbatim) -> rewrite (one self-contained unit). Prompts hold only the question and documents, never the gold answer.
Then the knowledge units with provenance, embedded, deduplicated, and Table 3's figures."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa

from wbrag_ray import prompts
from wbrag_ray.build_kb import unit_text
from wbrag_ray.config import WritebackConfig
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.metrics import normalize_answer
from wbrag_ray.retrieval.hits import hits_from_json
from wbrag_ray.retrieval.stage import PassageVectorsStage

if TYPE_CHECKING:
    from wbrag_ray.retrieval.stage import RetrievalSetting
    from wbrag_ray.stages.service import Services


def word_count(text: str) -> int:
    """Token counts of Table 3, as whitespace words: independent of any one tokenizer."""
    return len(text.split())


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# Words about the question rather than evidence, which a small rewriter writes: a unit is a document.
_ANSWER_LEAD = re.compile(r"^(?:the\s+)?answer(?:\s+to\s+(?:the|this|your)\s+question)?\s*(?:is\b\s*:?|:)\s*", re.I)


def _tokens(text: str) -> set[str]:
    return set(normalize_answer(text).split())


MIN_OVERLAP = 0.6  # the share of a sentence's words one source sentence must hold for it to copy that sentence
# Fewer words than a statement: a bare answer, which nothing retrieves and no reader can check.
MIN_STATEMENT_WORDS = 4
BARE_ANSWER, UNSUPPORTED = "bare answer", "unsupported by its source passages"


def source_sentences(docs) -> list[str]:
    return [s for d in docs for s in _SENTENCE_END.split(d.text) if s.strip()]


def ground_extraction(extracted: str, docs, question: str) -> str:
    """Replace each extracted sentence by the source sentence sharing most of its words (at least MIN_OVERLAP),
    so no paraphrase reaches step 2; when nothing matches, the two source sentences closest to the question."""
    source = source_sentences(docs)
    if not source:
        return ""
    source_tokens = [_tokens(s) for s in source]
    picked: set[int] = set()
    for line in _SENTENCE_END.split(extracted.replace("\n", " ")):
        words = _tokens(line)
        if not words:
            continue
        overlap = [len(words & t) / len(words) for t in source_tokens]
        best = int(np.argmax(overlap))
        if overlap[best] >= MIN_OVERLAP:
            picked.add(best)
    if not picked:
        q = _tokens(question)
        picked = set(sorted(range(len(source)), key=lambda i: -len(q & source_tokens[i]))[:2])
    return "\n".join(source[i] for i in sorted(picked))


def statement_check(text: str, docs) -> str | None:
    """Why a unit is not a statement its sources support (None: it is): a bare answer, or a sentence no single
    source sentence (with its title) holds MIN_OVERLAP of the words and every number of."""
    if len(_tokens(text)) < MIN_STATEMENT_WORDS:
        return BARE_ANSWER
    source_tokens = [_tokens(s) | _tokens(d.title) for d in docs for s in source_sentences([d])]
    for sentence in _SENTENCE_END.split(text):
        words = _tokens(sentence)
        if not words:
            continue
        numbers = {w for w in words if any(c.isdigit() for c in w)}
        if not any(len(words & t) >= MIN_OVERLAP * len(words) and numbers <= t for t in source_tokens):
            return UNSUPPORTED
    return None


def parse_unit(rewritten: str, extracted: str, default_title: str) -> tuple[str, str] | None:
    """(title, text) of a unit from the rewrite, else the extraction under the top title; None if empty."""
    lines = [ln.strip() for ln in rewritten.splitlines() if ln.strip()]
    title, body = default_title, " ".join(lines)
    if len(lines) >= 2:
        title = lines[0].removeprefix("Title:").strip().strip("#*\"' ") or default_title
        body = " ".join(ln.removeprefix("Text:").strip() for ln in lines[1:])
    body = _ANSWER_LEAD.sub("", body).strip()
    if not body:
        title, body = default_title, " ".join(extracted.split())
    return (title, body) if body else None


def kept_hits(docs: str, kept_ranks: str):
    """The retrieved hits the document gate kept, in rank order."""
    hits = hits_from_json(docs)
    return [hits[j] for j in json.loads(kept_ranks)]


def distill(wb: WritebackConfig, kept: pd.DataFrame, passes: GeneratorPasses) -> pd.DataFrame:
    """The distiller's two steps over the kept examples: extract (question + kept documents -> the answer-relevant
    sentences, grounded verbatim), then rewrite (question + grounded extraction -> one self-contained document)."""
    # Only these columns reach the distiller's prompts: the gold answers are not among them.
    frame = kept[["id", "question", "docs", "kept_ranks"]].copy()
    hits = [kept_hits(d, k) for d, k in zip(frame["docs"], frame["kept_ranks"], strict=True)]
    frame["extract_prompt"] = [prompts.dumps(prompts.extract_messages(q, h))
                               for q, h in zip(frame["question"], hits, strict=True)]
    frame = passes.generate("distill_extract", frame, "extract_prompt", "extracted", wb.extract_max_new_tokens,
                            multiline=True)
    hits = [kept_hits(d, k) for d, k in zip(frame["docs"], frame["kept_ranks"], strict=True)]
    frame["extracted_verbatim"] = [ground_extraction(e, h, q)
                                   for e, h, q in zip(frame["extracted"], hits, frame["question"], strict=True)]
    frame["rewrite_prompt"] = [prompts.dumps(prompts.rewrite_messages(q, e))
                               for q, e in zip(frame["question"], frame["extracted_verbatim"], strict=True)]
    return passes.generate("distill_rewrite", frame, "rewrite_prompt", "rewritten", wb.rewrite_max_new_tokens,
                           multiline=True)


CHECKS = (BARE_ANSWER, UNSUPPORTED)  # why a distilled text is no unit (`statement_check`)
# Write-back ids live in their own namespace: far above any base pid / sid, and named by Hit.source.
WRITEBACK_ID_BASE = 1 << 62

UNITS = pa.schema([
    ("id", pa.int64()), ("unit_id", pa.string()), ("title", pa.string()), ("text", pa.string()),
    ("version", pa.string()), ("source_example_id", pa.string()), ("question", pa.string()),
    ("source_doc_ids", pa.list_(pa.int64())), ("source_doc_ranks", pa.list_(pa.int32())), ("fallback", pa.bool_()),
    ("source_tokens", pa.int64()), ("distilled_tokens", pa.int64()), ("merged_from", pa.list_(pa.string())),
])


def no_drops() -> dict:
    """What the statement check dropped: empty units, and per reason (CHECKS) the rewrites and the units."""
    return {"empty": 0, "rewrites": dict.fromkeys(CHECKS, 0), "units": dict.fromkeys(CHECKS, 0)}


def build_units(version: str, kept: pd.DataFrame, distilled: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """Units with provenance; a rewrite failing `statement_check` falls back to the extraction: (units, drops)."""
    out = distilled.set_index("id")
    rows: list[dict] = []
    drops = no_drops()
    for ex in kept.sort_values("id").itertuples(index=False):
        hits = kept_hits(ex.docs, ex.kept_ranks)
        default_title = hits[0].title if hits else ""
        extracted = " ".join(out.at[ex.id, "extracted_verbatim"].split())
        unit = parse_unit(out.at[ex.id, "rewritten"], extracted, default_title)
        if unit is None:
            drops["empty"] += 1
            continue
        title, text = unit
        why = statement_check(text, hits)
        if why and text != extracted:  # the rewrite failed the check: the example's unit is what step 1 copied
            drops["rewrites"][why] += 1
            title, text = default_title, extracted
            why = statement_check(text, hits) if text else None
            if not text:
                drops["empty"] += 1
                continue
        if why:
            drops["units"][why] += 1
            continue
        n = len(rows)
        rows.append({"id": WRITEBACK_ID_BASE + n, "unit_id": f"wb:{version}:{n}", "title": title, "text": text,
                     "version": version, "source_example_id": str(ex.id), "question": ex.question,
                     "source_doc_ids": [h.id for h in hits], "source_doc_ranks": [h.rank for h in hits],
                     "fallback": bool(ex.fallback),
                     "source_tokens": sum(word_count(h.title) + word_count(h.text) for h in hits),
                     "distilled_tokens": word_count(title) + word_count(text), "merged_from": []})
    return pd.DataFrame(rows, columns=UNITS.names), drops


def embed_units(units: pd.DataFrame, search: RetrievalSetting, services: Services) -> np.ndarray:
    """Unit vectors from the base embedder ('Title\\ntext'), on the command's retrieval service."""
    if not len(units):
        return np.zeros((0, 0), np.float32)
    stage = PassageVectorsStage(search.stage(services))
    out = services.run_frame(unit_text(units[["id", "title", "text"]], id_col="id"), stage, "embed_units")
    return np.stack(out["vector"].to_numpy()).astype(np.float32)


def dedupe(vectors: np.ndarray, threshold: float) -> dict[int, int]:
    """Greedy dedupe in row order by one range search: {duplicate row: kept row} at cosine >= threshold."""
    import faiss

    n = len(vectors)
    if n < 2:
        return {}
    index = faiss.IndexFlatIP(vectors.shape[1])
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    index.add(x)
    # range_search keeps scores > radius; nudge down so a pair exactly at the threshold counts.
    lims, dist, labels = index.range_search(x, float(threshold) - 1e-6)
    merged: dict[int, int] = {}
    for i in range(n):
        if i in merged:
            continue
        for j, _ in sorted(zip(labels[lims[i] : lims[i + 1]], dist[lims[i] : lims[i + 1]], strict=True)):
            j = int(j)
            if j > i and j not in merged:
                merged[j] = i
    return merged


def table3(scored: pd.DataFrame, units: pd.DataFrame, top_k: int, drops: dict | None = None) -> dict:
    """The paper's Table 3 from the scored examples and units, with the statement check's drops."""
    drops = drops or no_drops()
    n = len(scored)
    kept = scored[scored["useful"]]
    retained = [json.loads(r) for r in kept["kept_ranks"]] if len(kept) else []
    ranks = [r for rs in retained for r in rs]
    source = int(units["source_tokens"].sum()) if len(units) else 0
    distilled = int(units["distilled_tokens"].sum()) if len(units) else 0
    return {
        "examples": n,
        "selected": len(kept),
        "selection_rate": round(len(kept) / n, 4) if n else 0.0,
        "mean_retained_docs": round(float(np.mean([len(r) for r in retained])), 4) if retained else 0.0,
        "fallback_rate": round(float(kept["fallback"].mean()), 4) if len(kept) else 0.0,
        "source_tokens": source,
        "distilled_tokens": distilled,
        "mean_source_tokens": round(source / len(units), 2) if len(units) else 0.0,
        "mean_distilled_tokens": round(distilled / len(units), 2) if len(units) else 0.0,
        "compression_ratio": round(source / distilled, 4) if distilled else None,
        "token_unit": "whitespace words",
        # 1-based ranks, every rank listed so a report can plot the distribution as is
        "rank_distribution": {str(r + 1): ranks.count(r) for r in range(top_k)},
        "mean_s_nr": round(float(scored["s_nr"].mean()), 4) if n else 0.0,
        "mean_s_rag": round(float(scored["s_rag"].mean()), 4) if n else 0.0,
        "empty_units": drops["empty"],
        **{f"{kind}s_dropped": dict(drops[f"{kind}s"]) for kind in ("rewrite", "unit")},
        **{f"{kind}_drop_rate": round(sum(drops[f"{kind}s"].values()) / len(kept), 4) if len(kept) else 0.0
           for kind in ("rewrite", "unit")},
    }
