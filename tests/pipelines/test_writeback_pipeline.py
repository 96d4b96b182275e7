"""Integration: WriteBack-RAG on a slice of the demo data on a local Ray cluster, through the `wbrag` command:
train a write-back index, search it with the base, evaluate base + write-back, roll back and re-activate; the
base index never changes. The models are the tiny random-weight ones (tests/tiny_models.py): the gates'
thresholds are set so every decision is known in advance, and what is checked is plumbing and bookkeeping."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import DATA, demo_questions, demo_records, write_jsonl
from wbrag_ray.cli import main
from wbrag_ray.config import load_config
from wbrag_ray.retrieval.local import IndexUnion, Retriever, load_query_embedder
from wbrag_ray.retrieval.union import UnionRule
from wbrag_ray.run import RunFolder
from wbrag_ray.writeback.distill import WRITEBACK_ID_BASE
from wbrag_ray.writeback.versions import active_index, hurts, read_active

SENTINEL = "Quxilon-42"  # a gold alias that is in no question and no document: it must reach no distiller prompt
N_TRAIN = 2


def _base_index_hash(run) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(RunFolder(str(run)).layout.index.path).iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _version(trained, version: str):
    """The trained run's write-back version folder."""
    return RunFolder(str(trained["run"])).layout.writeback_version(version)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_cluster, tiny):
    d = tmp_path_factory.mktemp("wb")
    train = [json.loads(line) for line in (DATA / "demo_train.jsonl").read_text().splitlines()][:N_TRAIN]
    for t in train:
        t["golden_answers"] = [*t["golden_answers"], SENTINEL]
    test = demo_questions(2)
    wanted = {q["metadata"]["source_doc"] for q in train + test}
    records = [r for r in demo_records() if r["id"] in wanted] + [r for r in demo_records() if r["id"] not in wanted][:10]
    corpus = write_jsonl(d / "corpus.jsonl", records)
    train_file = write_jsonl(d / "train.jsonl", train)
    test_file = write_jsonl(d / "test.jsonl", test)
    run = d / "run"
    cfg = d / "cfg.yaml"
    cfg.write_text(
        f"run: {run}\n"
        f"ingest:\n  corpus: {corpus}\n"
        + tiny.yaml(generator="  batch_size: 16\n  max_new_tokens: 8\n  num_cpus: 1\n  threads: 2\n",
                    embedder="  num_cpus: 1\n  threads: 2\n")
    )
    assert main(["run", str(cfg)]) == 0  # the base: ingest, embed, index
    base_hash = _base_index_hash(run)
    # Every example passes the utility gate and no document passes the document gate, so the decisions (and
    # Table 3) are known in advance: each unit comes from the top n_min=2 documents by the fallback.
    # RePlug's vote scores s_rag, so its per-document answers serve the document gate with no extra pass.
    assert main([
        "writeback", str(run), "--train", str(train_file),
        "--set", "writeback.tau_s=-1", "--set", "writeback.tau_delta=-2", "--set", "writeback.tau_doc=2",
        "--set", "writeback.rag_method=replug-vote",
        "--set", "writeback.extract_max_new_tokens=32", "--set", "writeback.rewrite_max_new_tokens=32",
    ]) == 0
    return {"run": run, "train": train, "test": test_file, "base_hash": base_hash, "version": "train"}


def test_table3_stats_json(trained):
    stats = _version(trained, "train").stats.read_json()
    assert stats["examples"] == N_TRAIN and stats["selection_rate"] == 1.0
    assert stats["fallback_rate"] == 1.0 and stats["mean_retained_docs"] == 2.0
    assert stats["rank_distribution"] == {"1": N_TRAIN, "2": N_TRAIN, "3": 0, "4": 0, "5": 0}
    assert stats["source_tokens"] > stats["distilled_tokens"] > 0
    assert stats["compression_ratio"] == pytest.approx(stats["source_tokens"] / stats["distilled_tokens"], abs=1e-3)
    dropped = sum(stats["units_dropped"].values())  # no retrievable statement (writeback.distill.statement_check)
    assert stats["units_written"] + stats["duplicates_merged"] + stats["empty_units"] + dropped == N_TRAIN
    # writeback.validation 'auto': too few training questions to hold any out, and the stats say so
    assert stats["validation"] == f"skipped, only {N_TRAIN} training questions (auto needs 100)"
    assert stats["activated"] is True
    # generator calls per pass: no-retrieval + K single-document answers, then one call per distiller step
    passes = stats["passes"]
    assert passes["answer"]["generator_calls"] == N_TRAIN * (1 + 5)
    assert "document_gate" not in passes
    assert passes["distill_extract"]["generator_calls"] == passes["distill_rewrite"]["generator_calls"] == N_TRAIN


