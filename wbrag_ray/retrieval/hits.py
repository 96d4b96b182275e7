"""A retrieved document (`Hit`), the merge of per-shard results into one top K, and the JSON a `docs` column
carries between passes. Ids are unique inside one index only: a hit is identified by (source, id).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Hit:
    id: int
    score: float
    rank: int
    title: str
    text: str
    source: str = "base"  # which index the hit came from; (source, id) is the hit's identity
    # a write-back unit's provenance: the ids of the base documents it was distilled from (None: unknown, or a
    # base document)
    sources: list[int] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.source, self.id)


def merge_results(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids), each (n, k), best first, of several results over the same queries; a missing hit is id -1,
    score -inf; on a tie the earlier part's hit comes first."""
    scores = np.concatenate([s for s, _ in parts], axis=1).astype(np.float32, copy=True)
    ids = np.concatenate([i for _, i in parts], axis=1)
    scores[ids < 0] = -np.inf
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    scores, ids = np.take_along_axis(scores, top, axis=1), np.take_along_axis(ids, top, axis=1)
    if scores.shape[1] < k:  # fewer candidates than k in all: pad
        pad = k - scores.shape[1]
        scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
    return scores, ids


def hits_to_json(hits: list[Hit]) -> str:
    # provenance only where there is one: a base hit's JSON is as it always was
    return json.dumps([{k: v for k, v in asdict(h).items() if k != "sources" or v is not None} for h in hits],
                      ensure_ascii=False)


def hits_from_json(s: str) -> list[Hit]:
    return [Hit(**h) for h in json.loads(s)] if s else []
