"""The union of the base index and the write-back index: which of their hits take the K slots of a prompt.

WriteBack-RAG merges the two indices' hits by raw score and cuts the top K (`score`, kept to reproduce the paper).
That merge can let a unit take a slot while adding nothing (a unit distilled from passages already in the top K),
so `retrieval.union` chooses a rule: each name is one entry of UNIONS, described on the config field. `auto` (the
default) takes the rule the write-back version chose on its own validation split (`writeback.validation`, written
as UNION_CHOICE beside its index), FALLBACK_UNION where it chose none: no fixed rule served every version
(benchmarks/RESULTS.md). A unit's provenance (its base documents' ids) is written beside the write-back index
(PROVENANCE) when the version is trained.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from wbrag_ray.metrics import normalize_answer
from wbrag_ray.retrieval.hits import Hit

if TYPE_CHECKING:
    from wbrag_ray.config import RetrievalConfig
    from wbrag_ray.storage import Location

BASE = "base"  # the source of the base index's hits; every other source is a write-back index
PROVENANCE = "provenance.parquet"
UNION_CHOICE = "union.json"  # beside a write-back index: the rule its validation chose (what `auto` searches with)
UNIT_KEY = b"wbrag.source_unit"  # schema metadata: the unit (passage / sentence) the source ids number

# --- orderings: the candidates of one query, best first --------------------------------------------------


def by_score(hit_lists: list[list[Hit]], rrf_k: int) -> list[Hit]:
    """Every index's hits by raw score (stable: on a tie, the earlier index's hit first)."""
    return sorted((h for hits in hit_lists for h in hits), key=lambda h: -h.score)


def by_reciprocal_rank(hit_lists: list[list[Hit]], rrf_k: int) -> list[Hit]:
    """Reciprocal rank fusion: a hit's fused score is 1 / (rrf_k + its 1-based rank in its own index). Ids are
    namespaced, so a hit is ranked by one index only; on a tie the earlier index (the base) goes first."""
    pool = [(1.0 / (rrf_k + rank + 1), i, h) for i, hits in enumerate(hit_lists) for rank, h in enumerate(hits)]
    return [h for _, _, h in sorted(pool, key=lambda t: (-t[0], t[1]))]


@dataclass(frozen=True)
class UnionKind:
    """What one `retrieval.union` name does, and the retrieval setting only it reads."""

    ordering: Callable[[list[list[Hit]], int], list[Hit]]
    gate: bool = False
    additive: bool = False
    provenance_rule: bool = True
    cap: bool = True
    own_setting: str | None = None


# Every union name, in one place: what it does is a function of its name alone.
UNIONS: dict[str, UnionKind] = {
    "score": UnionKind(by_score, provenance_rule=False, cap=False),  # WriteBack-RAG's merge: only scores decide
    "provenance": UnionKind(by_score),
    "rrf": UnionKind(by_reciprocal_rank, own_setting="rrf_k"),
    "gate": UnionKind(by_score, gate=True, own_setting="gate_margin"),
    "gate-no-provenance": UnionKind(by_score, gate=True, provenance_rule=False, own_setting="gate_margin"),
    "additive": UnionKind(by_score, additive=True, own_setting="additive_margin"),
}
PAPER_UNION = "score"
AUTO = "auto"  # retrieval.union's default: the version's own choice (UNION_CHOICE)
# auto's rule where the version chose none: the paper's merge by score, with the provenance guard
FALLBACK_UNION = "provenance"
ADDITIVE_UNITS = 1  # units the additive rule appends where retrieval.max_units is unset: a prompt of K + 1 documents


OWN_SETTING = {name: u.own_setting for name, u in UNIONS.items() if u.own_setting}  # the setting only it reads


def gated(ordered: list[Hit], margin: float) -> list[Hit]:
    """`ordered` without the units that score below the query's best passage by more than `margin` (every unit
    stays when no passage was retrieved: nothing to calibrate against)."""
    best = max((h.score for h in ordered if h.source == BASE), default=None)
    if best is None:
        return ordered
    return [h for h in ordered if h.source == BASE or h.score >= best - margin]


def appended(ordered: list[Hit], k: int, margin: float, rule: bool, max_units: int) -> list[Hit]:
    """The additive union: the base's first k hits of `ordered`, whole, then up to `max_units` units scoring at
    least the k-th passage less `margin` (one the paper's merge would have let in; a short unit rarely outscores
    the best passage), each not `covered` when `rule`. No unit takes a passage's slot."""
    passages = [h for h in ordered if h.source == BASE][:k]
    floor = passages[-1].score - margin if len(passages) == k else float("-inf")
    units: list[Hit] = []
    for h in ordered:
        if len(units) >= max_units:
            break
        if h.source != BASE and h.score >= floor and not (rule and covered(h, units, passages)):
            units.append(h)
    return passages + units