def test_corpus_has_provenance_and_its_own_id_namespace(trained):
    units = pq.read_table(_version(trained, "train").units.path).to_pylist()
    assert units and all(u["id"] >= WRITEBACK_ID_BASE and u["unit_id"].startswith("wb:train:") for u in units)
    assert {u["source_example_id"] for u in units} <= {t["id"] for t in trained["train"]}
    assert all(u["source_doc_ranks"] == [0, 1] and len(u["source_doc_ids"]) == 2 and u["fallback"] for u in units)
    assert all(u["title"] and u["text"] for u in units)


def test_units_are_embedded_as_the_bulk_embed_pass_embeds_passages(trained):
    """The units' vectors come from the command's retrieval actors (`PassageVectorsStage`); they are the ones the
    embed pass's own stage gives the same 'Title\\ntext' in this process."""
    from wbrag_ray.build_kb import unit_text
    from wbrag_ray.index.files import vectors_of
    from wbrag_ray.stages.base import run_local
    from wbrag_ray.stages.embed import EmbedStage

    run = RunFolder(str(trained["run"]))
    config = load_config(extra=run.load_config().model_dump(mode="json"))
    folder = run.layout.writeback_version("train")
    units = pq.read_table(folder.units.path).to_pandas()
    stored = folder.embed_file.read_table()
    assert stored["id"].to_pylist() == units["id"].tolist()
    want = vectors_of(run_local(EmbedStage(config.embedder), unit_text(units[["id", "title", "text"]], "id")))
    np.testing.assert_allclose(vectors_of(stored), want, atol=1e-5)


def test_no_prompt_sent_to_the_distiller_contains_a_gold_answer(trained):
    sent = pq.read_table(_version(trained, "train").distill.path).to_pylist()
    assert len(sent) == N_TRAIN
    for row in sent:
        for column in ("extract_prompt", "rewrite_prompt"):
            assert SENTINEL.lower() not in row[column].lower()


def test_union_search_returns_write_back_hits_with_their_namespace(trained):
    run = RunFolder(str(trained["run"]))
    config = load_config(extra=run.load_config().model_dump(mode="json"))
    version, wb_index, wb_docs = active_index(run)
    assert version == "train"
    unit = pq.read_table(run.layout.writeback_version("train").units.path).to_pylist()[0]
    members = [Retriever(run.layout.index.uri, run.layout.ingest.root.uri, config.embedder),
               Retriever(wb_index, wb_docs, config.embedder, source="writeback")]
    query = [unit["title"] + "\n" + unit["text"]]
    vectors = load_query_embedder(config.embedder, members[0].dim, members[0].index_dir).encode_queries(query)
    hits = IndexUnion(members, UnionRule("score")).search_vectors(vectors, 5)[0]  # the paper's merge
    assert hits[0].source == "writeback" and hits[0].id == unit["id"] and hits[0].score > 0.99
    assert {h.source for h in hits} == {"base", "writeback"}
    assert [h.rank for h in hits] == list(range(5)) and hits == sorted(hits, key=lambda h: -h.score)
    assert all((h.id >= WRITEBACK_ID_BASE) == (h.source == "writeback") for h in hits)
    # each unit carries the ids of the passages it was distilled from, as the units file records them
    sources = {u["id"]: u["source_doc_ids"] for u in pq.read_table(run.layout.writeback_version("train").units.path).to_pylist()}
    assert all(h.sources == sources[h.id] for h in hits if h.source == "writeback")
    # the provenance-aware union: no unit whose sources are all among the passages it returns
    default = IndexUnion(members, UnionRule("provenance")).search_vectors(vectors, 5)[0]
    passages = {h.id for h in default if h.source == "base"}
    assert len(default) == 5 and not any(set(sources[h.id]) <= passages for h in default if h.source == "writeback")
    assert (unit["id"] in {h.id for h in default}) == (not set(sources[unit["id"]]) <= passages)


