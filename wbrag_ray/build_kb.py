"""Build the knowledge base: ingest -> embed -> index, each a stage of the run folder."""

from __future__ import annotations

from typing import Any

from wbrag_ray.checkpoints import resumable_write
from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.formats import InputError, listing_identity, reject_reasons
from wbrag_ray.index.build import build_index
from wbrag_ray.index.files import shard_dim
from wbrag_ray.index.sizing import plan_training
from wbrag_ray.layout import IngestFolder
from wbrag_ray.ray_runtime import LIGHT_CPUS, read_parquet
from wbrag_ray.retrieval.docstore import write_doc_store
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.stages.base import Resources, apply_stage
from wbrag_ray.stages.embed import EmbedStage
from wbrag_ray.stages.ingest import run_ingest
from wbrag_ray.storage import resolve
from wbrag_ray.work import AddVectors, Embed, ReadCorpus

# The corpus path is not a setting: the same corpus may be read from a moved copy (a local file, then s3://). Its
# identity is a parameter instead: its files' names and sizes (`corpus_params`), so another corpus is refused.
INGEST = RunStage("ingest", settings=("ingest.shard_bytes", "ingest.max_passage_chars", "ingest.min_sentence_chars"),
                  command="wbrag ingest RUN --corpus PATH",
                  fix="use a new run folder for another corpus (or other ingest settings), or pass --force to ingest "
                      "it into this one (embed and index then need --force too)",
                  work=lambda config, sizes, params: [ReadCorpus(sizes.passages)],
                  run=lambda folder, config, force, services, params: ingest(folder, config, force=force),
                  resources=("ingest",), outputs=("ingest/passages", "ingest/sentences", "ingest/rejects"))
# The query prompt shapes searches, not the stored passage vectors.
EMBED = RunStage("embed", settings=("embedder", "index.unit"), ignore=("embedder.query_prompt",), requires=(INGEST,),
                 command="wbrag embed RUN",
                 work=lambda config, sizes, params: [Embed(sizes.units(config.index.unit), config.index.unit)],
                 run=lambda folder, config, force, services, params: embed(folder, config, force=force),
                 resources=("embedder",), outputs=("embed",))
# Query-time index settings (nprobe, ef_search, k_factor, gpu) shape searches, not the built index (gpu also moves
# the k-means training onto a GPU: where it runs, not what it makes).
INDEX = RunStage("index", settings=("index.factory", "index.train_sample", "index.train_memory_gb", "index.num_shards",
                                    "index.shard_memory_gb", "index.memory_budget_gb", "index.target_recall",
                                    "index.recall_queries"),
                 requires=(EMBED,), command="wbrag index RUN",
                 work=lambda config, sizes, params: [AddVectors(sizes.units(config.index.unit))],
                 run=lambda folder, config, force, services, params: index(folder, config, force=force),
                 resources=("index",), outputs=("index", "docs/<unit>"))
# The stages run.json's config describes: a changed config that would change them is refused for the whole run.
KB_STAGES = (INGEST, EMBED, INDEX)


CORPUS_RECORD = "_corpus.json"  # in RUN/ingest: the identity of the corpus whose shards are there


def corpus_params(config: WbragConfig, run: RunFolder | None = None, force: bool = False) -> dict[str, Any]:
    """The ingest stage's parameter: the corpus's identity; checks the corpus exists, unless ingest is complete."""
    if not config.ingest.corpus:
        raise ConfigError("ingest.corpus is not set; pass --corpus PATH or set ingest.corpus in the config")
    corpus = resolve(config.ingest.corpus)
    if run is not None and not force and run.is_complete(INGEST.name) and not corpus.exists():
        recorded = ((run.stats(INGEST.name) or {}).get("settings") or {}).get("params")
        if recorded:
            print(f"[ingest] corpus {corpus.uri} is not there any more; the run's ingest is complete: using it",
                  flush=True)
            return recorded
    return {"corpus": listing_identity(corpus)}


def ingest(run: RunFolder, config: WbragConfig, force: bool = False) -> dict[str, Any]:
    """Passages and sentences of ingest.corpus, with rejects; a corpus with no usable record fails the stage."""
    corpus = config.ingest.corpus
    params = corpus_params(config, run, force)

    def work() -> dict[str, Any]:
        out = run.output(run.layout.ingest.root)  # beside the ingested corpus while --force redoes it
        # Finished shards of an interrupted ingest are kept only for the same corpus.
        started = out.join(CORPUS_RECORD)
        if started.exists() and started.read_json() != params["corpus"]:
            out.delete()
        started.write_json(params["corpus"])
        stats = run_ingest(corpus, out.uri, config.ingest)
        if stats["rows_out"] == 0:
            rejects = IngestFolder(out).rejects.read_table(columns=["reason"]) if stats["rows_rejected"] else None
            reasons = reject_reasons(rejects) if rejects is not None else "the corpus is empty"
            out.delete()  # nothing usable: a rerun with the right corpus starts clean, with no --force
            raise InputError(
                f"corpus {corpus} has no usable passages ({stats['rows_in']} records, {stats['rows_rejected']} rejected:"
                f" {reasons}). FlashRAG corpus files are UTF-8 jsonl, one {{\"id\", \"contents\": \"Title\\ntext\"}} "
                "object a line, or Parquet with those columns")
        return stats

    return run.execute(INGEST, config, work, params=params, force=force)