# --- the provenance rule -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)  # a query's hits are compared pairwise, and again after each dropped unit
def _words(text: str) -> str:
    return f" {normalize_answer(text)} "  # padded: containment is by whole words


def covered(unit: Hit, before: list[Hit], taken: list[Hit]) -> bool:
    """A unit adds nothing the reader does not have: its source passages are all among the taken hits, or a
    taken passage (or a unit taken before it) already holds its text."""
    passages = {h.id for h in taken if h.source == BASE}
    if unit.sources and set(unit.sources) <= passages:
        return True
    words = _words(unit.text)
    return any(words in _words(h.text) for h in taken if h.source == BASE) or any(
        words in _words(h.text) for h in before if h.source != BASE)


def take(ordered: list[Hit], k: int, rule: bool, max_units: int | None) -> list[Hit]:
    """The first k hits of `ordered` that take a slot. A unit the rule finds covered is dropped and the slots
    are taken again from the start: dropping a unit only lets more passages in, so the set of dropped units
    grows until none of the taken ones is covered. `max_units`: at most that many units take slots."""
    dropped: set[tuple[str, int]] = set()
    while True:
        taken: list[Hit] = []
        units = 0
        for h in ordered:
            is_unit = h.source != BASE
            if h.key in dropped or (is_unit and max_units is not None and units >= max_units):
                continue
            taken.append(h)
            units += is_unit
            if len(taken) == k:
                break
        if not rule:  # the paper's merge (or the gate without the rule): no unit's provenance is looked at
            return taken
        redundant = {h.key for i, h in enumerate(taken) if h.source != BASE and covered(h, taken[:i], taken)}
        if not redundant:
            return taken
        dropped |= redundant


@dataclass(frozen=True)
class UnionRule:
    """How one query's hits from several indices become its top K (`retrieval.union`, `retrieval.max_units`,
    `retrieval.rrf_k`, `retrieval.gate_margin`)."""

    union: str = AUTO  # retrieval.union's default
    max_units: int | None = None
    rrf_k: int = 60
    gate_margin: float = 0.0
    additive_margin: float = 0.0  # retrieval.additive_margin's default

    def __post_init__(self):
        if self.union not in UNIONS and self.union != AUTO:
            raise ValueError(f"retrieval.union: {self.union!r} is not one of {', '.join([AUTO, *UNIONS])}")

    @classmethod
    def of(cls, retrieval: RetrievalConfig) -> UnionRule:
        return cls(retrieval.union, retrieval.max_units, retrieval.rrf_k, retrieval.gate_margin,
                   retrieval.additive_margin)

    def resolved(self, writeback_indices: list[Location]) -> UnionRule:
        """The rule a search of the base beside these write-back indices uses: under `auto`, the first one's
        chosen rule (`read_choice`), else FALLBACK_UNION with this rule's other settings; any other rule as is."""
        if self.union != AUTO:
            return self
        chosen = next((c for c in map(read_choice, writeback_indices) if c is not None), None)
        return replace(self, **(chosen or {"union": FALLBACK_UNION}))

    @property
    def appended_units(self) -> int:
        """Units the additive rule appends after the base's K, so a prompt beside a write-back index holds up to K +
        these documents; 0 for every other rule (under `auto` a version chooses its rule at its validation)."""
        if self.union not in UNIONS or not UNIONS[self.union].additive:
            return 0
        return ADDITIVE_UNITS if self.max_units is None else self.max_units

    def settings(self) -> dict[str, Any]:
        """The rule's name and the settings it reads (`retrieval.max_units`, its own one), as recorded."""
        own = OWN_SETTING.get(self.union)
        return {"union": self.union, "max_units": self.max_units, **({own: getattr(self, own)} if own else {})}

    def __call__(self, hit_lists: list[list[Hit]], k: int) -> list[Hit]:
        """The top k (the additive rule: k passages and its units after them), re-ranked from 0; each hit keeps
        its source, score and provenance. An `auto` rule never resolved against a version is FALLBACK_UNION."""
        kind = UNIONS[FALLBACK_UNION if self.union == AUTO else self.union]
        ordered = kind.ordering(hit_lists, self.rrf_k)
        if kind.additive:
            top = appended(ordered, k, self.additive_margin, kind.provenance_rule, self.appended_units)
        else:
            if kind.gate:
                ordered = gated(ordered, self.gate_margin)
            top = take(ordered, k, rule=kind.provenance_rule, max_units=self.max_units if kind.cap else None)
        return [replace(h, rank=r) for r, h in enumerate(top)]