def test_eval_with_writeback_then_rollback_to_base_only(trained, capsys):
    run = trained["run"]
    args = ["eval", str(run), "--dataset", str(trained["test"]), "--methods", "naive", "--name", "t"]
    assert main([*args, "--writeback"]) == 0
    result = RunFolder(str(run)).layout.eval_result("t-writeback", "naive")
    metrics = result.metrics.read_json()
    assert metrics["setting"] == "base+writeback" and metrics["writeback_version"] == "train" and metrics["n"] == 2
    # retrieval.union auto, and what it searched with: this version held no questions out, so the fallback
    assert metrics["union"] == {"union": "auto", "max_units": None}
    assert metrics["union_searched"] == {"union": "provenance", "max_units": None}
    docs = [json.loads(p["docs"]) for p in pq.read_table(result.predictions.path).to_pylist()]
    assert all(len(d) == 5 for d in docs) and all(h["source"] in ("base", "writeback") for d in docs for h in d)

    assert main(["writeback", str(run), "--rollback"]) == 0
    assert read_active(RunFolder(str(run)))["version"] is None
    capsys.readouterr()
    assert main([*args, "--writeback"]) == 2
    assert "no active write-back index" in capsys.readouterr().err

    assert main(["writeback", str(run), "--activate", "train"]) == 0
    assert read_active(RunFolder(str(run)))["version"] == "train"
    assert main(["writeback", str(run), "--rollback", "base"]) == 0
    assert read_active(RunFolder(str(run))) == {"version": None, "history": ["train"]}
    assert main(["writeback", str(run), "--activate", "nope"]) == 2
    assert _base_index_hash(run) == trained["base_hash"]


def test_rerun_skips_a_trained_version_and_refuses_other_settings(trained, capsys):
    train = str(trained["run"].parent / "train.jsonl")
    capsys.readouterr()
    assert main(["writeback", str(trained["run"]), "--train", train]) == 0  # settings recorded in run.json
    assert "[writeback-train] complete, skipped" in capsys.readouterr().out
    assert main(["writeback", str(trained["run"]), "--train", train, "--set", "writeback.tau_doc=0.5"]) == 2
    assert "other settings" in capsys.readouterr().err
    assert _base_index_hash(trained["run"]) == trained["base_hash"]


