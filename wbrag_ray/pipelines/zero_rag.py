"""Zero-RAG, top to bottom: find the sentences the model already knows, and prune them from the index.

    mastery:  sample sentences -> QA pairs (llm or cloze) -> closed-book answers -> mean EM per sentence
    pruner:   embedding head and / or LoRA LM regressor, trained on the scored sample, validated on a held-out part
    predict:  every sentence's predicted mastery, as a Ray Data pipeline (stored vectors or text in, scores out)
    prune R:  corpus-wide percentile (two-level histogram, only counts travel) -> keep mask -> pruned sentence
              corpus -> pruned index (from the stored vectors, no re-embedding)
    router:   P(the generator answers without retrieval) from the query; mastered queries skip retrieval
    tune:     noise-tolerant LoRA tuning of the generator (relevant / distracting / no documents)
    grid:     evaluation over pruning ratios x router x adapter, with retrieval latency and index size

Layout (RUN/zero_rag/...):
    mastery/qa.parquet, scores.parquet, stats.json     every QA pair, its status and answer; scores per sentence
    pruner/<kind>/                                     the pruner, metrics.json, validation.parquet
    predictions/                                       sid, mastery_pred for every sentence
    prune-<R>/keep/, sentences/, index/, stats.json    keep mask, pruned corpus, pruned index
    router/, adapter/                                  query router; LoRA adapter of the generator
    grid.json                                          one row per evaluated setting

Zero-RAG settings never count as a changed run config: each stage here records the settings it was made
with and refuses to be reused with others (pass --force to redo it).

Over 500 lines, not split yet: issue 14 turns it into a package (sampler, stages, the distributed
percentile, the grid); until then it reads top to bottom in the order of the method.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.pipelines.passes import GeneratorPasses, from_pandas
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import Location

ROOT = "zero_rag"
_REDO = "pass --force to redo it (and the stages after it)"


def _root(run: RunFolder, *parts: str) -> Location:
    return run.path(ROOT, *parts)


def ratio_name(ratio: float) -> str:
    return f"prune-{ratio:g}"


def _require(run: RunFolder, stage: str, command: str) -> None:
    if not run.is_complete(stage):
        raise ConfigError(f"stage '{stage}' of run {run.uri} is not complete; run `{command}` first")


def _arrow(df: pd.DataFrame) -> pa.Table:
    return pa.Table.from_pandas(df, preserve_index=False).replace_schema_metadata(None)


def _value(ref_or_value):
    """Ray Data hands `fn_args` to the function as given: an ObjectRef (one shared copy of a large id array in
    the object store, instead of one per task) has to be fetched by the function itself."""
    import ray

    return ray.get(ref_or_value) if isinstance(ref_or_value, ray.ObjectRef) else ref_or_value


def _select_rows(loc: Location, id_column: str, ids: np.ndarray, columns: list[str]) -> pd.DataFrame:
    """Rows of a (large) Parquet folder whose id is in `ids`, by a distributed scan: only matches reach here."""
    import ray
    import ray.data

    from wbrag_ray.ray_runtime import LIGHT_CPUS

    wanted = ray.put(np.unique(np.asarray(ids, np.int64)))

    def keep(batch: pa.Table, wanted) -> pa.Table:
        mask = np.isin(batch[id_column].to_numpy(), _value(wanted))
        return batch.filter(pa.array(mask))

    ds = ray.data.read_parquet(loc.path, filesystem=loc.fs, columns=columns, num_cpus=LIGHT_CPUS)
    ds = ds.map_batches(keep, fn_args=(wanted,), batch_format="pyarrow", num_cpus=LIGHT_CPUS)
    refs = ds.to_arrow_refs()
    tables = [t for t in ray.get(refs) if t.num_rows]
    return pa.concat_tables(tables).to_pandas() if tables else pd.DataFrame(columns=columns)


# --- 1. mastery scores ------------------------------------------------------------------------------------


def _splitmix64(x: np.ndarray, seed: int) -> np.ndarray:
    """A well-mixed 64-bit hash of each id: the same sample on any number of nodes, in any order."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def sample_sentences(run: RunFolder, config: WbragConfig, n: int) -> pd.DataFrame:
    """The `n` sentences with the smallest seeded hash of their sid: a uniform sample, chosen by a distributed
    filter (a hash below a cut taken with margin), then an exact cut on the few candidates."""
    import ray
    import ray.data

    from wbrag_ray.ray_runtime import LIGHT_CPUS

    total = run.stats("ingest")["sentences"]
    seed = config.zerorag.seed
    src = run.path("ingest", "sentences")
    frac = _sample_fraction(n, total)
    while True:
        cut = np.uint64(min(2**64 - 1, int(frac * (2**64 - 1))))

        def below(batch: pa.Table, cut=cut) -> pa.Table:
            keys = _splitmix64(batch["sid"].to_numpy(), seed)
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
    titles = _select_rows(run.path("ingest", "passages"), "pid", found["pid"].to_numpy(), ["pid", "title"])
    found["title"] = found["pid"].map(titles.set_index("pid")["title"]).fillna("")
    return found.sort_values("sid").reset_index(drop=True)


