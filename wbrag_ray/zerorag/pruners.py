"""Zero-RAG step 2: pruners trained on the scored sample, validated on a held-out part: `embedding` (a head on
the stored sentence vectors) or `lm` (the paper's LoRA LM regressor). Each writes RUN/zero_rag/pruner/<kind>/."""

from __future__ import annotations

import functools
import tempfile
import time
from typing import Any

import numpy as np
import pandas as pd

from wbrag_ray.build_kb import EMBED
from wbrag_ray.config import ConfigError, LMPrunerConfig, WbragConfig, ZeroRagConfig
from wbrag_ray.formats import plain_table
from wbrag_ray.models.pruner import EmbeddingHead, pruner_metrics
from wbrag_ray.ray_runtime import LIGHT_CPUS, read_parquet, select_rows
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.storage import resolve
from wbrag_ray.training.lm_pruner import train_lm_pruner
from wbrag_ray.work import Sizes, Train
from wbrag_ray.zerorag.mastery import MASTERY, titled


def train_pruner(run: RunFolder, config: WbragConfig, kind: str | None = None, force: bool = False) -> dict[str, Any]:
    """Train one pruner (`kind`, default: the configured ones) on the scored sample; validate it on the held-out part."""
    kinds = [kind] if kind else list(dict.fromkeys([*config.zerorag.train_pruners, config.zerorag.pruner]))
    results = {}
    for k in kinds:
        results[k] = m = run.execute(PRUNERS[k], config, lambda k=k: _train_one(run, config, k), force=force)
        tq = m["top_quantile"]
        print(f"pruner {k}: mse {m['mse']} (predicting the mean: {m['mse_predict_mean']}), spearman {m['spearman']}, "
              f"top {tq['q']:.0%} precision {tq['precision']} recall {tq['recall']}", flush=True)
    return results


def pruner_inputs(run: RunFolder):
    """A Ray Dataset of (sid, text) for every sentence; each sentences file joins only its own shard's passages."""

    src = run.layout.ingest.sentences
    ds = read_parquet(src, columns=["sid", "pid", "text"], include_paths=True)
    return ds.map_batches(_with_titles, fn_kwargs={"passages": run.layout.ingest.passages.uri},
                          batch_format="pandas", num_cpus=LIGHT_CPUS)


def _with_titles(batch: pd.DataFrame, passages: str) -> pd.DataFrame:
    parts = []
    for path, part in batch.groupby("path", sort=False):
        titles = _shard_titles(passages, path.rsplit("/", 1)[-1])
        text = titled(part["pid"].map(titles).fillna(""), part["text"])
        parts.append(pd.DataFrame({"sid": part["sid"].astype("int64"), "text": text}))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame({"sid": [], "text": []})


@functools.lru_cache(maxsize=4)
def _shard_titles(passages: str, file_name: str) -> pd.Series:
    """pid -> title of one passages shard (cached: a task's batches come from a few shards)."""
    table = resolve(passages).join(file_name).read_table(["pid", "title"])
    return pd.Series(table["title"].to_pylist(), index=table["pid"].to_numpy())


