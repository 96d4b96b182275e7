"""The stage abstraction: one class per unit of work, run as a Ray Data actor pool (`apply_stage`) or on a
command's services (`stages.service`). A stage declares its name, resources, the columns it reads and adds, a
`setup` run once per worker (load the model there, not in `__init__`: the stage is pickled to every actor), and
one batch method."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import pandas as pd

from wbrag_ray.models.hardware import FreeCpus, in_ray_worker, require_gpu, set_threads
from wbrag_ray.placement import autoscaling, cluster_nodes, pool_refusal, refuse_unplaceable, room_for
from wbrag_ray.placement.waits import pool_start_timeout_s

if TYPE_CHECKING:
    import ray.data

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resources:
    """What one worker of a stage asks Ray for, and how the pool is sized. Model actors ask for part of a node's
    CPUs (a whole small node starves the read tasks upstream) and may run more torch threads (`threads`)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    concurrency: int = 1
    batch_size: int = 64
    threads: int | None = None  # torch threads; None = ceil(num_cpus)
    calls: int = 1  # calls a service actor runs at once, in threads (> 1: a vLLM engine's feed)
    actors: bool = True  # False: plain tasks fused with the read before them (a trivial setup over vectors)
    # (name, value) pairs of the workers' own runtime env (vLLM's log level): it costs each a second interpreter
    env: tuple[tuple[str, str], ...] = ()

    @property
    def need(self) -> dict[str, float]:
        """What one worker asks Ray for, as the placement checks take it."""
        return {"CPU": self.num_cpus, "GPU": self.num_gpus}

    def remote_args(self) -> dict:
        """Ray options of one worker beyond CPUs and GPUs: its runtime env, where `env` is set."""
        return {"runtime_env": {"env_vars": dict(self.env)}} if self.env else {}


class Stage(ABC):
    name: ClassVar[str]
    section: ClassVar[str | None] = None  # the config section that sizes its pool, as messages name it
    gpu_setting: ClassVar[str | None] = None  # the setting of its GPUs, where not `<section>.num_gpus`
    beside_generator: ClassVar[bool] = False  # a retrieval actor beside the generator (`placement.gpus`)
    input_columns: ClassVar[tuple[str, ...]] = ()
    output_columns: ClassVar[tuple[str, ...]] = ()
    # "pandas" for text work; "pyarrow" where a batch is mostly vectors (no per-row Python objects).
    batch_format: ClassVar[str] = "pandas"

    @property
    def resources(self) -> Resources:
        return Resources()

    def setup(self) -> None:  # noqa: B027 - optional hook
        """Once per worker: load models, open indices."""

    @property
    def starts_processes(self) -> bool:
        """Whether `setup` may start processes (a vLLM engine's), which `close` ends before Ray kills the actor."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """End what `setup` started that outlives this object (an engine's processes), before its worker ends."""

    def service_key(self) -> Hashable | None:
        """What `setup` loads: passes whose stages have equal keys share set-up workers (`stages.service`); None:
        the stage runs only as a pass of its own."""
        return None

    def adopt(self, loaded: Stage) -> None:
        """Take what `loaded` (a set-up stage with the same `service_key`) holds instead of running `setup`."""
        raise NotImplementedError(f"stage {self.name} declares a service key but cannot adopt a loaded stage")

    @abstractmethod
    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        """Return the batch with `output_columns` added (a DataFrame, or a pyarrow Table for typed columns
        such as fixed-size vectors); rows may be dropped only by filter stages."""


class StageError(RuntimeError):
    pass


class _StageWorker:
    """The Ray actor around a stage: threads, setup once, column checks on every batch."""

    def __init__(self, stage: Stage):
        require_stage_gpu(stage)
        set_threads(stage.resources.threads or stage.resources.num_cpus)
        self.stage, self.cpus = stage, free_cpus(stage)
        stage.setup()

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        if self.cpus is not None:
            self.cpus.apply()
        return process_checked(self.stage, batch)


def free_cpus(stage: Stage) -> FreeCpus | None:
    """The torch threads a stage's batches run with (`FreeCpus`); None where its engine runs in processes of its own
    (a vLLM engine's threads are bound as it starts) or on a GPU."""
    res = stage.resources
    return None if stage.starts_processes or res.num_gpus else FreeCpus(res.num_cpus, res.threads)


def require_stage_gpu(stage: Stage) -> None:
    """In a Ray worker, before setup: a stage configured for GPUs on a node whose torch sees none is refused, naming
    its setting (a driver running a stage itself, `run_local`, falls back to CPU)."""
    if stage.resources.num_gpus > 0 and in_ray_worker():
        require_gpu(f"the {stage.name} stage", stage.section or stage.name, stage.resources.num_gpus,
                    stage.gpu_setting)


def process_checked(stage: Stage, batch):
    """`stage.process_batch(batch)`, with the stage's declared input and output columns checked."""
    have = list(batch.column_names if hasattr(batch, "column_names") else batch.columns)
    missing = [c for c in stage.input_columns if c not in have]
    if missing:
        raise StageError(f"stage {stage.name}: input is missing columns {missing}; it has {have}")
    out = stage.process_batch(batch)
    columns = out.column_names if hasattr(out, "column_names") else out.columns
    absent = [c for c in stage.output_columns if c not in columns]
    if absent:
        raise StageError(f"stage {stage.name} did not produce columns {absent}")
    return out


def apply_stage(ds: ray.data.Dataset, stage: Stage) -> ray.data.Dataset:
    """Append `stage` to a Ray Data pipeline: an actor pool, or plain tasks when `resources.actors` is False."""
    import ray
    from ray.data import ActorPoolStrategy

    res = stage.resources
    common = {"batch_format": stage.batch_format, "batch_size": res.batch_size, "num_cpus": res.num_cpus,
              "num_gpus": res.num_gpus or None, **res.remote_args()}
    if not res.actors:
        return ds.map_batches(_run_in_task, fn_args=(stage,), **common)
    size = _check_pool(stage) if ray.is_initialized() else res.concurrency
    out = ds.map_batches(_StageWorker, fn_constructor_args=(stage,), compute=ActorPoolStrategy(size=size), **common)
    # bounds Ray Data's otherwise endless wait for actors others keep out (`placement.waits.pool_start_wait` names it)
    out.context.wait_for_min_actors_s = pool_start_timeout_s()
    return out


def _check_pool(stage: Stage) -> int:
    """A pass's pool size: refused where no actor fits the cluster, else as many as fit (Ray Data waits for all)."""
    res = stage.resources
    what = f"the {stage.name} pass"
    refuse_unplaceable(lambda nodes: pool_refusal(what, 1, res.need, nodes))
    if autoscaling():
        return res.concurrency
    nodes = cluster_nodes()[0]
    partly = pool_refusal(what, res.concurrency, res.need, nodes)
    if partly is None:
        return res.concurrency
    log.warning("%s; it runs on the actors that fit", partly)
    return max(1, min(res.concurrency, room_for(res.need, nodes)))


def concurrency_fix(section: str | None) -> str:
    """What a refused or waiting pool of config section `section` changes."""
    return f"lower {section}.concurrency" if section else "lower its concurrency"


def _run_in_task(batch, stage: Stage):
    return run_local(stage, batch)


def run_local(stage: Stage, batch: pd.DataFrame) -> pd.DataFrame:
    """Run a stage in this process on one batch (tests, small jobs, benchmarks of the direct path)."""
    return _StageWorker(stage)(batch)
