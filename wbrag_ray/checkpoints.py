"""Row-level checkpoints: a stage killed part way resumes when the same command runs again and writes what an
uninterrupted run writes. One folder per stage (`RUN/_checkpoints/<stage>/`) holds Ray Data row checkpoints,
generator answers, Ray Train checkpoints and task records; one of another fingerprint is removed."""

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

import pyarrow as pa

from wbrag_ray.layout import subdirs
from wbrag_ray.lease import fence, task_fence
from wbrag_ray.placement import autoscaling, cluster_nodes, refuse_unplaceable
from wbrag_ray.placement.waits import pool_start_wait
from wbrag_ray.ray_runtime import LIGHT_CPUS, stable_names
from wbrag_ray.stages.base import Resources, concurrency_fix
from wbrag_ray.storage import Location, StorageError, refused_writes

if TYPE_CHECKING:
    import ray.data

BLOCK_ROWS, BLOCK_SECONDS = 1024, 60.0  # a block of answers is committed at either (`generator.checkpoint_rows`)


def _plain(value: Any) -> Any:
    """numpy values (answers that came back through Arrow) as JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot checkpoint a {type(value).__name__}")


class AnswerStore:
    """A stage's committed answers (16-byte memo keys -> outputs), loaded whole on restart and added to in blocks."""

    def __init__(self, folder: Location, block_rows: int = BLOCK_ROWS, block_seconds: float = BLOCK_SECONDS,
                 before_commit: Callable[[], None] | None = None):
        self.folder = folder
        self.before_commit = before_commit
        self.block_rows = block_rows
        self.block_seconds = block_seconds
        self.answers: dict[bytes, tuple] = {}
        for f in folder.list_files(".parquet"):  # temporary names end in .tmp: never read
            table = f.read_table()
            for key, value in zip(table["key"].to_pylist(), table["value"].to_pylist(), strict=True):
                self.answers[key] = tuple(json.loads(value))
        self.loaded = len(self.answers)
        self._pending: list[tuple[bytes, str]] = []
        self._last = time.monotonic()

    def add(self, items: Iterable[tuple[bytes, tuple]]) -> None:
        """Answers just decoded; committed once a block is full or old enough."""
        self._pending.extend((key, json.dumps(list(value), default=_plain)) for key, value in items)
        if len(self._pending) >= self.block_rows or time.monotonic() - self._last >= self.block_seconds:
            self.flush()

    def flush(self) -> None:
        """Commit what is pending as one block file."""
        self._last = time.monotonic()
        if not self._pending:
            return
        if self.before_commit is not None:
            self.before_commit()
        keys, values = zip(*self._pending, strict=True)
        self.folder.join(f"block-{uuid.uuid4().hex}.parquet").write_table(
            pa.table({"key": pa.array(keys, pa.binary()), "value": pa.array(values, pa.string())}))
        self._pending = []


@dataclasses.dataclass(frozen=True)
class TaskRecords:
    """Results of tasks that each write whole files, recorded after the files; a rerun runs the others."""

    folder: Location

    def done(self) -> dict[str, Any]:
        """Results recorded by earlier attempts, by task name."""
        return {f.name[: -len(".json")]: f.read_json() for f in self.folder.list_files(".json")}

    def uri(self, name: str) -> str:
        """Where the task `name` records its result."""
        return self.folder.join(f"{name}.json").uri


class StageCheckpoint:
    """The checkpoint folder of one running stage; its fingerprint is recorded with the first commit."""

    def __init__(self, folder: Location, fingerprint: dict[str, Any] | None = None):
        self.folder = folder
        self.fingerprint = fingerprint
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
        """The stage's answer store, opened on first use."""
        if self._answers is None:
            self._answers = AnswerStore(self.folder.join("answers"), before_commit=self.record)
        if block_rows:
            self._answers.block_rows = block_rows
        if block_seconds:
            self._answers.block_seconds = block_seconds
        return self._answers

    def record(self) -> None:
        """Before any commit: check the lease (`lease.fence`), record the fingerprint (once) and the running pass."""
        fence(self.folder)
        record = self.folder.join("fingerprint.json")
        if self.fingerprint is not None and not record.exists():
            record.write_json(self.fingerprint)
        if self._pass is not None:
            self.folder.join("pass.json").write_json(self._pass)
            self._pass = None

    def begin_pass(self, name: str, total: int) -> None:
        """Record the running pass and its rows for `wbrag status`."""
        self._pass = {"pass": name, "rows": total}

    def count(self, resumed: int, computed: int) -> None:
        self.rows_resumed += resumed
        self.rows_computed += computed

    def stats(self) -> dict[str, int]:
        """`rows_resumed` / `rows_computed` for the stage's stats, when a pass counted any."""
        counted = {"rows_resumed": self.rows_resumed, "rows_computed": self.rows_computed}
        return counted if any(counted.values()) else {}