def _scored_split(run: RunFolder, z: ZeroRagConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The scored sample split into (train, validation) by a seeded permutation; unscored sentences left out."""
    scores = run.layout.zero_rag.scores.read_table().to_pandas()
    scores = scores[scores["mastery"].notna()].sort_values("sid").reset_index(drop=True)
    n_val = int(round(len(scores) * z.val_fraction))
    if len(scores) - n_val < 4 or n_val < 2:
        raise ConfigError(f"only {len(scores)} sentences of {run.uri} have a mastery score: too few to train and "
                          "validate a pruner; score more with `wbrag mastery RUN --sample N` (zerorag.sample)")
    order = np.random.default_rng(z.seed).permutation(len(scores))
    return scores.iloc[order[n_val:]].reset_index(drop=True), scores.iloc[order[:n_val]].reset_index(drop=True)


def _train_one(run: RunFolder, config: WbragConfig, kind: str) -> dict[str, Any]:
    z = config.zerorag
    train, val = _scored_split(run, z)
    out = run.output(run.layout.zero_rag.pruner(kind))  # beside the trained pruner while --force redoes it
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "embedding":
            predicted, fit = _train_head(run, config, train, val, tmp)
        else:
            # on Ray Train workers; the worker that trained it also predicts the held-out sentences
            fit = train_lm_pruner(titled(train["title"], train["text"]), train["mastery"].tolist(), z.lm_pruner,
                                  tmp, val_texts=titled(val["title"], val["text"]))
            predicted = np.asarray(fit.pop("validation"), np.float32)
            fit = {k: v for k, v in fit.items() if k not in ("losses", "group_loss", "config")}
        out.upload_dir(tmp)
    q = z.ratios[0] if z.ratios and z.ratios[0] > 0 else 0.3
    metrics = {"kind": kind, "n_train": len(train), "n_val": len(val),
               **pruner_metrics(val["mastery"].to_numpy(), predicted, q), "fit": fit,
               "seconds": round(time.perf_counter() - t0, 2)}
    out.join(run.layout.zero_rag.pruner_metrics(kind).name).write_json(metrics)
    out.join(run.layout.zero_rag.pruner_validation(kind).name).write_table(plain_table(pd.DataFrame(
        {"sid": val["sid"].astype("int64"), "measured": val["mastery"].astype("float64"),
         "predicted": np.asarray(predicted, np.float64)})))
    return {"rows_in": len(train) + len(val), "rows_out": len(val), **metrics}


def _train_head(run: RunFolder, config: WbragConfig, train: pd.DataFrame, val: pd.DataFrame, tmp: str):
    """The embedding head on the scored sentences' stored vectors; (validation predictions, fit figures)."""
    z = config.zerorag
    both = pd.concat([train, val], ignore_index=True)
    vec = select_rows(run.layout.embed, "sid", both["sid"].to_numpy(), ["sid", "vector"])
    vectors = dict(zip(vec["sid"], vec["vector"], strict=True))
    missing = [s for s in both["sid"] if s not in vectors]
    if missing:
        raise ConfigError(f"{len(missing)} scored sentences have no stored vector in {run.layout.embed.uri} "
                          f"(e.g. sid {missing[0]}): re-embed with `wbrag embed RUN --force`")

    def stack(df: pd.DataFrame) -> np.ndarray:
        return np.stack([np.asarray(vectors[s], np.float32) for s in df["sid"]])

    head, losses = EmbeddingHead.train(stack(train), train["mastery"].to_numpy(), z.head_hidden,
                                       z.head_epochs, z.head_weight_decay, seed=z.seed)
    head.save(tmp, {"settings": run.fingerprint(PRUNERS["embedding"], config), "dim": head.dim})
    return head.predict(stack(val)), {"first_loss": round(losses[0], 5), "last_loss": round(losses[-1], 5)}


def lm_row_tokens(lm: LMPrunerConfig, sizes: Sizes) -> float:
    """Tokens of an LM pruner's row, `title: sentence` (no chat template), cut at max_length."""
    return min(lm.max_length, sizes.tokens("title") + 1 + sizes.tokens("sentence"))


def _pruner(kind: str, title: str, settings: tuple[str, ...], requires: tuple[RunStage, ...],
            resources: tuple[str, ...]) -> RunStage:
    def work(config: WbragConfig, sizes: Sizes, params: dict[str, Any]) -> list[Train]:
        z = config.zerorag
        fit = max(1, round(z.sample * (1 - z.val_fraction)))
        if kind == "embedding":  # a small regression head on the sample's stored vectors, in the driver
            return [Train(config.embedder.model, "zerorag", fit, rows=f"a head on {fit:,} stored vectors, in the driver",
                          head=True)]
        lm, row = z.lm_pruner, lm_row_tokens(z.lm_pruner, sizes)
        return [Train(lm.backbone, "zerorag.lm_pruner", fit, row, f"rows of `title: sentence`, {row:,.0f} tokens")]

    # zerorag.seed and val_fraction: which scored sentences train and which validate
    return RunStage(f"pruner-{kind}", settings=("zerorag.seed", "zerorag.val_fraction", *settings), requires=requires,
                    command=f"wbrag train-pruner RUN --kind {kind}", title=title, work=work,
                    run=lambda folder, config, force, services, params: train_pruner(folder, config, kind=kind,
                                                                                     force=force),
                    instances=lambda config: [{}] if config.zerorag.enabled and kind in (
                        *config.zerorag.train_pruners, config.zerorag.pruner) else [],
                    resources=resources, outputs=(f"zero_rag/pruner/{kind}",))


PRUNERS = {
    "embedding": _pruner("embedding", "pruner training (embedding head)",
                         ("zerorag.head_hidden", "zerorag.head_epochs", "zerorag.head_weight_decay"), (MASTERY, EMBED), ()),
    "lm": _pruner("lm", "pruner training (LM regressor)", ("zerorag.lm_pruner",), (MASTERY,),
                  ("zerorag.lm_pruner.trainer",)),
}