def embed(run: RunFolder, config: WbragConfig, force: bool = False) -> dict[str, Any]:
    """Embed every passage (or sentence, by `index.unit`) in an actor pool, resumable row by row."""
    def work() -> dict[str, Any]:
        import ray.data

        src, id_col = run.layout.ingest.units(config.index.unit)
        rows_in = run.stats(INGEST.name)["rows_out" if config.index.unit == "passage" else "sentences"]

        def embedded(placed: Resources) -> ray.data.Dataset:
            columns = [id_col, "text"] + (["title"] if config.index.unit == "passage" else [])
            # One block per ingest shard, so a crash loses at most one shard.
            n_files = len(src.list_files(".parquet"))
            ds = read_parquet(src, override_num_blocks=n_files)
            ds = ds.select_columns(columns)  # pushed down into the Parquet read by Ray's optimizer
            ds = ds.map_batches(unit_text, fn_kwargs={"id_col": id_col}, batch_format="pandas", num_cpus=LIGHT_CPUS)
            # the placement the pass runs with (a resume narrows it to fit the cluster): what it writes is the same
            placement = {"num_cpus": placed.num_cpus, "concurrency": placed.concurrency}
            return apply_stage(ds, EmbedStage(config.embedder.model_copy(update=placement), id_column=id_col))

        stage = EmbedStage(config.embedder, id_column=id_col)
        bytes_per_row = 8 + 4 * 1024  # an id and up to 1024 float32 dimensions
        written = resumable_write(embedded, run.output(run.layout.embed), id_col, "emb",
                                  config.embedder.checkpoint_rows * bytes_per_row, "embed", rows_in, stage.resources,
                                  "embedder")
        if written["rows"] != rows_in:
            raise RuntimeError(f"embed wrote {written['rows']} vectors for {rows_in} {config.index.unit}s")
        return {"rows_in": rows_in, "rows_out": written["rows"], "rows_rejected": 0, "unit": config.index.unit,
                "rows_resumed": written["rows_resumed"], "rows_computed": written["rows_computed"],
                "resumed": written["resumed"]}

    return run.execute(EMBED, config, work, force=force)


def index(run: RunFolder, config: WbragConfig, force: bool = False) -> dict[str, Any]:
    """Build the index (`index.build.build_index`) and the document store searches look hits up in."""
    def work() -> dict[str, Any]:
        ic = config.index
        docs = run.layout.docs.join(ic.unit)
        # while --force redoes a built index, the new one is built beside it and replaces it once complete
        store = write_doc_store(run.layout.ingest.root, ic.unit, run.output(docs))
        stats = build_index(run.layout.embed, run.output(run.layout.index), config.embedder.model, ic.unit, ic,
                            docs=docs.uri)  # the manifest names its documents: a search needs only the index folder
        return {**stats, "doc_store_files": store["files"]}

    return run.execute(INDEX, config, work, force=force)


def check_factory(run: RunFolder, config: WbragConfig) -> None:
    """Check index.factory against the embeddings' dimension and training sample before Ray starts, so a mistyped
    factory with --force never replaces a built index."""
    factory = config.index.factory
    if factory.strip().lower() == "auto":
        return
    import faiss

    dim = 3840  # divisible by every usual PQ / OPQ sub-quantizer count (8 ... 128), when the vectors are not built
    files = run.layout.embed.list_files(".parquet") if run.is_complete(EMBED.name) else []
    if files:
        dim = shard_dim(files[0])
    try:
        faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise ConfigError(
            f"index.factory {factory!r} is not a factory string faiss can build for {dim}-dimensional vectors ({detail}); "
            "for example Flat, HNSW32, IVF4096,Flat, OPQ48,IVF65536_HNSW32,PQ48, or auto") from None
    vectors = (run.stats(EMBED.name) or {}).get("rows_out") if files else None
    if vectors:
        ic = config.index
        try:
            plan_training(int(vectors), dim, factory, ic.train_sample, ic.memory_budget_gb, ic.train_memory_gb)
        except ValueError as exc:
            raise ConfigError(f"{exc} (the run has {int(vectors):,} vectors)") from None


def unit_text(batch, id_col: str):
    """(id, text) for the embedder: passages are embedded as 'Title\\ntext', as FlashRAG's indices are."""
    import pandas as pd

    text = batch["title"] + "\n" + batch["text"] if "title" in batch else batch["text"]
    return pd.DataFrame({id_col: batch[id_col].astype("int64"), "text": text})
