"""Every path of a run folder, named once (the tree: docs/architecture.md, The run folder): writers, readers and
tests reach a file through these classes, each deriving paths from a root Location, never a typed string."""

from __future__ import annotations

import re
from dataclasses import dataclass

from wbrag_ray.config import ConfigError
from wbrag_ray.storage import Location, committed, next_version

STAGES_DIR = "_stages"
DEDUPE_PREFIX = "dedupe-"  # rejects files of passages dropped as duplicate ids, beside the shards' own


def plain_name(value: str, what: str, reserved: tuple[str, ...] = ()) -> str:
    """A user's name that becomes a folder name in the run: letters, digits, '-', '_', '.', not leading '.' or '-'."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", value or "") or value in reserved:
        taken = f" (not {', '.join(repr(r) for r in reserved)})" if reserved else ""
        raise ConfigError(f"{what} {value!r} is not a plain name: use letters, digits, '-', '_' and '.', starting with "
                          f"a letter or digit{taken}; it names a folder inside the run")
    return value


def _at(*parts: str) -> property:
    """A path below the folder's `root`, as a read-only attribute."""

    def path(self) -> Location:
        return self.root.join(*parts)

    return property(path)


def _out(folder: str, *parts: str) -> property:
    """A path in a stage's output `folder`, as readers see it: in the version its last commit names
    (`storage.commit`), or in the folder itself where it holds no pointer (plain, or made by an earlier version)."""

    def path(self) -> Location:
        return committed(self.root.join(folder)).join(*parts)

    return property(path)


def subdirs(loc: Location) -> list[str]:
    """Names of the folders directly below `loc`, sorted (none when it does not exist)."""
    import pyarrow.fs as pafs

    if not loc.exists():
        return []
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.path))
    # hidden names are a writer's staging folders, never results
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory and not i.base_name.startswith("."))


@dataclass(frozen=True)
class IngestFolder:
    """The ingested corpus: passage and sentence shards, rejects with reasons, one marker per finished shard."""

    root: Location
    passages = _at("passages")
    sentences = _at("sentences")
    rejects = _at("rejects")
    shard_markers = _at("_shards")

    def units(self, unit: str) -> tuple[Location, str]:
        """(folder, id column) of the documents an index of `unit` holds."""
        return (self.passages, "pid") if unit == "passage" else (self.sentences, "sid")

    def shard_outputs(self, shard: str) -> tuple[Location, Location, Location]:
        """The passages, sentences and rejects files one ingest shard writes."""
        name = f"{shard}.parquet"
        return self.passages.join(name), self.sentences.join(name), self.rejects.join(name)

    def shard_marker(self, shard: str) -> Location:
        """The shard's stats, written after its outputs: the shard is done when this exists."""
        return self.shard_markers.join(f"{shard}.json")

    def finished_shards(self) -> set[str]:
        return {f.name.removesuffix(".json") for f in self.shard_markers.list_files(".json")}

    def dedupe_rejects(self, passages_file: str) -> Location:
        """The rejects of the duplicate-id passages removed from one passages file (written before it is)."""
        return self.rejects.join(DEDUPE_PREFIX + passages_file)

    def dedupe_rejects_files(self) -> list[Location]:
        return [f for f in self.rejects.list_files(".parquet") if f.name.startswith(DEDUPE_PREFIX)]


@dataclass(frozen=True)
class StageRecord:
    root: Location
    stats = _at("stats.json")  # rows in / out / rejected, seconds, the stage's figures and its fingerprint
    success = _at("_SUCCESS")  # empty, written last: the stage is complete when it exists


@dataclass(frozen=True)
class EvalResult:
    """One method's evaluation under one label."""

    root: Location
    metrics = _at("metrics.json")
    predictions = _at("predictions.parquet")
    rejects = _at("rejects.parquet")


@dataclass(frozen=True)
class WritebackVersion:
    """One trained write-back version: scored examples, distiller calls, units, their embeddings and index, Table 3."""

    root: Location
    scored = _at("scored.parquet")
    distill = _at("distill.parquet")
    corpus = _at("corpus")
    units = _at("corpus", "units.parquet")
    docs = _at("docs")  # the corpus as a document store: what a search looks hits up in
    embed = _at("embed")
    embed_file = _at("embed", "emb-000000.parquet")  # the units' vectors, in the embedding-shard format
    index = _at("index")
    stats = _at("stats.json")
    sweep = _at("sweep.json")  # the gates re-applied under other thresholds (writeback.sweep)
    validation = _at("validation.json")  # base vs base + version on held-out training questions
    validation_questions = _at("validation.parquet")  # those questions (writeback.validation)

    @property
    def version(self) -> str:
        return self.root.name


ADAPTER_STATS = "tune.json"  # written by training.noise_tolerant beside the adapter's weights
PRUNE_LEVEL = "prune-{ratio:g}"  # the folder and stage name of a pruning ratio


