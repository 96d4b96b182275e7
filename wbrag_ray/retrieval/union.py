"""The union of the base index and the write-back index: which of their hits take the K slots of a prompt.

WriteBack-RAG merges the two indices' hits by raw score and cuts the top K (`score`, kept to reproduce the
paper). Measured on held-out questions (benchmarks/writeback_union.py) that merge lets a unit take a slot while
adding nothing: a unit distilled from passages already in the top K pushes out a passage the reader needed, and
units, short and focused, score above full passages about the same entity. So `retrieval.union` chooses (what
each name does is one entry of UNIONS):

    score        the paper's plain merge by score
    provenance   the merge by score under the provenance rule: a unit whose source passages are all in the top
                 K (or whose text a taken hit already holds) takes no slot; its slot goes to the next hit
    rrf          reciprocal rank fusion (each index ranks its own hits; 1 / (rrf_k + rank)), then the same rule:
                 the scores of two indices of different text lengths are never compared
    gate         the merge by score, where a unit takes a slot only if it matches the query at least as well as
                 the query's best passage does (its score >= the best base score - `retrieval.gate_margin`):
                 each index is calibrated against the other per query, so a unit about a neighbouring fact,
                 which a short text's high cosine lets into the paper's top K, stays out; then the provenance rule
    gate-no-provenance   the gate without the provenance rule (kept to measure what the rule does under the gate)

`retrieval.max_units` caps the write-back hits per query in every setting but `score`. The default is `gate`, chosen
on the validation half of the 120 held-out questions of benchmarks/writeback_union.py (60, split by a hash of
their ids, 30 of each group) and reported on the other half (benchmarks/RESULTS.md, "Write-back that never hurts"):
on the validation half only the two gates did not fall below the base (acc 0.733 both, none lost; the tie went to
`gate`, which gave fewer questions a unit), while `score`, `provenance` and a quota of one lost a question and
`rrf` nine. On the test half `gate` measured the base's acc (0.733; a unit in 2 top Ks, none won, none lost): it
guards against a version that hurts, it did not make this one help. The provenance rule under the gate measured
neither better nor worse than the gate without it (the same acc on both halves; it took 2 of 4 units out), so it
applies. A unit's provenance (the ids of the base documents it was distilled from, and the kind of unit that index
holds) is written beside the write-back index (`provenance.parquet`) when the version is trained, and read by
whoever searches the union.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from wbrag_ray.retrieval.hits import Hit, merge_top_k

if TYPE_CHECKING:
    from wbrag_ray.config import RetrievalConfig
    from wbrag_ray.storage import Location

BASE = "base"  # the source of the base index's hits; every other source is a write-back index
PROVENANCE = "provenance.parquet"
UNIT_KEY = b"wbrag.source_unit"  # schema metadata: the unit (passage / sentence) the source ids number

# --- orderings: the candidates of one query, best first --------------------------------------------------


def by_score(hit_lists: list[list[Hit]], rrf_k: int) -> list[Hit]:
    """Every index's hits by raw score (stable: on a tie, the earlier index's hit first)."""
    pool = [h for hits in hit_lists for h in hits]
    order = merge_top_k(np.array([[h.score for h in pool]], np.float32), len(pool))[0] if pool else []
    return [pool[j] for j in order]


def by_reciprocal_rank(hit_lists: list[list[Hit]], rrf_k: int) -> list[Hit]:
    """Reciprocal rank fusion: a hit's fused score is 1 / (rrf_k + its 1-based rank in its own index). Ids are
    namespaced, so a hit is ranked by one index only; on a tie the earlier index (the base) goes first."""
    pool = [(1.0 / (rrf_k + rank + 1), i, h) for i, hits in enumerate(hit_lists) for rank, h in enumerate(hits)]
    return [h for _, _, h in sorted(pool, key=lambda t: (-t[0], t[1]))]


@dataclass(frozen=True)
class UnionKind:
    """What one `retrieval.union` name does: how it orders the candidates, whether units must reach the query's
    best passage (the gate), whether the provenance rule drops covered units, whether `retrieval.max_units` caps
    them, and the retrieval setting only it reads."""

    ordering: Callable[[list[list[Hit]], int], list[Hit]]
    gate: bool = False
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
}
PAPER_UNION = "score"
PROVENANCE_RULE = tuple(name for name, u in UNIONS.items() if u.provenance_rule)  # a covered unit takes no slot
OWN_SETTING = {name: u.own_setting for name, u in UNIONS.items() if u.own_setting}  # the setting only it reads


def gated(ordered: list[Hit], margin: float) -> list[Hit]:
    """`ordered` without the units that score below the query's best passage by more than `margin` (every unit
    stays when no passage was retrieved: nothing to calibrate against)."""
    best = max((h.score for h in ordered if h.source == BASE), default=None)
    if best is None:
        return ordered
    return [h for h in ordered if h.source == BASE or h.score >= best - margin]


# --- the provenance rule -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)  # a query's hits are compared pairwise, and again after each dropped unit
def _words(text: str) -> str:
    from wbrag_ray.metrics import normalize_answer

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

    union: str = "gate"  # retrieval.union's default
    max_units: int | None = None
    rrf_k: int = 60
    gate_margin: float = 0.0

    def __post_init__(self):
        if self.union not in UNIONS:
            raise ValueError(f"retrieval.union: {self.union!r} is not one of {', '.join(UNIONS)}")

    @classmethod
    def of(cls, retrieval: RetrievalConfig) -> UnionRule:
        return cls(retrieval.union, retrieval.max_units, retrieval.rrf_k, retrieval.gate_margin)

    def __call__(self, hit_lists: list[list[Hit]], k: int) -> list[Hit]:
        """The top k, re-ranked 0..k-1; each hit keeps its source, score and provenance."""
        kind = UNIONS[self.union]
        ordered = kind.ordering(hit_lists, self.rrf_k)
        if kind.gate:
            ordered = gated(ordered, self.gate_margin)
        top = take(ordered, k, rule=kind.provenance_rule, max_units=self.max_units if kind.cap else None)
        return [replace(h, rank=r) for r, h in enumerate(top)]


# --- provenance beside the write-back index --------------------------------------------------------------


def write_provenance(index: Location, ids, source_ids, source_unit: str) -> None:
    """Each unit's source documents (ids in the base index, whose documents are `source_unit`s)."""
    import pyarrow as pa

    table = pa.table({"id": pa.array(ids, pa.int64()), "source_ids": pa.array(source_ids, pa.list_(pa.int64()))})
    index.join(PROVENANCE).write_table(table.replace_schema_metadata({UNIT_KEY: source_unit.encode()}))


def read_provenance(index: Location, base_unit: str) -> dict[int, list[int]]:
    """{unit id: its source ids} of a write-back index, when its sources number `base_unit`s as the base searched
    beside it does ({} otherwise: a version trained on passages says nothing about the sentences of a pruned
    index, whose ids are another namespace). One row per unit: a version holds at most one per training
    question."""
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
    `provenance[i]` its units' sources ({} for the base), `rule` the union (`UnionRule.of(retrieval)`). The one
    union of the in-process retriever (`retrieval.local.UnionRetriever`) and the service
    (`retrieval.service.RetrievalService`); one index alone is its own top k."""
    tagged = [with_provenance(hits, p) for hits, p in zip(per_member, provenance, strict=True)]
    if len(tagged) == 1:
        return tagged[0]
    return [rule(list(hit_lists), k) for hit_lists in zip(*tagged, strict=True)]