# --- the rule a version chose, beside its index ------------------------------------------------------


def write_choice(index: Location, rule: UnionRule, why: str) -> None:
    """The rule `auto` searches this write-back index with (`UnionRule.settings`), and why it was chosen."""
    index.join(UNION_CHOICE).write_json({**rule.settings(), "why": why})


def read_choice(index: Location) -> dict[str, Any] | None:
    """The UnionRule fields a write-back index's validation chose (None: it chose none)."""
    f = index.join(UNION_CHOICE)
    if not f.exists():
        return None
    known = {field.name for field in dataclasses.fields(UnionRule)}
    return {k: v for k, v in f.read_json().items() if k in known}


# --- provenance beside the write-back index --------------------------------------------------------------


def write_provenance(index: Location, ids, source_ids, source_unit: str) -> None:
    """Each unit's source documents (ids in the base index, whose documents are `source_unit`s)."""
    import pyarrow as pa

    table = pa.table({"id": pa.array(ids, pa.int64()), "source_ids": pa.array(source_ids, pa.list_(pa.int64()))})
    index.join(PROVENANCE).write_table(table.replace_schema_metadata({UNIT_KEY: source_unit.encode()}))


def read_provenance(index: Location, base_unit: str) -> dict[int, list[int]]:
    """{unit id: its source ids} of a write-back index, when its sources number `base_unit`s as the base searched
    beside it does ({} otherwise: passage ids say nothing about a pruned index's sentences)."""
    import pyarrow.parquet as pq

    f = index.join(PROVENANCE)
    if not f.exists():
        return {}
    table = pq.read_table(f.path, filesystem=f.fs)
    if (table.schema.metadata or {}).get(UNIT_KEY, b"").decode() != base_unit:
        return {}
    return dict(zip(table["id"].to_pylist(), table["source_ids"].to_pylist(), strict=True))


def with_provenance(hits: list[list[Hit]], provenance: dict[int, list[int]]) -> list[list[Hit]]:
    if not provenance:
        return hits
    return [[replace(h, sources=provenance.get(h.id)) for h in row] for row in hits]


def cut_union(per_member: list[list[list[Hit]]], provenance: list[dict[int, list[int]]], rule: UnionRule,
              k: int) -> list[list[Hit]]:
    """Each query's top k of several indices searched as one: `per_member[i][q]` are index i's hits for query q,
    `provenance[i]` its units' sources ({} for the base); one index alone is its own top k."""
    tagged = [with_provenance(hits, p) for hits, p in zip(per_member, provenance, strict=True)]
    if len(tagged) == 1:
        return tagged[0]
    return [rule(list(hit_lists), k) for hit_lists in zip(*tagged, strict=True)]
