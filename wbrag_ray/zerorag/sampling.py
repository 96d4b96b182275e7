"""The mastery sample: a uniform sample of sentences, the same on any number of nodes and in any order."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from wbrag_ray.ray_runtime import LIGHT_CPUS, select_rows
from wbrag_ray.run import RunFolder


def splitmix64(x: np.ndarray, seed: int) -> np.ndarray:
    """A well-mixed 64-bit hash of each id: the same sample on any number of nodes, in any order."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def sample_sentences(run: RunFolder, seed: int, n: int) -> pd.DataFrame:
    """The `n` sentences with the smallest `seed`ed hash of their sid: a distributed filter, then an exact cut."""
    import ray
    import ray.data

    total = run.stats("ingest")["sentences"]
    src = run.layout.ingest.sentences
    frac = _sample_fraction(n, total)
    while True:
        cut = np.uint64(min(2**64 - 1, int(frac * (2**64 - 1))))

        def below(batch: pa.Table, cut=cut) -> pa.Table:
            keys = splitmix64(batch["sid"].to_numpy(), seed)
            return batch.append_column("_key", pa.array(keys)).filter(pa.array(keys <= cut))

        ds = ray.data.read_parquet(src.path, filesystem=src.fs, columns=["sid", "pid", "text"],
                                   num_cpus=LIGHT_CPUS)
        ds = ds.map_batches(below, batch_format="pyarrow", num_cpus=LIGHT_CPUS)
        tables = [t for t in ray.get(ds.to_arrow_refs()) if t.num_rows]
        found = pa.concat_tables(tables).to_pandas() if tables else pd.DataFrame(columns=["sid", "pid", "text", "_key"])
        if len(found) >= min(n, total) or frac >= 1.0:
            break
        frac = min(1.0, frac * 2)  # too few below the cut (the margin makes this rare): widen it and rescan
    found = found.sort_values("_key", kind="stable").head(n).drop(columns="_key")
    titles = select_rows(run.layout.ingest.passages, "pid", found["pid"].to_numpy(), ["pid", "title"])
    found["title"] = found["pid"].map(titles.set_index("pid")["title"]).fillna("")
    return found.sort_values("sid").reset_index(drop=True)


def _sample_fraction(n: int, total: int) -> float:
    """Hash cut with a margin of five standard deviations, so one pass almost always finds n candidates."""
    p = n / max(total, 1)
    return min(1.0, p + 5 * np.sqrt(p * (1 - p) / max(total, 1)) + 16 / max(total, 1))


def titled(titles, texts) -> list[str]:
    """'title: sentence', what a sentence is about and what it says: the QA writer's input and the LM pruner's."""
    return [f"{t}: {x}" if t else x for t, x in zip(titles, texts, strict=True)]
