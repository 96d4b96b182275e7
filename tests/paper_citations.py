"""The check of the papers' numbers against their texts (tests/test_papers.py): each quote is in its text, each
number in its quote, and the text around it names the table or figure, section, dataset, model, pruning ratio, row
and column that `wbrag_ray.paper_numbers` records."""

from __future__ import annotations

import re

from wbrag_ray.paper_numbers import (
    GEMMA,
    LLAMA_3_8B,
    LLAMA_3_70B,
    LLAMA_31_8B,
    LLAMA_33_70B,
    NUMBERS,
    SAYS,
    ZERO_RAG,
    PaperNumber,
)


def _collapsed(text: str) -> str:
    return " ".join(text.split())


# How the texts name what a number is attributed to (its dataset, model, pruning ratio, table or figure)
DATASET_NAMES = {"nq": "NQ", "boolq": "BoolQ", "fever": "FEVER", "zsre": "zsRE", "hotpotqa": "HotpotQA",
                 "squad": "SQuAD", "popqa": "PopQA", "triviaqa": "TriviaQA", "entityquestions": "EntityQuestion"}
MODELS = (GEMMA, LLAMA_31_8B, LLAMA_33_70B, LLAMA_3_70B, LLAMA_3_8B, "Qwen-2-72B")
RATIOS = {0.0: r"no pruning|(?<![\d.])0% ", 0.3: r"(?<![\d.])30%", 0.7: r"(?<![\d.])70%"}
_PLACE = r"(?<!Appendix )(?:Table|Figure) \d+"  # an appendix's figure confirms a number, the body's table states it


def _position(shown: str, quote: str) -> int:
    """Where the number `shown` stands in `quote` as a number ('2.1' is not found in '2.14'); -1 where it does not."""
    found = re.search(r"(?<![\d.,])" + re.escape(shown) + r"(?![\d]|[.,]\d)", quote)
    return found.start() if found else -1


def _scopes(text: str, quote: str) -> list[str]:
    """The quote, its sentence, its paragraph (a line of the text) and its section (from the heading before it: a
    short line that is not a sentence), nearest first; [] where the text does not hold the quote."""
    lines = [_collapsed(line) for line in text.splitlines()]
    at = next((i for i, line in enumerate(lines) if quote in line), None)
    if at is None:
        return []
    heading = [i for i, line in enumerate(lines) if line and len(line) <= 60 and not line.endswith((".", ":"))
               and not line.startswith(("•", "Table", "Figure"))]
    first = max((i for i in heading if i <= at), default=0)
    last = min((i for i in heading if i > at), default=len(lines))
    paragraph = lines[at]
    start, end = paragraph.index(quote), paragraph.index(quote) + len(quote)
    before = [m.end() for m in re.finditer(r"[.!?]\s", paragraph[:start])]
    after = re.search(r"[.!?](\s|$)", paragraph[end:])
    sentence = paragraph[before[-1] if before else 0: end + (after.end() if after else len(paragraph))]
    return [quote, sentence, paragraph, " ".join(lines[first:last])]


def _named(scopes: list[str], names: dict) -> list:
    """The keys of `names` (key -> a regex) the nearest scope that names any of them names, in the order it names
    them."""
    for scope in scopes:
        found = sorted((m.start(), key) for key, pattern in names.items() for m in [re.search(pattern, scope)] if m)
        if found:
            return [key for _, key in found]
    return []