def _sample_fraction(n: int, total: int) -> float:
    """Hash cut with a margin of five standard deviations, so one pass almost always finds n candidates."""
    p = n / max(total, 1)
    return min(1.0, p + 5 * np.sqrt(p * (1 - p) / max(total, 1)) + 16 / max(total, 1))


def mastery_settings(config: WbragConfig, sample: int) -> dict[str, Any]:
    z = config.zerorag
    qa_gen = z.qa_generator or config.generator
    return {"sample": sample, "seed": z.seed, "qa_mode": z.qa_mode, "qa_per_sentence": z.qa_per_sentence,
            "qa_generator": qa_gen.model if z.qa_mode == "llm" else None, "target": config.generator.model,
            "target_adapter": config.generator.lora_adapter, "answer_max_new_tokens": z.answer_max_new_tokens,
            "metric": z.mastery_metric}


def mastery(run: RunFolder, config: WbragConfig, sample: int | None = None, force: bool = False) -> dict[str, Any]:
    """Score a sample of sentences: QA pairs -> the target model's closed-book answers -> mean EM."""
    from wbrag_ray import prompts
    from wbrag_ray.stages import mastery as m

    _require_sentences(run, config)
    z = config.zerorag
    n = sample or z.sample
    settings = mastery_settings(config, n)
    run.check_settings("mastery", settings, force, fix=_REDO)
    out = _root(run, "mastery")

    def work() -> dict[str, Any]:
        t0 = time.perf_counter()
        total = run.stats("ingest")["sentences"]
        sentences = sample_sentences(run, config, n)
        with GeneratorPasses(config.generator) as passes:
            rows: list[dict] = []
            if z.qa_mode == "cloze":
                for s in sentences.itertuples(index=False):
                    rows += [{"sid": s.sid, **r} for r in m.cloze_pairs(s.title, s.text, z.qa_per_sentence)]
            else:
                qa_gen = z.qa_generator or config.generator
                write = sentences[["sid", "title", "text"]].copy()
                write["qa_prompt"] = [
                    prompts.dumps(prompts.qa_write_messages(f"{t}: {x}" if t else x, z.qa_per_sentence, qa_gen.chat_template))
                    for t, x in zip(write["title"], write["text"], strict=True)
                ]
                written = passes.generate("qa_write", from_pandas(write), "qa_prompt", "qa_raw", z.qa_max_new_tokens, qa_gen,
                                          multiline=True)
                prefix = "" if qa_gen.chat_template else prompts.QA_FEWSHOT_PREFIX
                for s in written.sort_values("sid").itertuples(index=False):
                    rows += [{"sid": s.sid, **r} for r in m.llm_pairs(s.text, s.qa_raw, z.qa_per_sentence, prefix)]
            qa = pd.DataFrame(rows, columns=["sid", "qa_index", "question", "answer", "status", "raw"])
            qa["qa_index"] = qa["qa_index"].astype("int32")
            ok = qa[qa["status"] == m.OK].copy()
            ok["answer_prompt"] = [prompts.dumps(prompts.closed_book_messages(q, z.qa_mode == "cloze")) for q in ok["question"]]
            predictions = pd.Series(dtype="object")
            if len(ok):
                answered = passes.generate("closed_book", from_pandas(ok[["sid", "qa_index", "answer_prompt"]]),
                                           "answer_prompt", "prediction", z.answer_max_new_tokens)
                predictions = answered.set_index(["sid", "qa_index"])["prediction"]
        qa["prediction"] = [predictions.get((s, i)) for s, i in zip(qa["sid"], qa["qa_index"], strict=True)]
        qa = m.score_answers(qa)
        scores = m.mastery_scores(sentences, qa, z.mastery_metric)
        out.delete()
        out.join("qa.parquet").write_table(_arrow(qa))
        out.join("scores.parquet").write_table(_arrow(scores))
        counts = qa["status"].value_counts()
        scored = scores["mastery"].notna()
        stats = {
            "mode": z.qa_mode, "metric": z.mastery_metric, "sample": n, "sentences": len(sentences), "qa_pairs": len(qa),
            "valid": int(counts.get(m.OK, 0)), "unparseable": int(counts.get(m.UNPARSEABLE, 0)),
            "answer_not_in_sentence": int(counts.get(m.NOT_IN_SENTENCE, 0)),
            "scored_sentences": int(scored.sum()),
            "mean_mastery": round(float(scores.loc[scored, "mastery"].mean()), 4) if scored.any() else None,
            "generator_calls": passes.calls, "passes": passes.stats,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        stats["calls_per_s"] = round(stats["generator_calls"] / stats["seconds"], 2) if stats["seconds"] else 0.0
        stats["generator_calls_per_sentence"] = round(passes.calls / max(1, len(sentences)), 2)
        out.join("stats.json").write_json(stats)
        return {"rows_in": total, "rows_out": int(scored.sum()), "rows_rejected": int((~scored).sum()),
                **stats, "settings": settings}

    return run.run_stage("mastery", work, force=force)


def _require_sentences(run: RunFolder, config: WbragConfig) -> None:
    if config.index.unit != "sentence":
        raise ConfigError("Zero-RAG prunes sentences: set index.unit=sentence (the index holds sentences and the "
                          "embedding pruner reads their stored vectors); e.g. jobs/configs/zero_rag_demo.yaml")
    _require(run, "index", "wbrag index RUN")


# --- 2. pruners -------------------------------------------------------------------------------------------


def _scored_split(run: RunFolder, config: WbragConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The scored sample split into (train, validation) by a seeded permutation; unscored sentences left out."""
    scores = _root(run, "mastery", "scores.parquet").read_table().to_pandas()
    scores = scores[scores["mastery"].notna()].sort_values("sid").reset_index(drop=True)
    n_val = int(round(len(scores) * config.zerorag.val_fraction))
    if len(scores) - n_val < 4 or n_val < 2:
        raise ConfigError(f"only {len(scores)} sentences of {run.uri} have a mastery score: too few to train and "
                          "validate a pruner; score more with `wbrag mastery RUN --sample N` (zerorag.sample)")
    order = np.random.default_rng(config.zerorag.seed).permutation(len(scores))
    return scores.iloc[order[n_val:]].reset_index(drop=True), scores.iloc[order[:n_val]].reset_index(drop=True)


def pruner_settings(run: RunFolder, config: WbragConfig, kind: str) -> dict[str, Any]:
    """What a pruner is made from: its own settings and the settings the mastery scores were made with."""
    z = config.zerorag
    common = {"kind": kind, "seed": z.seed, "val_fraction": z.val_fraction,
              "mastery": run.stats("mastery")["settings"]}
    if kind == "embedding":
        return {**common, "hidden": z.head_hidden, "epochs": z.head_epochs, "weight_decay": z.head_weight_decay,
                "embedder": config.embedder.model}
    return {**common, **z.lm_pruner.model_dump(mode="json", exclude={"num_cpus", "num_gpus", "concurrency",
                                                                       "threads", "predict_batch_size"})}


def train_pruner(run: RunFolder, config: WbragConfig, kind: str | None = None, force: bool = False) -> dict[str, Any]:
    """Train one pruner (`kind`, default: zerorag.train_pruners and zerorag.pruner) on the scored sample; validate it on the
    held-out part (MSE, Spearman, top-quantile precision / recall at the first pruning ratio)."""
    _require(run, "mastery", "wbrag mastery RUN")
    kinds = [kind] if kind else list(dict.fromkeys([*config.zerorag.train_pruners, config.zerorag.pruner]))
    results = {}
    for k in kinds:
        stage = f"pruner-{k}"
        settings = pruner_settings(run, config, k)
        run.check_settings(stage, settings, force, fix=_REDO)
        results[k] = run.run_stage(stage, lambda k=k, settings=settings: _train_one(run, config, k, settings),
                                   force=force)
        m = results[k]
        tq = m["top_quantile"]
        print(f"pruner {k}: mse {m['mse']} (predicting the mean: {m['mse_predict_mean']}), spearman {m['spearman']}, "
              f"top {tq['q']:.0%} precision {tq['precision']} recall {tq['recall']}", flush=True)
    return results


def _train_one(run: RunFolder, config: WbragConfig, kind: str, settings: dict[str, Any]) -> dict[str, Any]:
    from wbrag_ray.models.pruner import EmbeddingHead, pruner_metrics

    z = config.zerorag
    train, val = _scored_split(run, config)
    out = _root(run, "pruner", kind)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "embedding":
            both = pd.concat([train, val], ignore_index=True)
            vec = _select_rows(run.path("embed"), "sid", both["sid"].to_numpy(), ["sid", "vector"])
            vectors = dict(zip(vec["sid"], vec["vector"], strict=True))
            missing = [s for s in both["sid"] if s not in vectors]
            if missing:
                raise ConfigError(f"{len(missing)} scored sentences have no stored vector in {run.path('embed').uri} "
                                  f"(e.g. sid {missing[0]}): re-embed with `wbrag embed RUN --force`")

            def stack(df: pd.DataFrame) -> np.ndarray:
                return np.stack([np.asarray(vectors[s], np.float32) for s in df["sid"]])

            head, losses = EmbeddingHead.train(stack(train), train["mastery"].to_numpy(), z.head_hidden,
                                               z.head_epochs, z.head_weight_decay, seed=z.seed)
            predicted = head.predict(stack(val))
            head.save(tmp, {"settings": settings, "dim": head.dim})
            fit = {"first_loss": round(losses[0], 5), "last_loss": round(losses[-1], 5)}
        else:
            from wbrag_ray.training.lm_pruner import LMPrunerPredictor, train_lm_pruner

            fit = train_lm_pruner(_pruner_text(train), train["mastery"].tolist(), z.lm_pruner, tmp)
            predictor = LMPrunerPredictor(tmp, batch_size=z.lm_pruner.predict_batch_size)
            predictor.setup()
            predicted = predictor.predict(_pruner_text(val))
            fit = {k: v for k, v in fit.items() if k != "losses"}
        out.upload_dir(tmp)
    q = z.ratios[0] if z.ratios and z.ratios[0] > 0 else 0.3
    metrics = {"kind": kind, "n_train": len(train), "n_val": len(val),
               **pruner_metrics(val["mastery"].to_numpy(), predicted, q), "fit": fit,
               "seconds": round(time.perf_counter() - t0, 2)}
    out.join("metrics.json").write_json(metrics)
    out.join("validation.parquet").write_table(_arrow(pd.DataFrame(
        {"sid": val["sid"].astype("int64"), "measured": val["mastery"].astype("float64"),
         "predicted": np.asarray(predicted, np.float64)})))
    return {"rows_in": len(train) + len(val), "rows_out": len(val), **metrics, "settings": settings}


def _pruner_text(df: pd.DataFrame) -> list[str]:
    """What the LM regressor reads: the sentence with its article's title (what the QA pairs were about)."""
    return [f"{t}: {x}" if t else x for t, x in zip(df["title"], df["text"], strict=True)]


# --- 3. prediction, the corpus-wide percentile, the keep mask, the pruned corpus and index -----------------


def predict(run: RunFolder, config: WbragConfig, force: bool = False) -> dict[str, Any]:
    """Every sentence's predicted mastery with zerorag.pruner, as one Ray Data pipeline; files under
    RUN/zero_rag/predictions named by write task, so a retried task overwrites its own file."""
    from wbrag_ray.pipelines.build_kb import StableNames
    from wbrag_ray.ray_runtime import LIGHT_CPUS
    from wbrag_ray.stages.base import apply_stage
    from wbrag_ray.stages.pruner import EmbeddingPredictStage, LMPredictStage

    kind = config.zerorag.pruner
    _require(run, f"pruner-{kind}", f"wbrag train-pruner RUN --kind {kind}")
    settings = {"pruner": kind, "trained": run.stats(f"pruner-{kind}")["settings"]}
    run.check_settings("predict", settings, force, fix=_REDO)
    out = _root(run, "predictions")

    def work() -> dict[str, Any]:
        import ray.data

        from wbrag_ray.models.pruner import EmbeddingHead

        out.delete()
        if kind == "embedding":
            src = run.path("embed")
            weights = EmbeddingHead.load(_root(run, "pruner", kind).local_dir()).weights
            stage = EmbeddingPredictStage(weights)
            # the read runs fused with the prediction task, so it asks for what that task asks for
            ds = ray.data.read_parquet(src.path, filesystem=src.fs, columns=["sid", "vector"],
                                       num_cpus=stage.resources.num_cpus)
            ds = apply_stage(ds, stage)
        else:
            src = run.path("ingest", "sentences")
            ds = ray.data.read_parquet(src.path, filesystem=src.fs, columns=["sid", "text"],
                                       num_cpus=LIGHT_CPUS)
            ds = apply_stage(ds, LMPredictStage(_root(run, "pruner", kind).uri, config.zerorag.lm_pruner))
        ds.write_parquet(out.path, filesystem=out.fs, filename_provider=StableNames("pred"),
                         ray_remote_args={"num_cpus": LIGHT_CPUS})
        n = out.num_rows()
        total = run.stats("ingest")["sentences"]
        if n != total:
            raise RuntimeError(f"mastery prediction wrote {n} scores for {total} sentences")
        return {"rows_in": total, "rows_out": n, "rows_rejected": 0, "pruner": kind, "settings": settings}

    return run.run_stage("predict", work, force=force)


def _bins(scores: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Two-level bin indices of scores in [0, 1]: level 1 splits [0, 1] into `bins`, level 2 splits each of
    those into `bins` again. Integer indices, so the histogram and the keep mask agree exactly."""
    x = np.clip(np.asarray(scores, np.float64), 0.0, 1.0) * bins
    b1 = np.minimum(x.astype(np.int64), bins - 1)
    b2 = np.minimum(((x - b1) * bins).astype(np.int64), bins - 1)
    return b1, b2


def _tie_draw(ids: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) per id, fixed by the id: which of the sentences tied at the cut are dropped."""
    return (_splitmix64(ids, 0x5EED) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def percentile_cut(pred: Location, ratio: float, bins: int) -> dict[str, Any]:
    """Where to cut so that `ratio` of all sentences (those with the highest predicted mastery) are dropped.

    Each prediction file is histogrammed in its own Ray task and only the counts come back: first over
    `bins` bins of [0, 1], then inside the one bin where the cut falls. The cut is exact to 1 / bins^2;
    sentences tied inside the last sub-bin are dropped by a draw fixed by their id, for the fraction that
    is still missing, so the dropped count matches the ratio to within a few sentences."""
    import ray

    from wbrag_ray.ray_runtime import LIGHT_CPUS

    files = [f.uri for f in pred.list_files(".parquet")]

    @ray.remote(num_cpus=LIGHT_CPUS)
    def histogram(uri: str, level1_bin: int | None) -> np.ndarray:
        from wbrag_ray.storage import resolve

        scores = resolve(uri).read_table(["mastery_pred"])["mastery_pred"].to_numpy()
        b1, b2 = _bins(scores, bins)
        if level1_bin is None:
            return np.bincount(b1, minlength=bins)
        return np.bincount(b2[b1 == level1_bin], minlength=bins)

    level1 = np.sum(ray.get([histogram.remote(f, None) for f in files]), axis=0)
    total = int(level1.sum())
    target = int(round(ratio * total))
    if target == 0:
        return {"total": total, "target_dropped": 0, "b1": bins, "b2": 0, "tie_fraction": 0.0, "threshold": 1.0}
    b1, need = _cut_bin(level1, target)
    level2 = np.sum(ray.get([histogram.remote(f, b1) for f in files]), axis=0)
    b2, need2 = _cut_bin(level2, need)
    return {"total": total, "target_dropped": target, "b1": b1, "b2": b2,
            "tie_fraction": need2 / int(level2[b2]), "threshold": (b1 + b2 / bins) / bins}


def _cut_bin(counts: np.ndarray, drop: int) -> tuple[int, int]:
    """(the bin where dropping the top `drop` items ends, how many of that bin's items are still to drop)."""
    above = np.cumsum(counts[::-1])[::-1]  # above[i] = items in bins >= i
    b = int(np.flatnonzero(above >= drop)[-1])
    return b, drop - (int(above[b + 1]) if b + 1 < len(counts) else 0)


def keep_mask(ids: np.ndarray, scores: np.ndarray, cut: dict[str, Any], bins: int) -> np.ndarray:
    """True for sentences kept at `cut`: everything below the cut's sub-bin, and the undrawn ties in it."""
    b1, b2 = _bins(scores, bins)
    drop = (b1 > cut["b1"]) | ((b1 == cut["b1"]) & (b2 > cut["b2"]))
    tied = (b1 == cut["b1"]) & (b2 == cut["b2"])
    drop |= tied & (_tie_draw(ids) < cut["tie_fraction"])
    return ~drop


def _index_bytes(loc: Location) -> int:
    return sum(f.size() for f in loc.list_files() if not f.name.endswith(".json"))


def prune(run: RunFolder, config: WbragConfig, ratio: float, force: bool = False) -> dict[str, Any]:
    """Drop the `ratio` most-mastered sentences: keep mask, pruned sentence corpus and pruned index."""
    from wbrag_ray.index.prune import prune_index
    from wbrag_ray.ray_runtime import LIGHT_CPUS

    if not 0 < ratio < 1:
        raise ConfigError(f"--ratio {ratio}: a pruning ratio is a fraction in (0, 1), e.g. 0.3")
    _require(run, "predict", "wbrag prune RUN --ratio R (after wbrag train-pruner RUN)")
    stage = ratio_name(ratio)
    bins = config.zerorag.histogram_bins
    settings = {"ratio": ratio, "bins": bins, "predict": run.stats("predict")["settings"]}
    run.check_settings(stage, settings, force, fix=_REDO)
    root = _root(run, stage)

    def work() -> dict[str, Any]:
        import ray
        import ray.data

        t0 = time.perf_counter()
        root.delete()
        pred = _root(run, "predictions")
        cut = percentile_cut(pred, ratio, bins)

        def mask(batch: pa.Table) -> pa.Table:
            ids, scores = batch["sid"].to_numpy(), batch["mastery_pred"].to_numpy()
            return pa.table({"id": ids, "mastery_pred": batch["mastery_pred"],
                             "keep": pa.array(keep_mask(ids, scores, cut, bins))})

        keep_loc = root.join("keep")
        ds = ray.data.read_parquet(pred.path, filesystem=pred.fs, num_cpus=LIGHT_CPUS)
        ds.map_batches(mask, batch_format="pyarrow", num_cpus=LIGHT_CPUS).write_parquet(
            keep_loc.path, filesystem=keep_loc.fs, ray_remote_args={"num_cpus": LIGHT_CPUS})
        table = keep_loc.read_table(["id", "keep"])
        keep = table["keep"].to_numpy(zero_copy_only=False)
        dropped_ids = np.sort(table["id"].to_numpy()[~keep])
        seconds_cut = time.perf_counter() - t0

        # The pruned sentence corpus: every sentence not dropped, its columns untouched.
        sentences, out = run.path("ingest", "sentences"), root.join("sentences")
        drop_ref = ray.put(dropped_ids)

        def kept_only(batch: pa.Table, drop) -> pa.Table:
            return batch.filter(pa.array(~np.isin(batch["sid"].to_numpy(), _value(drop))))

        ray.data.read_parquet(sentences.path, filesystem=sentences.fs, num_cpus=LIGHT_CPUS) \
            .map_batches(kept_only, fn_args=(drop_ref,), batch_format="pyarrow", num_cpus=LIGHT_CPUS) \
            .write_parquet(out.path, filesystem=out.fs, ray_remote_args={"num_cpus": LIGHT_CPUS})
        kept = out.num_rows()
        if kept + len(dropped_ids) != cut["total"]:
            raise RuntimeError(f"pruned corpus holds {kept} sentences + {len(dropped_ids)} dropped != {cut['total']}")

        index_stats = prune_index(run.path("index"), root.join("index"), dropped_ids, num_cpus=config.index.num_cpus)
        stats = {
            "ratio": ratio, "achieved_ratio": round(len(dropped_ids) / cut["total"], 6),
            "threshold": round(cut["threshold"], 8), "sentences_in": cut["total"], "kept": kept,
            "dropped": int(len(dropped_ids)), "index_vectors": index_stats.get("rows_out"),
            "index_bytes": _index_bytes(root.join("index")), "source_index_bytes": _index_bytes(run.path("index")),
            "pruner": config.zerorag.pruner, "seconds_percentile_and_mask": round(seconds_cut, 2),
        }
        root.join("stats.json").write_json(stats)
        return {"rows_in": cut["total"], "rows_out": kept, "rows_rejected": 0, **stats, "settings": settings}

    stats = run.run_stage(stage, work, force=force)
    print(f"pruned {stats['dropped']} of {stats['sentences_in']} sentences (ratio {stats['achieved_ratio']:.4f}, "
          f"asked {ratio}; mastery >= {stats['threshold']:.4f}); index {stats['source_index_bytes'] / 1e6:.2f} MB -> "
          f"{stats['index_bytes'] / 1e6:.2f} MB", flush=True)
    return stats


def index_for_ratio(run: RunFolder, ratio: float) -> Location:
    """The index a pruning ratio is evaluated on: the full index at 0, else the pruned one."""
    if ratio == 0:
        return run.path("index")
    if not run.is_complete(ratio_name(ratio)):
        raise ConfigError(f"no index pruned at ratio {ratio} in {run.uri}; run `wbrag prune RUN --ratio {ratio}`")
    return _root(run, ratio_name(ratio), "index")


# --- 4. noise-tolerant tuning and 5. the query router ---------------------------------------------------


def _train_questions(config: WbragConfig, train: str | None) -> tuple[str, pd.DataFrame, int]:
    from wbrag_ray.formats import read_dataset
    from wbrag_ray.storage import resolve

    train = train or config.zerorag.train
    if not train:
        raise ConfigError("no training questions: pass --train PATH or set zerorag.train (FlashRAG jsonl / Parquet)")
    questions, rejects = read_dataset(resolve(train), limit=config.zerorag.train_limit)
    if questions.num_rows == 0:
        raise ConfigError(f"zerorag.train {train} has no usable questions ({rejects.num_rows} rejected)")
    df = questions.to_pandas()
    df["golden_answers"] = df["golden_answers"].map(list)  # numpy object arrays would travel through Ray pickled
    return train, df, rejects.num_rows


def adapter_location(run: RunFolder) -> Location:
    return _root(run, "adapter")


def with_adapter(run: RunFolder, config: WbragConfig):
    """The generator config with the run's tuned adapter applied (loaded from a local copy of it)."""
    _require(run, "tune", "wbrag tune RUN --train PATH")
    return config.generator.model_copy(update={"lora_adapter": adapter_location(run).local_dir()})


def tune(run: RunFolder, config: WbragConfig, train: str | None = None, force: bool = False) -> dict[str, Any]:
    """Noise-tolerant LoRA tuning of the generator on each training question with relevant documents, with
    distracting documents and with none; the adapter goes to RUN/zero_rag/adapter."""
    from wbrag_ray.index.retriever import RetrieveStage
    from wbrag_ray.stages.base import apply_stage
    from wbrag_ray.training.noise_tolerant import build_examples, tune_generator

    _require(run, "index", "wbrag index RUN")
    train, questions, rejected = _train_questions(config, train)
    settings = {"train": train, "limit": config.zerorag.train_limit, "generator": config.generator.model,
                "top_k": config.retrieval.top_k,
                **config.zerorag.tune.model_dump(mode="json", exclude={"enabled", "threads"})}
    run.check_settings("tune", settings, force, fix=_REDO)
    out = adapter_location(run)

    def work() -> dict[str, Any]:
        retrieved = apply_stage(
            from_pandas(questions),
            RetrieveStage(run.path("index").uri, run.path("ingest").uri, config.embedder, config.retrieval,
                          config.index.nprobe),
        ).to_pandas()
        examples = build_examples(retrieved, config.zerorag.tune.docs_per_format, config.zerorag.tune.seed)
        with tempfile.TemporaryDirectory() as tmp:
            stats = tune_generator(examples, config.generator, config.zerorag.tune, tmp)
            out.upload_dir(tmp)
        fit = {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items() if k != "losses"}
        return {"rows_in": len(questions) + rejected, "rows_out": len(examples), "rows_rejected": rejected,
                **fit, "settings": settings}

    stats = run.run_stage("tune", work, force=force)
    print(f"noise-tolerant adapter: {out.uri} (loss {stats.get('first_loss')} -> {stats.get('last_loss')})", flush=True)
    return stats


def router_location(run: RunFolder) -> Location:
    return _root(run, "router")


def train_router(run: RunFolder, config: WbragConfig, train: str | None = None, force: bool = False) -> dict[str, Any]:
    """Label each training question by whether the generator (with the tuned adapter when there is one)
    answers it correctly without retrieval, and train the router on the query embeddings."""
    from wbrag_ray import prompts
    from wbrag_ray.metrics import metric
    from wbrag_ray.models.embedder import Embedder
    from wbrag_ray.models.router import QueryRouter

    train, questions, rejected = _train_questions(config, train)
    adapter = run.is_complete("tune")
    z = config.zerorag
    settings = {"train": train, "limit": z.train_limit, "generator": config.generator.model, "adapter": adapter,
                "threshold": z.router_threshold, "seed": z.seed, "val_fraction": z.val_fraction,
                "embedder": config.embedder.model, "metric": z.router_metric}
    run.check_settings("router", settings, force, fix=_REDO)
    out = router_location(run)

    def work() -> dict[str, Any]:
        from sklearn.metrics import roc_auc_score

        df = questions[["id", "question", "golden_answers"]].copy()
        df["prompt"] = [prompts.dumps(prompts.no_retrieval_messages(q)) for q in df["question"]]
        with GeneratorPasses(with_adapter(run, config) if adapter else config.generator) as passes:
            answered = passes.generate("closed_book", from_pandas(df), "prompt", "prediction").sort_values("id")
        answered = answered.reset_index(drop=True)
        labels = np.array([metric(z.router_metric, p, list(g)) > 0
                           for p, g in zip(answered["prediction"], answered["golden_answers"], strict=True)])
        embedder = Embedder(config.embedder)
        vectors = embedder.encode_queries(answered["question"].tolist())
        order = np.random.default_rng(z.seed).permutation(len(answered))
        n_val = max(1, int(round(len(order) * z.val_fraction))) if len(order) > 4 else 0
        val, fit = order[:n_val], order[n_val:]
        router = QueryRouter.train(vectors[fit], labels[fit], z.router_threshold, seed=z.seed)
        p_val = router.probability(vectors[val])
        metrics = {
            "n_train": int(len(fit)), "n_val": int(len(val)), "positives": int(labels.sum()),
            "positive_rate": round(float(labels.mean()), 4), "threshold": z.router_threshold,
            "val_accuracy": round(float(((p_val >= z.router_threshold) == labels[val]).mean()), 4) if len(val) else None,
            "val_auc": round(float(roc_auc_score(labels[val], p_val)), 4)
            if len(val) and 0 < labels[val].sum() < len(val) else None,
            "val_skip_rate": round(float((p_val >= z.router_threshold).mean()), 4) if len(val) else None,
            "adapter": adapter, "generator_calls": passes.calls,
        }
        with tempfile.TemporaryDirectory() as tmp:
            router.save(tmp, {"settings": settings, **metrics})
            out.upload_dir(tmp)
        out.join("metrics.json").write_json(metrics)
        answered = answered.assign(label=labels, p_mastered=router.probability(vectors))
        out.join("labels.parquet").write_table(_arrow(answered[["id", "question", "prediction", "label", "p_mastered"]]))
        return {"rows_in": len(questions) + rejected, "rows_out": len(answered), "rows_rejected": rejected,
                **metrics, "settings": settings}

    stats = run.run_stage("router", work, force=force)
    print(f"query router: {stats['positives']} of {stats['rows_out']} training questions answered closed-book; "
          f"held-out accuracy {stats['val_accuracy']}, AUC {stats['val_auc']}", flush=True)
    return stats


# --- 6. the evaluation grid -------------------------------------------------------------------------------


def retrieval_latency(index: Location, vectors: np.ndarray, k: int, config: WbragConfig, min_seconds: float = 0.5
                      ) -> float:
    """Milliseconds per query of searching `index` with a batch of query vectors: the best of repeated runs
    (the machine is shared; the minimum is the least disturbed), after one warm-up search."""
    from wbrag_ray.index.retriever import Retriever

    retriever = Retriever(index.uri, None, None, config.index.nprobe, ef_search=config.index.ef_search,
                          k_factor=config.index.k_factor, gpu=config.index.gpu)
    retriever.search_ids(vectors, k)
    best, spent = float("inf"), 0.0
    while spent < min_seconds or best == float("inf"):
        t0 = time.perf_counter()
        retriever.search_ids(vectors, k)
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return 1000 * best / max(1, len(vectors))


def evaluate_grid(run: RunFolder, config: WbragConfig, dataset: str, force: bool = False) -> list[dict[str, Any]]:
    """Evaluate every pruning ratio of zerorag.ratios (and 0, the full index), without and with the router
    (zerorag.router), the tuned adapter (zerorag.tune.enabled) and the active write-back index (a pruned base
    plus write-back: the two methods combined); write RUN/zero_rag/grid.json."""
    from wbrag_ray.formats import read_dataset
    from wbrag_ray.index.faiss_index import load_manifest
    from wbrag_ray.models.embedder import Embedder
    from wbrag_ray.pipelines.evaluate import evaluate_stage
    from wbrag_ray.pipelines.writeback import read_active
    from wbrag_ray.storage import resolve

    z = config.zerorag
    name = config.eval.name or Path(dataset.rstrip("/")).name.split(".")[0]
    ratios = sorted({0.0, *z.ratios})
    routers = [False, True] if z.router else [False]
    adapters = [False, True] if z.tune.enabled else [False]
    writebacks = [False, True] if read_active(run)["version"] else [False]
    questions, _ = read_dataset(resolve(dataset), limit=config.eval.limit)
    vectors = Embedder(config.embedder).encode_queries(questions["question"].to_pylist())
    rows: list[dict[str, Any]] = []
    latency: dict[float, float] = {}
    for adapter in adapters:
        cfg = config.model_copy(update={"generator": with_adapter(run, config)}) if adapter else config
        # one generator (with or without the adapter) for every cell; the retrieval service follows the cell
        with GeneratorPasses(cfg.generator) as passes:
            for ratio in ratios:
                index = index_for_ratio(run, ratio)
                manifest = load_manifest(index)
                if ratio not in latency:
                    latency[ratio] = retrieval_latency(index, vectors, config.retrieval.top_k, config)
                for router, writeback in [(r, w) for r in routers for w in writebacks]:
                    first = ratio == ratios[0] and not router and not writeback
                    methods = [m for m in cfg.eval.methods if first or m != "no-retrieval"]  # no index: once is enough
                    if not methods:
                        continue
                    label = eval_label(name, ratio, writeback, router, adapter)
                    cfg_m = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"methods": methods})})
                    stats = evaluate_stage(run, cfg_m, dataset, name, label, force=force, passes=passes,
                                           base_index=index.uri, router=router_location(run).uri if router else None,
                                           setting=label, writeback=writeback)
                    for method, m in stats["methods"].items():
                        rows.append({
                            "ratio": ratio, "router": router, "adapter": adapter, "writeback": writeback,
                            "method": method, "n": m["n"],
                            "em": m["em"], "f1": m["f1"], "acc": m["acc"],
                            "latency_ms_per_query": round(latency[ratio], 4) if method != "no-retrieval" else 0.0,
                            "index_bytes": _index_bytes(index), "sentences": int(manifest["count"]),
                            "retrieval_skipped": m.get("retrieval_skipped", 0.0) if method != "no-retrieval" else 1.0,
                        })
    _root(run, "grid.json").write_json({"dataset": dataset, "rows": rows})
    print(format_grid(rows), flush=True)
    return rows


