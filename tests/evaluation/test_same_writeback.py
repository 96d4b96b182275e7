"""Same-WB (WriteBack-RAG's Figure 4) reuses a write-back version for a method only when it was made as the grid
would make it: the same generator, embedder, training questions, gates, deduplication, validation, union and K; otherwise it trains one, saying which version differs and
in what. Versions are written by hand as `train_writeback` records them; the training itself is stubbed."""

from wbrag_ray.config import load_config
from wbrag_ray.run import RunFolder

TRAIN = "/d/flashrag/nq/train.jsonl"


def test_same_wb_reuses_a_version_only_when_every_setting_that_changes_its_units_matches(tmp_path, monkeypatch, capsys):
    from wbrag_ray.evaluation import methods_grid
    from wbrag_ray.evaluation.methods_grid import same_writeback_versions
    from wbrag_ray.evaluation.stage import union_settings
    from wbrag_ray.writeback.versions import WRITEBACK

    run = RunFolder(str(tmp_path / "run"))
    grid = load_config(overrides=[f"writeback.train={TRAIN}", "eval.methods=[no-retrieval, naive, replug-vote]"])

    def trained(version: str, *overrides: str) -> None:
        cfg = load_config(overrides=[f"writeback.train={TRAIN}", *overrides])
        params = {"version": version, "train": TRAIN, "method": None}
        folder = run.layout.writeback_version(version)
        folder.index.mkdir()
        stats = {"version": version, "rag_method": cfg.writeback.rag_method, "gate_metric": "acc",
                 "union": union_settings(cfg), "settings": run.fingerprint(WRITEBACK, cfg, params)}
        folder.stats.write_json(stats)
        run.mark_complete(WRITEBACK.instance(params), stats)

    # naive: deduplicated otherwise, trained on the first 80 questions, or another hold-out: each passed over
    trained("1-dedupe", "writeback.dedupe_threshold=0.5")  # listed before "a": tried first
    trained("2-limit", "writeback.limit=80")
    trained("3-validation", "writeback.validation=null")
    trained("a")  # naive, as the grid would train it
    trained("b", "writeback.rag_method=replug-vote", "writeback.tau_s=0.3", "retrieval.union=score")
    trained("c", "writeback.rag_method=replug-vote", "generator.model=org/other", "retrieval.top_k=3")
    made = []
    monkeypatch.setattr(methods_grid, "train_writeback", lambda run, config, train, version: made.append(
        (version, config.writeback.rag_method, config.writeback.activate)))
    assert same_writeback_versions(run, grid) == {"naive": "a", "replug-vote": "nq-train-replug-vote"}
    assert made == [("nq-train-replug-vote", "replug-vote", False)]
    printed = capsys.readouterr().out
    assert "Same-WB naive: reusing write-back version a (same generator, embedder, questions, gates, deduplication, " \
        "validation, union and K)" in printed
    said = printed[printed.index("Same-WB replug-vote: training write-back version nq-train-replug-vote: "):]
    assert "b (writeback.tau_s: 0.3 (the grid: 0.1); retrieval.union: {'union': 'score'" in said
    assert "c (generator: model 'org/other' (the grid: model 'bundled:smollm2'); retrieval.top_k: 3 (the grid: 5))" \
        in said
    # a version under the new name that differs too: the next name, not the other's stage
    trained("nq-train-replug-vote", "writeback.rag_method=replug-vote", "writeback.n_min=1")
    made.clear()
    assert same_writeback_versions(run, grid)["replug-vote"] == "nq-train-replug-vote-2"