@pytest.mark.slow
def test_adaptive_method_writes_back_and_every_method_is_evaluated_on_every_version(trained, capsys):
    """A second version trained under FLARE (threshold 1: every answer retrieves), then `wbrag eval --methods-grid`:
    the five methods on the base and beside both versions, same-method and cross-method."""
    run, train = trained["run"], str(trained["run"].parent / "train.jsonl")
    assert main([
        "writeback", str(run), "--train", train, "--version", "flare",
        "--set", "writeback.tau_s=-1", "--set", "writeback.tau_delta=-2", "--set", "writeback.tau_doc=2",
        "--set", "writeback.rag_method=flare", "--set", "rag.flare.threshold=1.0", "--set", "rag.flare.max_rounds=1",
        "--set", "writeback.extract_max_new_tokens=32", "--set", "writeback.rewrite_max_new_tokens=32",
    ]) == 0
    layout = RunFolder(str(run)).layout
    stats = layout.writeback_version("flare").stats.read_json()
    assert stats["rag_method"] == "flare" and stats["settings"]["config"]["rag.flare"]["threshold"] == 1.0
    assert {"flare:look-ahead-1", "flare:regenerate-1", "document_gate"} <= set(stats["passes"])
    scored = pq.read_table(layout.writeback_version("flare").scored.path).to_pylist()
    for ex in scored:  # the documents distilled are the ones FLARE retrieved and answered from
        rounds = json.loads(ex["rag_trace"])["rounds"]
        assert [h["id"] for h in json.loads(ex["docs"])] == rounds[0]["doc_ids"] and ex["useful"]
    dropped = sum(stats["units_dropped"].values())  # no retrievable statement (writeback.distill.statement_check)
    assert stats["units_written"] + stats["duplicates_merged"] + stats["empty_units"] + dropped == N_TRAIN

    capsys.readouterr()
    assert main(["eval", str(run), "--dataset", str(trained["test"]), "--name", "m", "--methods-grid",
                 "--set", "rag.flare.max_rounds=1"]) == 0
    printed = capsys.readouterr().out
    grid = layout.methods_grid().read_json()
    methods = ["no-retrieval", "naive", "replug", "replug-vote", "self-rag", "flare"]
    assert grid["methods"] == methods and grid["versions"] == {"train": "replug-vote", "flare": "flare"}
    cells = {(r["method"], r["version"]): r for r in grid["rows"]}
    expected = {(m, None) for m in methods} | {(m, v) for m in methods[1:] for v in ("train", "flare")}
    assert set(cells) == expected
    for (method, version), r in cells.items():
        assert r["n"] == 2 and 0 <= r["acc"] <= 1
        if version:
            assert r["same_method"] == (method == grid["versions"][version])
            assert r["delta"]["acc"] == pytest.approx(r["acc"] - cells[(method, None)]["acc"], abs=1e-4)
            metrics = layout.eval_result(f"m-grid-wb-{version}", method).metrics.read_json()
            assert metrics["writeback_version"] == version and metrics["setting"] == f"base+writeback:{version}"
    assert "RAG methods x knowledge base" in printed and "+wb flare [flare]" in printed
    # the union search reached the write-back index under an adaptive method too
    preds = pq.read_table(layout.eval_result("m-grid-wb-flare", "self-rag").predictions.path).to_pylist()
    traces = [json.loads(p["trace"]) for p in preds]
    assert all("retrieved" in t for t in traces)
    # a rerun with the same settings reuses every cell
    assert main(["eval", str(run), "--dataset", str(trained["test"]), "--name", "m", "--methods-grid",
                 "--set", "rag.flare.max_rounds=1"]) == 0
    assert capsys.readouterr().out.count("complete, skipped") == 3
    assert _base_index_hash(run) == trained["base_hash"]