def eval_label(name: str, ratio: float | None = None, writeback: bool = False, router: bool = False,
               adapter: bool = False) -> str:
    """The folder prefix (and setting) of one evaluation: the dataset name, then each setting that differs from
    the base, in one order for `wbrag eval` and the grid."""
    return (name + (f"-prune{ratio:g}" if ratio is not None else "") + ("-writeback" if writeback else "")
            + ("-router" if router else "") + ("-adapter" if adapter else ""))


def format_grid(rows: list[dict[str, Any]]) -> str:
    head = f"{'ratio':>6} {'wb':>4} {'router':>7} {'adapter':>8} {'method':<13}{'acc':>7}{'em':>7}{'ms/query':>10}{'index MB':>10}" \
           f"{'sentences':>11}{'skipped':>9}"
    lines = ["Zero-RAG evaluation grid", head]
    for r in rows:
        lines.append(f"{r['ratio']:>6g} {('yes' if r.get('writeback') else 'no'):>4} {('yes' if r['router'] else 'no'):>7} {('yes' if r['adapter'] else 'no'):>8} "
                     f"{r['method']:<13}{r['acc']:>7.3f}{r['em']:>7.3f}{r['latency_ms_per_query']:>10.4f}"
                     f"{r['index_bytes'] / 1e6:>10.3f}{r['sentences']:>11}{r['retrieval_skipped']:>9.2f}")
    return "\n".join(lines)


def run_zero_rag(run: RunFolder, config: WbragConfig, force: bool = False) -> None:
    """The whole chain after the index: mastery -> pruners -> prediction -> every ratio -> [tune] -> [router]
    -> the evaluation grid (when eval.dataset is set)."""
    mastery(run, config, force=force)
    train_pruner(run, config, force=force)
    predict(run, config, force=force)
    for ratio in config.zerorag.ratios:
        if ratio > 0:
            prune(run, config, ratio, force=force)
    if config.zerorag.tune.enabled:
        tune(run, config, force=force)
    if config.zerorag.router:
        train_router(run, config, force=force)
    if config.eval.dataset:
        evaluate_grid(run, config, config.eval.dataset, force=force)
