"""Zero-RAG step 3: every sentence's predicted mastery, then per ratio the corpus-wide percentile (two-level
histograms: only counts travel), the keep mask (ties in the last sub-bin dropped by a draw fixed by id), the pruned
sentence corpus and the pruned index built from the stored vectors (RUN/zero_rag/predictions/, prune-<R>/)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import pyarrow as pa

from wbrag_ray.build_kb import INDEX, INGEST
from wbrag_ray.checkpoints import resumable_write
from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.index.prune import drop_ids_ref, prune_index
from wbrag_ray.layout import PRUNE_LEVEL, PrunedLevel
from wbrag_ray.models.pruner import EmbeddingHead
from wbrag_ray.ray_runtime import LIGHT_CPUS, in_sorted, read_parquet, shared_value
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.stages.base import Resources, apply_stage
from wbrag_ray.stages.pruner import EmbeddingPredictStage, LMPredictStage
from wbrag_ray.storage import Location, resolve
from wbrag_ray.work import AddVectors, Predict, Sizes
from wbrag_ray.zerorag.mastery import splitmix64
from wbrag_ray.zerorag.pruners import PRUNERS, lm_row_tokens, pruner_inputs


def predict_stage(config: WbragConfig) -> RunStage:
    """The prediction stage of zerorag.pruner: it reads that trained pruner too."""
    return dataclasses.replace(PREDICT, requires=(*PREDICT.requires, PRUNERS[config.zerorag.pruner]))


def predict(run: RunFolder, config: WbragConfig, force: bool = False) -> dict[str, Any]:
    """Every sentence's predicted mastery, as one resumable Ray Data pipeline (`checkpoints.resumable_write`)."""
    return run.execute(predict_stage(config), config, lambda: _predict(run, config, config.zerorag.pruner), force=force)


def _predict(run: RunFolder, config: WbragConfig, kind: str) -> dict[str, Any]:
    import ray.data

    model = run.layout.zero_rag.pruner(kind)
    total = run.stats(INGEST.name)["sentences"]
    head = EmbeddingHead.load(model.local_dir()).weights if kind == "embedding" else None

    def stage_at(placed: Resources | None = None):
        """The prediction stage, placed as configured or as a resume narrowed it (placement only)."""
        if kind == "embedding":
            return EmbeddingPredictStage(head, **({"num_cpus": placed.num_cpus} if placed else {}))
        lm = config.zerorag.lm_pruner
        if placed is not None:
            lm = lm.model_copy(update={"num_cpus": placed.num_cpus, "concurrency": placed.concurrency})
        return LMPredictStage(model.uri, lm)

    def predicted(placed: Resources) -> ray.data.Dataset:
        stage = stage_at(placed)
        if kind != "embedding":  # the text the regressor was trained on, titles included
            return apply_stage(pruner_inputs(run), stage)
        src = run.layout.embed
        # the read runs fused with the prediction task, so it asks for what that task asks for
        return apply_stage(read_parquet(src, stage.resources.num_cpus, columns=["sid", "vector"]), stage)

    # a row is an id and a score: blocks of checkpoint_rows rows are committed as the pass goes
    written = resumable_write(predicted, run.output(run.layout.zero_rag.predictions), "sid", "pred",
                              config.zerorag.checkpoint_rows * 16, "predict", total, stage_at().resources,
                              "zerorag.lm_pruner" if kind == "lm" else None)
    if written["rows"] != total:
        raise RuntimeError(f"mastery prediction wrote {written['rows']} scores for {total} sentences")
    return {"rows_in": total, "rows_out": written["rows"], "rows_rejected": 0, "pruner": kind,
            "rows_resumed": written["rows_resumed"], "rows_computed": written["rows_computed"]}


def index_bytes(loc: Location) -> int:
    return sum(f.size() for f in loc.list_files() if not f.name.endswith(".json"))


