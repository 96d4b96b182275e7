"""Build the knowledge base: ingest -> embed -> index, each a stage of the run folder."""

from __future__ import annotations

from typing import Any

from ray.data.datasource import FilenameProvider

from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.run import RunFolder

UNIT_SOURCES = {"passage": ("passages", "pid"), "sentence": ("sentences", "sid")}


def ingest(run: RunFolder, config: WbragConfig, force: bool = False) -> dict[str, Any]:
    from wbrag_ray.stages.ingest import run_ingest

    corpus = config.ingest.corpus
    if not corpus:
        raise ConfigError("ingest.corpus is not set; pass --corpus PATH or set ingest.corpus in the config")
    out = run.path("ingest")
    if force:
        out.delete()
    return run.run_stage("ingest", lambda: run_ingest(corpus, out.uri, config.ingest), force=force)


def embed(run: RunFolder, config: WbragConfig, force: bool = False) -> dict[str, Any]:
    """Embed every passage (or sentence, by `index.unit`) in an actor pool; one Parquet file per block."""
    _require(run, "ingest", "wbrag ingest RUN --corpus PATH")

    def work() -> dict[str, Any]:
        import ray.data

        from wbrag_ray.ray_runtime import LIGHT_CPUS
        from wbrag_ray.stages.base import apply_stage
        from wbrag_ray.stages.embed import EmbedStage

        folder, id_col = UNIT_SOURCES[config.index.unit]
        src, out = run.path("ingest", folder), run.path("embed")
        columns = [id_col, "text"] + (["title"] if folder == "passages" else [])
        ds = ray.data.read_parquet(src.path, filesystem=src.fs, columns=columns, ray_remote_args={"num_cpus": LIGHT_CPUS})
        ds = ds.map_batches(_unit_text, fn_kwargs={"id_col": id_col}, batch_format="pandas", num_cpus=LIGHT_CPUS)
        ds = apply_stage(ds, EmbedStage(config.embedder))
        ds.write_parquet(
            out.path,
            filesystem=out.fs,
            filename_provider=StableNames("emb"),
            mode="overwrite",  # the stage owns its folder; stable names instead of per-run UUIDs
            ray_remote_args={"num_cpus": LIGHT_CPUS},
        )
        n = _count_rows(out)
        rows_in = run.stats("ingest")["rows_out" if folder == "passages" else "sentences"]
        if n != rows_in:
            raise RuntimeError(f"embed wrote {n} vectors for {rows_in} {folder}")
        return {"rows_in": rows_in, "rows_out": n, "rows_rejected": 0, "unit": config.index.unit}

    return run.run_stage("embed", work, force=force)


def index(run: RunFolder, config: WbragConfig, force: bool = False) -> dict[str, Any]:
    from wbrag_ray.index.faiss_index import build_index

    _require(run, "embed", "wbrag embed RUN")

    def work() -> dict[str, Any]:
        return build_index(
            run.path("embed"),
            run.path("index"),
            config.index.factory,
            config.embedder.model,
            config.index.unit,
            config.index.train_sample,
        )

    return run.run_stage("index", work, force=force)


def _unit_text(batch, id_col: str):
    """(id, text) for the embedder: passages are embedded as 'Title\\ntext', as FlashRAG's indices are."""
    import pandas as pd

    text = batch["title"] + "\n" + batch["text"] if "title" in batch else batch["text"]
    return pd.DataFrame({"id": batch[id_col].astype("int64"), "text": text})


def _count_rows(loc) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f.path, filesystem=f.fs).metadata.num_rows for f in loc.list_files(".parquet"))


def _require(run: RunFolder, stage: str, command: str) -> None:
    if not run.is_complete(stage):
        raise ConfigError(f"stage '{stage}' of run {run.uri} is not complete; run `{command}` first")


class StableNames(FilenameProvider):
    """`<prefix>-<task index>.parquet`: no per-run UUID (Ray's default), so a retried write task overwrites
    its own file instead of adding a second copy. Ray 2.60 asks that names depend on the task index only."""

    def __init__(self, prefix: str):
        super().__init__(file_format="parquet")
        self.prefix = prefix

    def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
        return f"{self.prefix}-{task_index:06d}.parquet"
