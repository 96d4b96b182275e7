"""A stated rule that cuts a sentence-long answer down to its span (`eval.answer_form: span`), from the
generated text and the question only: the first sentence, a lead-in dropped, the question's words and function
words struck out; the first remaining run with a capitalized word or number, else the last run, else the sentence."""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[.!?])(?:\s|$)|\n")
_LEAD_IN = re.compile(r"^\s*(?:the\s+)?answer\s*(?:is)?\s*:\s*", re.IGNORECASE)
# a word: letters / digits with inner hyphens, apostrophes or decimal points ("Stratford-upon-Avon", "9.58")
_TOKEN = re.compile(r"[A-Za-z0-9\u00C0-\u024F]+(?:[-'’.][A-Za-z0-9\u00C0-\u024F]+)*|[,;:()\[\]\"“”]")
_BREAKS = set(",;:()[]\"“”")
_JOINERS = {"and", "of", "&"}
FUNCTION_WORDS = frozenset("""
a an the is are was were be been being am it its it's this that these those there here which who whom whose what
when where why how by of in on at to for from with as into onto upon about over under after before during near
and or but nor so than then also both either neither not no yes he she they we you i his her their our your my him
them us me one ones has have had do does did will would can could shall should may might must called named known
located situated
""".split())


def _word(token: str) -> str:
    word = token.lower().replace("’", "'")
    return word[:-2] if word.endswith("'s") else word


def _stem(word: str) -> str:
    """A word without a plural or past ending, for matching the question's words ("whales", "discovered")."""
    for ending in ("ies", "es", "ed", "s", "d"):
        if word.endswith(ending) and len(word) - len(ending) >= 3:
            return word[: -len(ending)]
    return word


def first_sentence(text: str) -> str:
    return _SENTENCE_END.split(text.strip(), maxsplit=1)[0].strip()


def short_answer(prediction: str, question: str) -> str:
    """The answer span of `prediction` to `question` by the module's rule."""
    sentence = first_sentence(prediction)
    body = _LEAD_IN.sub("", sentence)
    asked = {_stem(_word(t)) for t in _TOKEN.findall(question)}
    tokens = _TOKEN.findall(body)
    runs: list[list[str]] = [[]]
    for i, token in enumerate(tokens):
        word = _word(token)
        if word in _JOINERS:
            if runs[-1]:
                runs[-1].append(token)  # kept only if a kept word follows
        elif token == "," and runs[-1] and runs[-1][-1][0].isdigit() and i + 1 < len(tokens) \
                and tokens[i + 1][0].isdigit():
            runs[-1].append(token)  # a date's "24, 1990"
        elif token in _BREAKS or word in FUNCTION_WORDS or _stem(word) in asked:
            runs.append([])
        else:
            runs[-1].append(token)
    spans = []
    for run in runs:
        while run and _word(run[-1]) in _JOINERS:
            run.pop()
        if run:
            spans.append(run)
    if not spans:
        return body.rstrip(".!? ") or sentence
    named = [s for s in spans if any(t[0].isupper() or t[0].isdigit() for t in s)]
    return " ".join(named[0] if named else spans[-1]).replace(" ,", ",")