def _bins(scores: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Two-level integer bin indices of scores in [0, 1], so histogram and keep mask agree exactly."""
    x = np.clip(np.asarray(scores, np.float64), 0.0, 1.0) * bins
    b1 = np.minimum(x.astype(np.int64), bins - 1)
    b2 = np.minimum(((x - b1) * bins).astype(np.int64), bins - 1)
    return b1, b2


def _tie_draw(ids: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) per id, fixed by the id: which of the sentences tied at the cut are dropped."""
    return (splitmix64(ids, 0x5EED) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def percentile_cut(pred: Location, ratio: float, bins: int) -> dict[str, Any]:
    """Where to cut so that `ratio` of all sentences (those with the highest predicted mastery) are dropped."""
    import ray

    files = [f.uri for f in pred.list_files(".parquet")]

    @ray.remote(num_cpus=LIGHT_CPUS)
    def histogram(uri: str, level1_bin: int | None) -> np.ndarray:
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


def prune(run: RunFolder, config: WbragConfig, ratio: float, force: bool = False) -> dict[str, Any]:
    """Drop the `ratio` most-mastered sentences: keep mask, pruned sentence corpus and pruned index."""
    if not 0 < ratio < 1:
        raise ConfigError(f"--ratio {ratio}: a pruning ratio is a fraction in (0, 1), e.g. 0.3")
    stats = run.execute(PRUNE, config, lambda: _prune(run, config, ratio), params={"ratio": ratio}, force=force)
    print(f"pruned {stats['dropped']} of {stats['sentences_in']} sentences (ratio {stats['achieved_ratio']:.4f}, "
          f"asked {ratio}; mastery >= {stats['threshold']:.4f}); index {stats['source_index_bytes'] / 1e6:.2f} MB -> "
          f"{stats['index_bytes'] / 1e6:.2f} MB", flush=True)
    return stats


def _prune(run: RunFolder, config: WbragConfig, ratio: float) -> dict[str, Any]:
    bins = config.zerorag.histogram_bins
    level = PrunedLevel(run.output(run.layout.zero_rag.pruned(ratio).root))  # beside it while --force redoes it
    t0 = time.perf_counter()
    for part in (level.keep, level.sentences, level.stats):  # not the index: its build resumes what it finished
        part.delete()
    pred = run.layout.zero_rag.predictions
    cut = percentile_cut(pred, ratio, bins)

    def mask(batch: pa.Table) -> pa.Table:
        ids, scores = batch["sid"].to_numpy(), batch["mastery_pred"].to_numpy()
        return pa.table({"id": ids, "mastery_pred": batch["mastery_pred"],
                         "keep": pa.array(keep_mask(ids, scores, cut, bins))})

    ds = read_parquet(pred)
    ds.map_batches(mask, batch_format="pyarrow", num_cpus=LIGHT_CPUS).write_parquet(
        level.keep.path, filesystem=level.keep.fs, ray_remote_args={"num_cpus": LIGHT_CPUS})
    # The dropped ids stay in the object store; the driver holds only their reference and count.
    drop_ref, n_dropped = drop_ids_ref(level.keep, LIGHT_CPUS)
    seconds_cut = time.perf_counter() - t0

    # The pruned sentence corpus: every sentence not dropped, its columns untouched.
    sentences = run.layout.ingest.sentences

    def kept_only(batch: pa.Table, drop) -> pa.Table:
        return batch.filter(pa.array(~in_sorted(batch["sid"].to_numpy(), shared_value(drop))))

    read_parquet(sentences) \
        .map_batches(kept_only, fn_args=(drop_ref,), batch_format="pyarrow", num_cpus=LIGHT_CPUS) \
        .write_parquet(level.sentences.path, filesystem=level.sentences.fs, ray_remote_args={"num_cpus": LIGHT_CPUS})
    kept = level.sentences.num_rows()
    if kept + n_dropped != cut["total"]:
        raise RuntimeError(f"pruned corpus holds {kept} sentences + {n_dropped} dropped != {cut['total']}")

    index_stats = prune_index(run.layout.index, level.index, drop_ref, num_cpus=config.index.num_cpus)
    stats = {
        "ratio": ratio, "achieved_ratio": round(n_dropped / cut["total"], 6),
        "threshold": round(cut["threshold"], 8), "sentences_in": cut["total"], "kept": kept,
        "dropped": n_dropped, "index_vectors": index_stats.get("rows_out"),
        "index_bytes": index_bytes(level.index), "source_index_bytes": index_bytes(run.layout.index),
        "pruner": config.zerorag.pruner, "seconds_percentile_and_mask": round(seconds_cut, 2),
    }
    level.stats.write_json(stats)
    return {"rows_in": cut["total"], "rows_out": kept, "rows_rejected": 0, **stats}


def index_for_ratio(run: RunFolder, ratio: float) -> Location:
    """The index a pruning ratio is evaluated on: the full index at 0, else the pruned one."""
    if ratio == 0:
        return run.layout.index
    if not run.is_complete(PRUNE.instance({"ratio": ratio})):
        raise ConfigError(f"no index pruned at ratio {ratio} in {run.uri}; run `wbrag prune RUN --ratio {ratio}`")
    return run.layout.zero_rag.pruned(ratio).index


def prediction_work(config: WbragConfig, sizes: Sizes, params: dict[str, Any]) -> list[Predict]:
    """Every sentence's mastery predicted by zerorag.pruner: tasks on the stored vectors, or the LM regressor's
    actors over each `title: sentence`."""
    return [Predict(sizes.sentences, config.zerorag.pruner, lm_row_tokens(config.zerorag.lm_pruner, sizes))]


# It also reads the pruner zerorag.pruner names (added to `requires` per call: `predict_stage`).
PREDICT = RunStage("predict", settings=("zerorag.pruner",), requires=(INGEST,),
                   command="wbrag prune RUN --ratio R (after wbrag train-pruner RUN)",
                   title="prediction ({pruner} pruner)", work=prediction_work,
                   run=lambda folder, config, force, services, params: predict(folder, config, force=force),
                   instances=lambda config: [{"pruner": "LM" if config.zerorag.pruner == "lm" else "embedding"}]
                   if config.zerorag.enabled else [],
                   resources=("zerorag.lm_pruner",), outputs=("zero_rag/predictions",))
PRUNE = RunStage(PRUNE_LEVEL, settings=("zerorag.histogram_bins",), requires=(PREDICT, INDEX),
                 command="wbrag prune RUN --ratio {ratio}", title="pruning at {ratio:g}",
                 work=lambda config, sizes, params: [AddVectors(
                     None if sizes.sentences is None else round(sizes.sentences * (1 - params["ratio"])),
                     pruned_from=sizes.sentences)],
                 run=lambda folder, config, force, services, params: prune(folder, config, params["ratio"], force=force),
                 instances=lambda config: [{"ratio": r} for r in config.zerorag.ratios if r > 0]
                 if config.zerorag.enabled else [],
                 resources=("index",), outputs=("zero_rag/prune-{ratio:g}",))
