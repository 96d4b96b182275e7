"""Row-level checkpoints: a stage killed part way (the driver, the head node or the job lost, or stopped by a
person) resumes where it died when the same command runs again, and writes what an uninterrupted run writes.

Four kinds of work, one folder per stage (`RUN/_checkpoints/<stage>/`, removed when the stage completes):

- Ray Data passes over the corpus (embedding, pruner prediction) write their output files as they go under
  Ray Data's `CheckpointConfig` on the rows' int64 id column (`resumable_write`): the rerun reads only the
  rows whose ids are not checkpointed, and adds files beside the ones already written.
- Generator passes the driver feeds (mastery's QA writing and closed-book answers, the router's labels,
  write-back's utility scoring, document gate and distiller, every RAG method's evaluation answers) go through
  `GeneratorPasses`, whose answer memo is keyed by what decides a greedy answer (the model's settings, token
  budget, stop strings, mode, the prompt). The stage's `AnswerStore` writes those keys and answers in blocks
  as batches finish (`answers/block-*.parquet`, each file whole or absent: written under a temporary name,
  then moved; an object store's PUT is atomic), and the rerun's memo starts from them: a prompt answered
  before the kill is not decoded again, whichever pass or grid cell asks it. Settings that change answers
  change the key, so an old block is never taken for a new setting; and a checkpoint made under another stage
  fingerprint (other settings, or inputs made again) is removed before the stage starts.

- Trainings (the LM pruner, noise-tolerant tuning) run as Ray Train jobs whose storage is the stage's `train/`
  folder: the trainable weights, optimizer state and step every `trainer.checkpoint_steps` steps; the rerun's
  workers load the last one and take the batches an uninterrupted run would (`training.workers`).

- Tasks that each write whole files (an index build's training, add and merge tasks: `TaskRecords`) record
  their results in the stage's `tasks/` folder once their files are written; the rerun reuses what is
  recorded (the trained index, the parts, the merged shards, which stay where the build wrote them) and runs
  the other tasks.

`stage_checkpoint` opens a stage's checkpoint for the stage's work (`RunFolder.run_stage`); the passes reach it
through `active()`, so every pass of a stage is resumable without being told where the run folder is.

Over 400 lines (about 430), not split: the four kinds of checkpoint share the stage's folder and its record, and
the Ray Data pass that writes under one (`resumable_write`) sizes its resume here, beside the checkpoint it reads.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from wbrag_ray.cluster_nodes import autoscaling, cluster_nodes, refuse_unplaceable
from wbrag_ray.layout import subdirs
from wbrag_ray.lease import fence
from wbrag_ray.ray_runtime import LIGHT_CPUS, stable_names
from wbrag_ray.storage import Location, StorageError, refused_writes
from wbrag_ray.waits import pool_start_wait

if TYPE_CHECKING:
    import ray.data

    from wbrag_ray.stages.base import Resources

# A block of answers is committed once it holds this many rows, or this many seconds after the last one:
# a killed driver loses at most that much decoding (defaults; `generator.checkpoint_rows` and
# `generator.checkpoint_seconds` set them for each pass).
BLOCK_ROWS = 1024
BLOCK_SECONDS = 60.0


def _plain(value: Any) -> Any:
    """numpy values (answers that came back through Arrow) as JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot checkpoint a {type(value).__name__}")