@pytest.mark.slow
def test_same_writeback_trains_a_version_per_method_that_has_none_and_shows_figure4(trained, capsys):
    """`--same-writeback` (WriteBack-RAG's Figure 4, Same-WB): of naive and replug-vote, the second has a version
    written back under it from this training set (the fixture's), so only naive's is trained; each method is then
    evaluated on the base and beside its own version (and the cross cells), the active version untouched; a rerun
    trains nothing and reuses every cell. (Two methods, not three: a third adds four cells and its own training.)"""
    from wbrag_ray.report import write_report

    run, train = trained["run"], str(trained["run"].parent / "train.jsonl")
    layout = RunFolder(str(run)).layout
    active = read_active(RunFolder(str(run)))
    grid_args = ["eval", str(run), "--dataset", str(trained["test"]), "--name", "sw", "--methods",
                 "naive,replug-vote", "--methods-grid", "--same-writeback", "--set", f"writeback.train={train}",
                 "--set", "writeback.tau_s=-1", "--set", "writeback.tau_delta=-2", "--set", "writeback.tau_doc=2",
                 "--set", "writeback.extract_max_new_tokens=32", "--set", "writeback.rewrite_max_new_tokens=32",
                 "--set", "rag.flare.threshold=1.0", "--set", "rag.flare.max_rounds=1"]
    capsys.readouterr()
    assert main(grid_args) == 0
    printed = capsys.readouterr().out
    own = {"naive": "train-naive", "replug-vote": "train"}
    grid = layout.methods_grid().read_json()
    assert grid["same_writeback"] == own
    assert layout.writeback_version("train-naive").stats.read_json()["rag_method"] == "naive"
    assert read_active(RunFolder(str(run))) == active  # a Same-WB version is evaluated, not activated
    cells = {(r["method"], r["version"]): r for r in grid["rows"]}
    assert {(m, v) for m in own for v in (None, *own.values())} <= set(cells)  # the cross cells too
    for method, version in own.items():
        assert cells[(method, version)]["same_method"] and cells[(method, version)]["trained_with"] == method
    table = printed[printed.index("Same-WB on sw"):].splitlines()
    for line, (method, version) in zip(table[2:2 + len(own)], own.items(), strict=True):
        base, same = cells[(method, None)], cells[(method, version)]
        assert line.split()[:4] == [method, version, f"{base['em']:.3f}", f"{same['em']:.3f}"]
        assert f"({same['acc'] - base['acc']:+.3f})" in line
        # the cells' own answers: a question whose top K the version left alone kept its base answer (one command)
        got = [pq.read_table(layout.eval_result(label, method).predictions.path).to_pandas().set_index("id")
               for label in ("sw-grid", f"sw-grid-wb-{version}")]
        for qid, row in got[0].iterrows():
            if [h["id"] for h in json.loads(row["docs"])] == [h["id"] for h in json.loads(got[1].loc[qid, "docs"])]:
                assert got[1].loc[qid, "prediction"] == row["prediction"], (method, qid)
    write_report(RunFolder(str(run)))
    report = layout.report_markdown.read_bytes().decode()
    assert "Same-WB: each method on the base and beside the version written back under it" in report

    assert main(grid_args) == 0
    printed = capsys.readouterr().out
    # no training, no stage run again: each of the grid's three evaluations (base, beside each version) kept
    assert "[writeback-" not in printed and "] done:" not in printed, printed
    for label in ("sw-grid", "sw-grid-wb-train", "sw-grid-wb-train-naive"):
        assert f"[eval-{label}] complete, skipped" in printed, (label, printed)
    assert _base_index_hash(run) == trained["base_hash"]


def test_the_gates_sweep_reuses_one_scoring_pass_and_reproduces_the_trained_gates(trained, capsys):
    """The paper's Table 4 ablation: every setting gated again from the stored scores, no model call. Then the
    stored scores are replaced by hand-set ones no model could give (s_rag 3, document scores 5) and the sweep's
    rows are those of a hand computation over them: the sweep reads the scoring pass, it does not score again."""
    import pyarrow as pa

    sweep = ["writeback", str(trained["run"]), "--sweep", "train", "--tau-s=-1,2", "--tau-delta=-2",
             "--tau-doc=2,-1", "--n-min=1,2"]
    capsys.readouterr()
    assert main(sweep) == 0
    assert "no model calls" in capsys.readouterr().out
    rows = _version(trained, "train").sweep.read_json()["rows"]
    assert len(rows) == 2 * 1 * 2 * 2
    stats = _version(trained, "train").stats.read_json()
    same = next(r for r in rows if (r["tau_s"], r["tau_doc"], r["n_min"]) == (-1, 2, 2))  # the trained setting
    assert (same["selected"], same["mean_retained_docs"], same["fallback_rate"]) == \
        (stats["selected"], stats["mean_retained_docs"], stats["fallback_rate"])
    assert same["rank_distribution"] == {"1": N_TRAIN, "2": N_TRAIN} and same["doc_scored"] == N_TRAIN
    assert all(r["selected"] == 0 for r in rows if r["tau_s"] == 2)  # no score reaches 2
    loose = next(r for r in rows if (r["tau_s"], r["tau_doc"], r["n_min"]) == (-1, -1, 1))  # every document passes
    assert loose["fallback_rate"] == 0.0 and loose["mean_retained_docs"] > same["mean_retained_docs"]

    scored_loc, sweep_loc = _version(trained, "train").scored, _version(trained, "train").sweep
    saved = scored_loc.read_bytes(), sweep_loc.read_bytes()
    table = scored_loc.read_table()
    assert table.num_rows == N_TRAIN and "[]" not in table["docs"].to_pylist()
    hand = {"s_nr": [0.0, 0.0], "s_rag": [3.0, 0.5],
            "doc_scores": [json.dumps([0, 5, 0, 5, 0]), json.dumps([0, 0, 0, 0, 0])]}
    for name, values in hand.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))
    try:
        scored_loc.write_table(table)
        assert main(sweep) == 0
        got = {(r["tau_s"], r["tau_doc"], r["n_min"]): (r["selected"], r["doc_scored"], r["mean_retained_docs"],
                                                         r["fallback_rate"], r["rank_distribution"])
               for r in sweep_loc.read_json()["rows"]}
    finally:
        scored_loc.write_bytes(saved[0])
        sweep_loc.write_bytes(saved[1])
    every = {"1": 1, "2": 1, "3": 1, "4": 1, "5": 1}
    assert got == {  # by hand: example 0 alone reaches tau_s 2; its documents 2 and 4 pass tau_doc 2
        (2, 2, 1): (1, 1, 2.0, 0.0, {"2": 1, "4": 1}), (2, 2, 2): (1, 1, 2.0, 0.0, {"2": 1, "4": 1}),
        (2, -1, 1): (1, 1, 5.0, 0.0, every), (2, -1, 2): (1, 1, 5.0, 0.0, every),
        (-1, 2, 1): (2, 2, 1.5, 0.5, {"1": 1, "2": 1, "4": 1}), (-1, 2, 2): (2, 2, 2.0, 0.5, {"1": 1, "2": 2, "4": 1}),
        (-1, -1, 1): (2, 2, 5.0, 0.0, {k: 2 for k in every}), (-1, -1, 2): (2, 2, 5.0, 0.0, {k: 2 for k in every}),
    }