_ACTIVE: contextvars.ContextVar[StageCheckpoint | None] = contextvars.ContextVar("stage_checkpoint", default=None)


def active() -> StageCheckpoint | None:
    """The checkpoint of the stage running in this process (None outside a stage)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def stage_checkpoint(folder: Location, fingerprint: dict[str, Any] | None, label: str) -> Iterator[StageCheckpoint]:
    """Open `folder` as the running stage's checkpoint, removing one made under another fingerprint."""
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
    """The pass an incomplete stage was in, its rows, the rows committed, and a stopped training's step."""
    info = folder.join("pass.json")
    out: dict[str, Any] = info.read_json() if info.exists() else {}
    committed = sum(n for part in ("answers", "rows") for name, n in rows_by_file(folder.join(part)).items()
                    if not name.endswith(".pending.parquet"))  # Ray Data's mark of a write not yet committed
    tasks = folder.join("tasks")  # whole-file tasks record the rows they read (an index build's add tasks)
    for name in subdirs(tasks):
        committed += sum(int(r.get("rows", 0)) for r in TaskRecords(tasks.join(name)).done().values())
    out["committed"] = committed
    train = folder.join("train")  # the step of a stopped training's last Ray Train checkpoint
    for label in subdirs(train):
        snapshot = train.join(label, "checkpoint_manager_snapshot.json")
        if snapshot.exists():
            latest = snapshot.read_json().get("latest_checkpoint_result") or {}
            out["trained_steps"] = int(latest.get("metrics", {}).get("step", 0))
            break
    return out


def rows_by_file(folder: Location, remove_unreadable: bool = False) -> dict[str, int]:
    """Rows of each Parquet file in `folder`, from its footer; a file a kill cut short is left out, or removed
    (`remove_unreadable`: a resumed pass writes its rows again)."""
    out = {}
    for f in folder.list_files(".parquet"):
        try:
            out[f.name] = f.num_rows()
        except (pa.ArrowInvalid, OSError):
            if remove_unreadable:
                f.delete()
    return out


CHECKPOINT_FILTER_CPUS = 1.0  # Ray Data's CheckpointFilter actor's, which CheckpointConfig does not let one change


def resume_places(pass_resources: Resources, nodes: list[dict[str, float]]) -> bool:
    """Whether a resumed pass's actors and the CheckpointFilter actor leave room for one read or write task on
    `nodes`, in either start order (else the pass would wait forever)."""
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
    """The placement a resumed pass runs with on `nodes`: its own if it fits beside the CheckpointFilter, else
    its actors' CPUs lowered in quarters, then their number; None where nothing fits."""
    r = pass_resources
    for concurrency in range(r.concurrency, 0, -1):
        for quarters in range(math.ceil(4 * r.num_cpus), 0, -1):
            cpus = r.num_cpus if quarters == math.ceil(4 * r.num_cpus) else quarters / 4
            fitted = dataclasses.replace(r, num_cpus=cpus, concurrency=concurrency)
            if resume_places(fitted, nodes):
                return fitted
    return None


def resume_refusal(pass_resources: Resources, label: str, nodes: list[dict[str, float]]) -> str | None:
    """Why a resumed pass cannot progress on `nodes` at any placement, or None."""
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
    """The resumed pass's placement on the connected cluster, said where it differs; refused where none fits."""
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
    """Write the dataset `build(resources)` as Parquet files in `out` under Ray Data's row-level checkpoint on
    `id_column` (a rerun reads only rows not written yet), blocks of at most `block_bytes`; rows written, resumed
    and computed."""
    import ray.data
    from ray.data.checkpoint import CheckpointConfig

    checkpoint = active()
    if checkpoint is None:
        raise RuntimeError("resumable_write runs inside a stage (RunFolder.execute)")
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
        with pool_start_wait(f"the {label} pass", r.concurrency, r.need, concurrency_fix(resources_key)):
            with refused_writes(out):  # a full disk: one line naming the folder
                build(r).write_parquet(out.path, filesystem=out.fs, filename_provider=stable_names(prefix, task_fence(out)),
                                       ray_remote_args={"num_cpus": LIGHT_CPUS})
    except StorageError:
        rows_by_file(out, remove_unreadable=True)
        raise
    finally:
        ctx.checkpoint_config = None
        ctx.target_max_block_size = saved_block_size
    written = rows_by_file(out)
    computed = sum(n for name, n in written.items() if name not in before)
    checkpoint.count(sum(written.values()) - computed, computed)
    return {"rows": sum(written.values()), "rows_resumed": sum(written.values()) - computed,
            "rows_computed": computed, "resumed": resuming}