class AnswerStore:
    """A stage's committed answers: 16-byte keys (see `generation.passes.AnswerMemo`) and their output values,
    loaded whole when the stage starts again (a stage's answers are what its driver holds anyway) and added to
    in blocks. `before_commit` runs before each block is written (the stage records its fingerprint)."""

    def __init__(self, folder: Location, block_rows: int = BLOCK_ROWS, block_seconds: float = BLOCK_SECONDS,
                 before_commit: Callable[[], None] | None = None):
        import pyarrow.parquet as pq

        self.folder = folder
        self.before_commit = before_commit
        self.block_rows = block_rows
        self.block_seconds = block_seconds
        self.answers: dict[bytes, tuple] = {}
        for f in folder.list_files(".parquet"):  # temporary names end in .tmp: never read
            table = pq.read_table(f.path, filesystem=f.fs)
            for key, value in zip(table["key"].to_pylist(), table["value"].to_pylist(), strict=True):
                self.answers[key] = tuple(json.loads(value))
        self.loaded = len(self.answers)
        self.blocks = 0
        self._pending: list[tuple[bytes, str]] = []
        self._last = time.monotonic()

    def add(self, items: Iterable[tuple[bytes, tuple]]) -> None:
        """Answers just decoded; committed once a block is full or old enough."""
        self._pending.extend((key, json.dumps(list(value), default=_plain)) for key, value in items)
        if len(self._pending) >= self.block_rows or time.monotonic() - self._last >= self.block_seconds:
            self.flush()

    def flush(self) -> None:
        """Commit what is pending as one block file."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._last = time.monotonic()
        if not self._pending:
            return
        if self.before_commit is not None:
            self.before_commit()
        keys, values = zip(*self._pending, strict=True)
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"key": pa.array(keys, pa.binary()), "value": pa.array(values, pa.string())}), sink)
        self.folder.join(f"block-{uuid.uuid4().hex}.parquet").write_bytes(sink.getvalue().to_pybytes())
        self.blocks += 1
        self._pending = []


class TaskRecords:
    """A pass of tasks that each write whole files under names their items give (an index build's add and merge
    tasks): a task that ends writes its result, a small JSON, here after its files, and a rerun takes the
    recorded results and runs only the other tasks. A task killed before its record runs again and overwrites
    its files; a record is written whole or not at all (`Location.write_json`)."""

    def __init__(self, folder: Location):
        self.folder = folder
        self._done: dict[str, Any] | None = None

    def done(self) -> dict[str, Any]:
        """The results earlier attempts recorded, by task name: read once (a build asks for each of its passes;
        what this attempt's tasks record, it holds already)."""
        if self._done is None:
            self._done = {f.name[: -len(".json")]: f.read_json() for f in self.folder.list_files(".json")}
        return self._done

    def uri(self, name: str) -> str:
        """Where the task `name` records its result."""
        return self.folder.join(f"{name}.json").uri


class StageCheckpoint:
    """The checkpoint folder of one running stage, and what its passes resumed and computed. The stage's
    fingerprint is recorded beside the first thing committed: a stage that stops before committing anything
    (a bad input refused part way) leaves nothing in the run folder."""

    def __init__(self, folder: Location, fingerprint: dict[str, Any] | None = None, block_rows: int = BLOCK_ROWS):
        self.folder = folder
        self.fingerprint = fingerprint
        self.block_rows = block_rows
        self.rows_resumed = 0
        self.rows_computed = 0
        self._answers: AnswerStore | None = None
        self._pass: dict[str, Any] | None = None

    @property
    def rows(self) -> Location:
        """Ray Data's checkpoint of a pass over the corpus (`resumable_write`)."""
        return self.folder.join("rows")

    def tasks(self, name: str) -> TaskRecords:
        """The records of a pass of whole-file tasks (`TaskRecords`), e.g. an index build's."""
        return TaskRecords(self.folder.join("tasks", name))

    @property
    def training(self) -> Location:
        """Ray Train's storage of the stage's training (`training.workers.fit`): its checkpoints by step."""
        return self.folder.join("train")

    def answers(self, block_rows: int | None = None, block_seconds: float | None = None) -> AnswerStore:
        """The stage's answer store, opened (and its committed blocks read) on first use; each pass sets how many
        rows or seconds a block holds at most (its generator's `checkpoint_rows` / `checkpoint_seconds`)."""
        if self._answers is None:
            self._answers = AnswerStore(self.folder.join("answers"), block_rows or self.block_rows,
                                        before_commit=self.record)
        if block_rows:
            self._answers.block_rows = block_rows
        if block_seconds:
            self._answers.block_seconds = block_seconds
        return self._answers

    def record(self) -> None:
        """Before anything is committed: this command still holds the run folder's lease (`lease.fence`: a command
        whose lease was taken stops here), the stage's fingerprint (once), and the pass now running."""
        fence(self.folder)
        record = self.folder.join("fingerprint.json")
        if self.fingerprint is not None and not record.exists():
            record.write_json(self.fingerprint)
        if self._pass is not None:
            self.folder.join("pass.json").write_json(self._pass)
            self._pass = None

    def begin_pass(self, name: str, total: int) -> None:
        """The pass now running and its rows, for `wbrag status` (`progress`): recorded with its first commit
        (a pass that decodes nothing leaves no checkpoint)."""
        self._pass = {"pass": name, "rows": total}

    def count(self, resumed: int, computed: int) -> None:
        self.rows_resumed += resumed
        self.rows_computed += computed

    def stats(self) -> dict[str, int]:
        """`rows_resumed` / `rows_computed` for the stage's stats, when a pass counted any."""
        if not (self.rows_resumed or self.rows_computed):
            return {}
        return {"rows_resumed": self.rows_resumed, "rows_computed": self.rows_computed}


_ACTIVE: contextvars.ContextVar[StageCheckpoint | None] = contextvars.ContextVar("wbrag_stage_checkpoint",
                                                                                  default=None)


def active() -> StageCheckpoint | None:
    """The checkpoint of the stage running in this process (None outside a stage)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def stage_checkpoint(folder: Location, fingerprint: dict[str, Any] | None, label: str) -> Iterator[StageCheckpoint]:
    """Open `folder` as the running stage's checkpoint: one made under another fingerprint is removed first
    (its answers or rows may come from other settings or other inputs), then the fingerprint is recorded."""
    record = folder.join("fingerprint.json")
    if folder.exists():
        previous = record.read_json() if record.exists() else None
        if previous != json.loads(json.dumps(fingerprint, default=str)):
            print(f"[{label}] the checkpoint of an earlier attempt was made with other settings: starting over",
                  flush=True)
            folder.delete()
    checkpoint = StageCheckpoint(folder, fingerprint)
    token = _ACTIVE.set(checkpoint)
    try:
        yield checkpoint
    finally:
        _ACTIVE.reset(token)
        if checkpoint._answers is not None:
            checkpoint._answers.flush()  # a stage that fails keeps what it decoded


def progress(folder: Location) -> dict[str, Any]:
    """What the checkpoint of an incomplete stage holds: the pass it was in and that pass's rows, and how many
    rows (answers, or rows Ray Data checkpointed) are committed."""
    info = folder.join("pass.json")
    out: dict[str, Any] = info.read_json() if info.exists() else {}
    committed = sum(n for part in ("answers", "rows") for name, n in rows_by_file(folder.join(part)).items()
                    if not name.endswith(".pending.parquet"))  # Ray Data's mark of a write not yet committed
    tasks = folder.join("tasks")  # whole-file tasks record the rows they read (an index build's add tasks)
    for name in subdirs(tasks):
        committed += sum(int(r.get("rows", 0)) for r in TaskRecords(tasks.join(name)).done().values())
    out["committed"] = committed
    out.update(training_progress(folder))
    return out


def training_progress(folder: Location) -> dict[str, Any]:
    """The step of a stopped training's last checkpoint, from Ray Train's snapshot in the stage checkpoint's
    `train/<label>/` folder (`training.workers.fit`); empty when the stage trains nothing."""
    train = folder.join("train")
    for label in subdirs(train):
        snapshot = train.join(label, "checkpoint_manager_snapshot.json")
        if snapshot.exists():
            latest = snapshot.read_json().get("latest_checkpoint_result") or {}
            return {"trained_steps": int(latest.get("metrics", {}).get("step", 0))}
    return {}


def rows_by_file(folder: Location) -> dict[str, int]:
    """Rows of each Parquet file in `folder`, from its footer. A file the kill cut short has none: Ray's checkpoint
    filter deletes it on the resumed run (its checkpoint was never committed) and its rows are written again."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    for f in folder.list_files(".parquet"):
        try:
            out[f.name] = pq.ParquetFile(f.path, filesystem=f.fs).metadata.num_rows
        except (pa.ArrowInvalid, OSError):
            continue
    return out


def remove_unreadable(folder: Location) -> None:
    """Remove the Parquet files in `folder` that a failed write left cut short (no footer: a full disk, a kill):
    none stays among a stage's outputs, and a resumed pass writes their rows again (their checkpoint was never
    committed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in folder.list_files(".parquet"):
        try:
            pq.ParquetFile(f.path, filesystem=f.fs)
        except (pa.ArrowInvalid, OSError):
            f.delete()


# What Ray Data's CheckpointFilter (the actor that drops the committed rows from a resumed pass's read) asks
# for: 1 CPU, Ray Data's default for a map actor, which its CheckpointConfig does not let one change (Ray 2.60).
CHECKPOINT_FILTER_CPUS = 1.0


def resume_places(pass_resources: Resources, nodes: list[dict[str, float]]) -> bool:
    """Whether a resumed pass can make progress on `nodes` (each node's resources as Ray reports them): its model
    actors (as many as fit: Ray Data runs on those that start) and the CheckpointFilter actor, placed in either
    order (Ray starts them together), leave room for one read or write task; for a pass of plain tasks, the
    filter and one of its tasks. False only where no order leaves room: then the pass waits forever."""
    r = pass_resources

    def places(filter_first: bool) -> bool:
        free = [node.get("CPU", 0.0) for node in nodes]

        def take(cpus: float) -> bool:  # first fit, as a node's CPUs are counted
            for i, left in enumerate(free):
                if left + 1e-9 >= cpus:
                    free[i] = left - cpus
                    return True
            return False

        if not r.actors:
            return take(CHECKPOINT_FILTER_CPUS) and take(r.num_cpus)
        filtered = filter_first and take(CHECKPOINT_FILTER_CPUS)
        placed = [take(r.num_cpus) for _ in range(r.concurrency)]
        return any(placed) and (filtered or take(CHECKPOINT_FILTER_CPUS)) and take(LIGHT_CPUS)

    return places(True) or places(False)


def resume_fit(pass_resources: Resources, nodes: list[dict[str, float]]) -> Resources | None:
    """The placement a resumed pass runs with on `nodes`: its own where it places beside the CheckpointFilter
    actor (`resume_places`), else the widest that does, its actors' CPUs lowered in quarters of a CPU before
    their number; None where none does. Placement never changes what a pass writes, so a resume may change it."""
    r = pass_resources
    for concurrency in range(r.concurrency, 0, -1):
        for quarters in range(math.ceil(4 * r.num_cpus), 0, -1):
            cpus = r.num_cpus if quarters == math.ceil(4 * r.num_cpus) else quarters / 4
            fitted = dataclasses.replace(r, num_cpus=cpus, concurrency=concurrency)
            if resume_places(fitted, nodes):
                return fitted
    return None


def resume_refusal(pass_resources: Resources, label: str, nodes: list[dict[str, float]]) -> str | None:
    """Why a resumed pass cannot make progress on a cluster whose nodes hold `nodes` at any placement
    (`resume_fit`), or None where it can."""
    if resume_fit(pass_resources, nodes) is not None:
        return None
    r = pass_resources
    held = (f"{r.concurrency} actor(s) x {r.num_cpus:g} CPU" if r.actors else f"tasks of {r.num_cpus:g} CPU")
    cpus = " + ".join(f"{node.get('CPU', 0.0):g}" for node in nodes)
    return (f"[{label}] resuming from the checkpoint runs Ray Data's CheckpointFilter actor "
            f"({CHECKPOINT_FILTER_CPUS:g} CPU) and a read / write task beside the pass's {held}, and the "
            f"cluster's CPUs ({cpus}) have no room for them even with a quarter CPU an actor: the pass would wait "
            "forever. Fix: run it on more CPUs")


def fit_resume(pass_resources: Resources, key: str | None, label: str) -> Resources:
    """The placement a resumed pass runs with on the connected cluster (`resume_fit`), said in one line where it
    differs from the configured one (`key`: the config section that sizes the pass); refused where none fits."""
    refuse_unplaceable(lambda nodes: resume_refusal(pass_resources, label, nodes))
    if autoscaling():
        return pass_resources
    fitted = resume_fit(pass_resources, cluster_nodes()[0]) or pass_resources
    if fitted != pass_resources:
        section = f"{key}." if key else ""
        changes = [f"{section}{name} {getattr(pass_resources, name):g} -> {getattr(fitted, name):g}"
                   for name in ("num_cpus", "concurrency") if getattr(fitted, name) != getattr(pass_resources, name)]
        print(f"[{label}] resuming runs Ray Data's CheckpointFilter actor ({CHECKPOINT_FILTER_CPUS:g} CPU) beside the "
              f"pass: {', '.join(changes)} for this run, so both fit the cluster's CPUs (placement only: what the "
              "pass writes does not change)", flush=True)
    return fitted


def resumable_write(build: Callable[[Resources], ray.data.Dataset], out: Location, id_column: str, prefix: str,
                    block_bytes: int, label: str, total: int, pass_resources: Resources,
                    resources_key: str | None) -> dict[str, Any]:
    """Write the dataset `build()` makes (its rows carry the int64 `id_column` from the read to the write) as
    Parquet files in `out`, under Ray Data's row-level checkpoint in the active stage's checkpoint folder: a
    rerun after a kill reads only the rows not written yet and adds its files beside the earlier ones (each
    write task's file name holds its write's UUID and task index, so a retried task overwrites its own file).
    `block_bytes`: the size Ray coalesces a map's output to, so each block, the unit that is written and
    checkpointed, holds a bounded number of rows and progress is committed as it goes. Returns the rows the
    files hold, and how many were resumed from an earlier attempt and computed now. `pass_resources`: what the
    pass's model stage asks for (`resources_key`: its config section); a resume runs where the run ran: its
    actors are narrowed where the cluster cannot hold them beside Ray Data's CheckpointFilter actor
    (`fit_resume`), and `build(resources)` builds the pass with the placement it runs with."""
    import ray.data
    from ray.data.checkpoint import CheckpointConfig

    checkpoint = active()
    if checkpoint is None:
        raise RuntimeError("resumable_write runs inside a stage (RunFolder.run_stage)")
    ckpt = checkpoint.rows
    resuming = ckpt.exists() and out.exists()
    # sized before anything waits (as configured where WBRAG_AUTOSCALING=1 says CPUs come on demand)
    r = fit_resume(pass_resources, resources_key, label) if resuming else pass_resources
    if not resuming:  # nothing to resume: leftovers of an older attempt would be duplicates
        out.delete()
        ckpt.delete()
    before = rows_by_file(out)
    checkpoint.begin_pass(label, total)
    checkpoint.record()
    if resuming:
        print(f"[{label}] resumed {sum(before.values()):,} of {total:,} rows from the checkpoint in {ckpt.uri}",
              flush=True)
    ctx = ray.data.DataContext.get_current()
    saved_block_size = ctx.target_max_block_size
    ctx.target_max_block_size = max(64 << 10, block_bytes)
    ctx.checkpoint_config = CheckpointConfig(id_column=id_column, checkpoint_path=ckpt.path,
                                             override_filesystem=ckpt.fs, delete_checkpoint_on_success=True)
    try:  # a pool whose actors others' work keeps from starting ends within ray.pending_timeout_s, naming it
        with pool_start_wait(f"the {label} pass", r.concurrency, {"CPU": r.num_cpus, "GPU": r.num_gpus},
                             f"lower {resources_key}.concurrency" if resources_key else "lower its concurrency"):
            with refused_writes(out):  # a full disk: one line naming the folder
                build(r).write_parquet(out.path, filesystem=out.fs, filename_provider=stable_names(prefix),
                                       ray_remote_args={"num_cpus": LIGHT_CPUS})
    except StorageError:
        remove_unreadable(out)
        raise
    finally:
        ctx.checkpoint_config = None
        ctx.target_max_block_size = saved_block_size
    written = rows_by_file(out)
    computed = sum(n for name, n in written.items() if name not in before)
    checkpoint.count(sum(written.values()) - computed, computed)
    return {"rows": sum(written.values()), "rows_resumed": sum(written.values()) - computed,
            "rows_computed": computed, "resumed": resuming}
