"""The report's corpus section counts sentences per passage one ingest file at a time; the histograms it adds up
equal a count over the whole sentence column."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wbrag_ray.report.sections import sentences_per_passage
from wbrag_ray.storage import resolve


def test_sentences_per_passage_from_per_file_histograms_equals_one_count_over_all(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "sentences"
    folder.mkdir()
    all_pids = []
    for i in range(3):  # ingest shards: each passage's sentences in its shard's file
        sizes = rng.integers(1, 9 + 4 * i, size=50)
        pids = np.repeat(np.arange(50) + 1000 * i, sizes)
        all_pids.append(pids)
        pq.write_table(pa.table({"sid": np.arange(len(pids)), "pid": pids}), folder / f"part-{i:05d}.parquet")
    histogram = sentences_per_passage(resolve(str(folder)))
    expected = np.bincount(pc.value_counts(pa.array(np.concatenate(all_pids))).field("counts").to_numpy())
    np.testing.assert_array_equal(histogram, expected)
    assert histogram.sum() == 150 and (np.arange(len(histogram)) * histogram).sum() == sum(map(len, all_pids))