def test_validation_answers_held_out_questions_with_and_without_the_version_and_activate_warns(trained, capsys):
    """writeback.validation: a version trained with half of the two training questions held out (the one whose id
    hashes first, by hand below) is trained on the other alone and answers the held-out one with the base and with
    the version under every candidate union rule, checked against the evaluations' own predictions (an unchanged
    top K keeps its base answer); one question is too few to choose on, so `auto` searches it with the paper's merge
    with the provenance guard, written beside its index and said at the end of the command; a search under `auto`
    uses the rule written there; then --activate warns on a version that hurt. (Last in this file: its version is
    another naive one.)"""
    import hashlib

    from wbrag_ray.metrics import substring_match

    run = RunFolder(str(trained["run"]))
    ids = [t["id"] for t in trained["train"]]
    held = min(ids, key=lambda i: hashlib.blake2b(i.encode(), digest_size=8).digest())
    assert main(["writeback", str(trained["run"]), "--train", str(trained["run"].parent / "train.jsonl"),
                 "--version", "held", "--set", "writeback.validation=0.5", "--set", "writeback.rag_method=naive",
                 "--set", "writeback.activate=false",
                 "--set", "writeback.tau_s=-1", "--set", "writeback.tau_delta=-2", "--set", "writeback.tau_doc=2",
                 "--set", "writeback.extract_max_new_tokens=32", "--set", "writeback.rewrite_max_new_tokens=32"]) == 0
    version = run.layout.writeback_version("held")
    assert version.scored.read_table()["id"].to_pylist() == [i for i in ids if i != held]  # trained without it
    assert version.validation_questions.read_table()["id"].to_pylist() == [held]
    result = version.validation.read_json()
    out = capsys.readouterr().out
    preds = {name: pq.read_table(run.layout.eval_result(name, result["method"]).predictions.path).to_pylist()
             for name in ("writeback-held-validation-base", "writeback-held-validation-provenance")}
    base, union = preds["writeback-held-validation-base"], preds["writeback-held-validation-provenance"]
    assert len(base) == len(union) == result["questions"] == 1 and base[0]["id"] == union[0]["id"] == held
    acc = [substring_match(p[0]["prediction"], p[0]["golden_answers"]) for p in (base, union)]
    changed = [h["id"] for h in json.loads(base[0]["docs"])] != [h["id"] for h in json.loads(union[0]["docs"])]
    assert changed or union[0]["prediction"] == base[0]["prediction"]
    assert (result["base"], result["with_version"]) == (acc[0], acc[1])
    assert result["unit_in_top_k"] == int(any(h["source"] == "writeback" for h in json.loads(union[0]["docs"])))
    assert (result["won"], result["lost"]) == ((int(changed and acc[1] > acc[0]), int(changed and acc[1] < acc[0])))
    assert result["method"] == "naive" and result["configured"] == "auto"
    assert result["chosen"] == result["applied"] == result["union"] == "provenance"
    assert result["choice"] == ("1 validation questions are too few to choose on (at least 60): the paper's merge "
                                "with the provenance guard")
    # every candidate answered the held-out question, each in its own evaluation, its figures recorded
    from wbrag_ray.writeback.validation import CANDIDATES

    assert list(result["candidates"]) == [label for label, _ in CANDIDATES]
    for label, settings in CANDIDATES:
        ev = run.layout.eval_result(f"writeback-held-validation-{label.replace(' ', '-')}", "naive").metrics.read_json()
        assert ev["union"] == {"max_units": None, **settings} and ev["n"] == 1
        assert result["candidates"][label]["acc"] == ev["acc"] and result["candidates"][label]["union"] == settings[
            "union"]
    additive = pq.read_table(run.layout.eval_result("writeback-held-validation-additive", "naive")
                             .predictions.path).to_pylist()[0]
    assert len(json.loads(additive["docs"])) in (5, 6)  # the base's 5, and at most one unit after them
    assert [h["id"] for h in json.loads(additive["docs"])][:5] == [h["id"] for h in json.loads(base[0]["docs"])]
    # the choice beside the index, which `auto` reads; the command says what the version did
    assert version.index.join("union.json").read_json() == {"union": "provenance", "max_units": None,
                                                            "why": result["choice"]}
    assert version.stats.read_json()["union_auto"] == {"union": "provenance", "why": result["choice"]}
    assert "  chosen: provenance (1 validation questions are too few" in out
    assert (f"write-back held: {version.stats.read_json()['units_written']} units written, not active; union "
            "provenance (chosen on them: 1 validation questions") in out
    # the version's stats hold the same result, and that it was not activated (writeback.activate false)
    assert version.stats.read_json()["validation"] == {**result, "hurts": hurts(result), "activated": False}
    assert version.stats.read_json()["activated"] is False

    # a search under `auto` uses the rule beside the version's index (the paper's merge, once written there), in a
    # command's retrieval service and in the in-process retriever alike; the fallback where none is written
    from wbrag_ray.retrieval.stage import RetrievalSetting
    from wbrag_ray.retrieval.union import UnionRule, write_choice
    from wbrag_ray.stages.service import Services

    config = load_config(extra=run.load_config().model_dump(mode="json"))
    setting = RetrievalSetting(run.layout.index.uri, None, config.embedder, config.retrieval, config.index,
                               ((version.index.uri, None, "writeback"),))
    members = [Retriever(run.layout.index.uri, run.layout.ingest.root.uri, config.embedder),
               Retriever(version.index.uri, None, config.embedder, source="writeback")]
    assert config.retrieval.union == "auto"
    for written, searched in ((UnionRule("score"), UnionRule("score")), (None, UnionRule("provenance"))):
        if written is None:
            version.index.join("union.json").delete()
        else:
            write_choice(version.index, written, "written by this test")
        with Services() as services:
            assert setting.service(services).union == searched
        assert IndexUnion(members, UnionRule.of(config.retrieval)).union == searched

    hurt = {**result, "base": 1.0, "with_version": 0.0, "won": 0, "lost": 5}  # 5 lost, none won: beyond chance
    run.layout.writeback_version("train").validation.write_json(hurt)
    capsys.readouterr()
    assert main(["writeback", str(trained["run"]), "--activate", "train"]) == 0
    assert ("warning: write-back version train hurt on its validation questions (5 questions lost against 0 won "
            "(p = 0.031); acc 0.000 with it against 1.000 without)") in capsys.readouterr().out
    run.layout.writeback_version("train").validation.delete()