@dataclass(frozen=True)
class PrunedLevel:
    """The base pruned at one ratio: the keep mask, the pruned sentence corpus and its index."""

    root: Location
    keep = _at("keep")
    sentences = _at("sentences")
    index = _at("index")
    stats = _at("stats.json")


@dataclass(frozen=True)
class ZeroRagFolder:
    root: Location
    mastery = _out("mastery")
    qa = _out("mastery", "qa.parquet")  # every QA pair with its status and the closed-book answer
    scores = _out("mastery", "scores.parquet")
    mastery_stats = _out("mastery", "stats.json")
    predictions = _out("predictions")  # sid, mastery_pred for every sentence
    router = _out("router")
    router_metrics = _out("router", "metrics.json")
    router_labels = _out("router", "labels.parquet")  # each training question's answer, label and probability
    adapter = _out("adapter")
    adapter_tune = _out("adapter", ADAPTER_STATS)
    grid = _at("grid.json")

    def pruner(self, kind: str) -> Location:
        return committed(self.root.join("pruner", kind))

    def pruner_kinds(self) -> list[str]:
        return subdirs(self.root.join("pruner"))

    def pruner_metrics(self, kind: str) -> Location:
        return self.pruner(kind).join("metrics.json")

    def pruner_validation(self, kind: str) -> Location:
        """Measured and predicted mastery of each held-out sentence."""
        return self.pruner(kind).join("validation.parquet")

    def pruned(self, ratio: float) -> PrunedLevel:
        return PrunedLevel(committed(self.root.join(PRUNE_LEVEL.format(ratio=ratio))))

    def pruned_levels(self) -> list[PrunedLevel]:
        """Every pruned level written so far (with its stats), by folder name."""
        levels = [PrunedLevel(committed(self.root.join(d))) for d in subdirs(self.root) if d.startswith("prune-")]
        return [lv for lv in levels if lv.stats.exists()]


@dataclass(frozen=True)
class RunLayout:
    """The run folder's paths (see the module's docstring)."""

    root: Location
    run_json = _at("run.json")
    lease = _at("_lease.json")  # the writer holding the folder (wbrag_ray.lease)
    stages = _at(STAGES_DIR)
    embed = _out("embed")
    checkpoints = _at("_checkpoints")
    index = _out("index")
    docs = _at("docs")  # the document store of each index unit (docs/passage; read through the index's manifest)
    eval = _at("eval")
    writeback = _at("writeback")
    writeback_active = _at("writeback", "ACTIVE")
    report = _at("report")  # the report's two renderings and their plots
    report_html = _at("report", "index.html")
    report_markdown = _at("report", "report.md")
    plan = _at("plan", "plan.json")  # the plan `wbrag run` made when it started (wbrag_ray.plan.against_run)
    calibration = _at("plan", "calibration.json")  # the rates `wbrag plan --calibrate --run RUN` measured

    @property
    def ingest(self) -> IngestFolder:
        return IngestFolder(committed(self.root.join("ingest")))

    @property
    def zero_rag(self) -> ZeroRagFolder:
        return ZeroRagFolder(self.root.join("zero_rag"))

    def checkpoint(self, stage: str) -> Location:
        """What a running stage committed so far (answers, Ray Data's row checkpoint); gone once it completes."""
        return self.checkpoints.join(stage)

    def stage(self, name: str) -> StageRecord:
        return StageRecord(self.stages.join(name))

    def eval_result(self, label: str, method: str) -> EvalResult:
        return EvalResult(committed(self.eval.join(f"{label}-{method}")))

    def eval_staging(self, label: str, method: str) -> EvalResult:
        """New results written beside `eval_result(label, method)` until they replace it (hidden: never listed)."""
        return EvalResult(next_version(self.eval_result(label, method).root))

    def eval_results(self) -> list[EvalResult]:
        """Every evaluated (label, method) folder with its metrics written, by name."""
        found = [EvalResult(committed(self.eval.join(d))) for d in subdirs(self.eval)]
        return [r for r in found if r.metrics.exists()]

    def methods_grid(self, name: str | None = None) -> Location:
        """The methods x write-back grid; `name` for a Zero-RAG setting's own grid."""
        return self.eval.join(f"methods_grid-{name}.json" if name else "methods_grid.json")

    def methods_grids(self) -> list[Location]:
        return [f for f in self.eval.list_files(".json") if f.name.startswith("methods_grid")]

    def writeback_version(self, version: str) -> WritebackVersion:
        return WritebackVersion(committed(self.writeback.join(version)))

    def writeback_versions(self) -> list[WritebackVersion]:
        """Every version folder with its Table 3 written, by name."""
        found = [self.writeback_version(v) for v in subdirs(self.writeback)]
        return [v for v in found if v.stats.exists()]