def _attribution_problems(n: PaperNumber, scopes: list[str]) -> list[str]:
    """Where the text around `n`'s quote names another table or figure, dataset, model or pruning ratio than `n`
    records (the nearest of quote, sentence, paragraph and section that names one decides)."""
    out = []
    if re.fullmatch(_PLACE, n.where):
        places = _named(scopes, {p: r"(?<!Appendix )" + re.escape(p) + r"(?!\d)" for s in scopes
                                 for p in re.findall(_PLACE, s)})
        if n.where not in places:
            out.append(f"its text names {', '.join(places) or 'no table or figure'}, not {n.where}")
    elif not scopes[3].startswith(n.where.removeprefix("§").split(" (")[0] + " "):
        out.append(f"it is not in the text's section {n.where} (its section: {scopes[3][:40]}...)")
    if n.dataset:
        named = _named(scopes, {d: r"(?<![A-Za-z])" + name for d, name in DATASET_NAMES.items()})
        if n.dataset not in named:
            out.append(f"its text names {', '.join(named) or 'no dataset'}, not {n.dataset}")
    if n.generator:
        model = n.generator.split(" (")[0]
        named = _named([_key(s) for s in scopes], {m: _key(m) for m in MODELS})
        if model not in named:
            out.append(f"its text names {', '.join(named) or 'no model'}, not {model}")
    if n.paper == ZERO_RAG and n.pruning_ratio is not None:
        in_quote = _named(scopes[:1], RATIOS)
        named = _named(scopes[:2], RATIOS)
        # an unpruned row may go unnamed ("for Zero-RAG" beside "Zero-RAG with a 30% pruned corpus"), a pruned one not
        if (n.pruning_ratio == 0 and in_quote and 0.0 not in in_quote) or (n.pruning_ratio and n.pruning_ratio not
                                                                          in named):
            out.append(f"its text names the pruning ratios {named or 'none'}, not {n.pruning_ratio:g}")
    return out


def _key(text: str) -> str:
    return "".join(c for c in text.lower() if c.isalnum())


def _order_problems(numbers, scopes: dict[str, list[str]]) -> list[str]:
    """Numbers that share a quote stand in it in the order they are listed, row by row and column by column, and a
    row's datasets in the order its text names them: a number moved to another row or column fails."""
    out = []
    by_quote: dict[str, list[PaperNumber]] = {}
    for n in numbers:
        by_quote.setdefault(_collapsed(n.quote), []).append(n)
    for quote, listed in by_quote.items():
        for along in ("row", "column"):
            groups: dict[tuple, list[PaperNumber]] = {}
            for n in listed:
                groups.setdefault((getattr(n, along), n.metric), []).append(n)
            for (name, _), group in groups.items():
                places = [_position(n.shown, quote) for n in group]
                if places != sorted(places):
                    out.append(f"{group[0].paper} {group[0].where} {along} {name}: {', '.join(n.shown for n in group)} "
                               f"stand in another order in {quote!r}")
                with_data = [n.dataset for n in sorted(group, key=lambda n: _position(n.shown, quote)) if n.dataset]
                named = _named(scopes.get(quote, []), {d: r"(?<![A-Za-z])" + v for d, v in DATASET_NAMES.items()})
                if along == "row" and len(with_data) == len(named) > 1 and with_data != named:
                    out.append(f"{group[0].paper} {group[0].where} row {name}: datasets {with_data}, the text's order "
                               f"{named}")
    return out


def citation_problems(texts: dict[str, str], numbers=NUMBERS, says=None) -> list[str]:
    """What in `numbers` (and the statements `says`, default SAYS) the papers' texts (`texts`: by paper) do not
    state: a quote not in its paper's text, a number not in its quote, a number whose text names another table or
    figure, dataset, model or pruning ratio, or one in another row or column. [] when every one is cited right."""
    says = SAYS if says is None else says
    out = []
    scopes: dict[str, list[str]] = {}
    for name, item in [(f"{n.paper} {n.where} {n.row} / {n.column}", n) for n in numbers] + list(says.items()):
        quote = _collapsed(item.quote)
        if quote not in _collapsed(texts[item.paper]):
            out.append(f"{name}: the {item.paper} text does not hold {item.quote!r}")
            continue
        for shown in (item.shown,) if isinstance(item, PaperNumber) else item.shown:
            if _position(shown, quote) < 0:
                out.append(f"{name}: {shown} is not in its quote {item.quote!r}")
        if isinstance(item, PaperNumber):
            scopes[quote] = scopes.get(quote) or _scopes(texts[item.paper], quote)
            out += [f"{name}: {p}" for p in _attribution_problems(item, scopes[quote])]
    return out + _order_problems(numbers, scopes)
