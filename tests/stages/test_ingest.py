"""Ingest: byte-range shards of one big file, stable ids, bad input reconciliation, Parquet input, resume."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import demo_records, write_jsonl
from wbrag_ray.config import IngestConfig
from wbrag_ray.formats import iter_jsonl
from wbrag_ray.layout import IngestFolder
from wbrag_ray.stages.ingest import FILE_BITS, Segmenter, plan_shards, run_ingest
from wbrag_ray.storage import resolve


def _folder(path) -> IngestFolder:
    return IngestFolder(resolve(str(path)))


def test_segmenter_keeps_abbreviations_and_decimals_inside_sentences():
    s = Segmenter().split("Dr. Smith moved to the U.S. in 1953. Pi is about 3.14. Is it? Yes.")
    assert s == ["Dr. Smith moved to the U.S. in 1953.", "Pi is about 3.14.", "Is it?", "Yes."]


def test_iter_jsonl_reads_every_line_once_across_any_cut(tmp_path):
    lines = [json.dumps({"id": i, "contents": "T\n" + "x" * (i % 17)}).encode() for i in range(200)]
    f = tmp_path / "c.jsonl"
    f.write_bytes(b"\n".join(lines))  # no trailing newline: the last line must still be read
    loc = resolve(str(f))
    size = f.stat().st_size
    for cut in (1, 7, 64, 333, size):
        got = []
        for start in range(0, size, cut):
            got += [line for _, line in iter_jsonl(loc, start, min(start + cut, size), chunk=50)]
        assert got == lines, cut


def test_big_single_file_is_streamed_in_many_shards_with_stable_unique_ids(tmp_path, ray_cluster):
    base = demo_records()
    records = [{"id": f"{r['id']}-{k}", "contents": r["contents"]} for k in range(60) for r in base]
    corpus = write_jsonl(tmp_path / "big.jsonl", records)
    assert corpus.stat().st_size > 2_000_000
    config = IngestConfig(shard_bytes=256 * 1024)
    shards = plan_shards(str(corpus), config)
    assert len(shards) >= 8

    out = _folder(tmp_path / "run1")
    stats = run_ingest(str(corpus), out.root.uri, config)
    assert stats["rows_in"] == len(records) == stats["rows_out"] and stats["rows_rejected"] == 0
    passages = out.passages.read_table()
    sentences = out.sentences.read_table()
    assert len(set(passages["pid"].to_pylist())) == len(records)
    assert sorted(passages["doc_id"].to_pylist()) == sorted(r["id"] for r in records)
    assert len(set(sentences["sid"].to_pylist())) == sentences.num_rows == stats["sentences"]
    assert set(sentences["pid"].to_pylist()) == set(passages["pid"].to_pylist())
    # every shard wrote its own files, each with bounded row groups
    assert len(out.passages.list_files(".parquet")) == len(shards)

    # a second run into another folder gives the very same ids
    out2 = _folder(tmp_path / "run2")
    stats2 = run_ingest(str(corpus), out2.root.uri, config)
    assert stats2["sentences"] == stats["sentences"]
    p2 = out2.passages.read_table()
    assert sorted(zip(p2["doc_id"].to_pylist(), p2["pid"].to_pylist(), strict=True)) == sorted(
        zip(passages["doc_id"].to_pylist(), passages["pid"].to_pylist(), strict=True)
    )


def test_bad_input_is_rejected_with_reasons_and_reconciles(tmp_path, ray_cluster):
    good = demo_records(6)
    lines = [
        good[0],
        b'{"id": "broken", "contents": "Title\\ntext',  # malformed json
        {"id": "empty", "contents": "   "},
        good[1],
        {"id": good[1]["id"], "contents": "Other\nA later record that reuses an id."},  # duplicate id
        b'{"id": "bad-utf8", "contents": "T\\nbad \xff\xfe bytes"}',
        {"id": "huge", "contents": "Huge\n" + ("word " * 210_000)},  # ~1 MB passage
        {"contents": "No id\nText."},
        good[2],
        b"",
        {"id": 7, "contents": "Numeric id\nIds may be numbers in FlashRAG files."},
    ]
    corpus = write_jsonl(tmp_path / "bad.jsonl", lines)
    out = _folder(tmp_path / "run")
    stats = run_ingest(str(corpus), out.root.uri, IngestConfig(shard_bytes=4096))
    rejects = out.rejects.read_table().to_pylist()
    reasons = {r["doc_id"] or r["reason"]: r["reason"] for r in rejects}
    assert stats["rows_in"] == len(lines)
    assert stats["rows_in"] == stats["rows_out"] + stats["rows_rejected"]
    assert stats["rows_rejected"] == len(rejects) == 7
    assert "malformed JSON" in reasons["broken"]
    assert reasons["empty"] == "empty contents"
    assert "duplicate id" in reasons[good[1]["id"]]
    assert "invalid UTF-8" in reasons["bad-utf8"]
    assert "passage too long" in reasons["huge"]
    assert "missing 'id'" in reasons
    assert "blank line" in reasons
    kept = out.passages.read_table()
    assert sorted(kept["doc_id"].to_pylist()) == sorted([good[0]["id"], good[1]["id"], good[2]["id"], "7"])
    # the duplicate's sentences went with it
    sentences = out.sentences.read_table()
    assert set(sentences["pid"].to_pylist()) == set(kept["pid"].to_pylist())
    # rerunning is idempotent: same counts, nothing duplicated
    stats2 = run_ingest(str(corpus), out.root.uri, IngestConfig(shard_bytes=4096))
    assert (stats2["rows_out"], stats2["rows_rejected"]) == (stats["rows_out"], stats["rows_rejected"])


def test_parquet_corpus_and_title_text_columns(tmp_path, ray_cluster):
    recs = demo_records(30)
    table = pa.table({"id": [r["id"] for r in recs], "contents": [r["contents"] for r in recs]})
    (tmp_path / "corpus").mkdir()
    pq.write_table(table.slice(0, 20), tmp_path / "corpus" / "a.parquet", row_group_size=5)
    titled = pa.table({
        "id": [r["id"] + "-t" for r in recs[20:]],
        "title": [r["contents"].split("\n")[0] for r in recs[20:]],
        "text": [r["contents"].split("\n", 1)[1] for r in recs[20:]],
    })
    pq.write_table(titled, tmp_path / "corpus" / "b.parquet")
    out = _folder(tmp_path / "run")
    stats = run_ingest(str(tmp_path / "corpus"), out.root.uri, IngestConfig(shard_bytes=1024))
    assert stats["rows_out"] == 30 and stats["rows_rejected"] == 0
    passages = out.passages.read_table().to_pylist()
    assert {p["pid"] >> FILE_BITS for p in passages} == {0, 1}
    assert all(p["title"] and p["text"] for p in passages)


def test_a_rerun_skips_complete_shards_and_redoes_lost_or_half_written_ones(tmp_path, ray_cluster, capsys):
    """A crash's leftovers: one shard lost its outputs and marker, one left half-written outputs (a truncated
    file, an unfinished temporary one) and no marker. The rerun redoes those two from the corpus and leaves the
    complete shards' files as they were; the result is the first run's, row for row."""
    import os

    corpus = write_jsonl(tmp_path / "c.jsonl", demo_records() * 1)
    config = IngestConfig(shard_bytes=8 * 1024)
    out = _folder(tmp_path / "run")
    first = run_ingest(str(corpus), out.root.uri, config)
    n_shards = first["shards"]
    assert n_shards >= 4

    def rows(folder):
        return sorted(tuple(r.values()) for r in folder.read_table().to_pylist())

    before = rows(out.passages), rows(out.sentences)
    lost, half, kept = "part-00000", "part-00002", "part-00001"
    for loc in (*out.shard_outputs(lost)[:2], out.shard_marker(lost), out.shard_marker(half)):
        loc.delete()
    passages_file, sentences_file, _ = out.shard_outputs(half)
    data = open(passages_file.path, "rb").read()
    open(passages_file.path, "wb").write(data[: len(data) // 2])  # cut short
    open(sentences_file.path + ".inprogress", "wb").write(b"PAR1 unfinished")
    untouched = {loc.path: os.stat(loc.path).st_ino for loc in out.shard_outputs(kept)}

    capsys.readouterr()
    second = run_ingest(str(corpus), out.root.uri, config)
    log = capsys.readouterr().out
    assert f"resuming: {n_shards - 2}/{n_shards}" in log
    assert (rows(out.passages), rows(out.sentences)) == before
    assert {k: second[k] for k in ("rows_in", "rows_out", "rows_rejected", "sentences")} == \
        {k: first[k] for k in ("rows_in", "rows_out", "rows_rejected", "sentences")}
    assert {path: os.stat(path).st_ino for path in untouched} == untouched  # not rewritten
    assert not os.path.exists(sentences_file.path + ".inprogress")


def test_missing_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        plan_shards(str(tmp_path / "nope.jsonl"), IngestConfig())
