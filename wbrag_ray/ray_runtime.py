"""Starting or joining Ray, once per process, with messages that say what to do when it fails (and the
environment of the workers that import vLLM); and the generic Ray helpers every pipeline shares. Over 400 lines:
what every command does with Ray, each piece short, none a module's worth alone."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import resource
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from wbrag_ray import progress, storage
from wbrag_ray.config import ConfigError, RayConfig
from wbrag_ray.placement import PENDING_TIMEOUT_S

if TYPE_CHECKING:
    import ray.data

    from wbrag_ray.storage import Location

log = logging.getLogger(__name__)

# CPUs that reads, writes and other light tasks ask for: small, so model actors never starve the tasks feeding them
LIGHT_CPUS = 0.25


def local_dataset(frame):
    """A Ray Dataset over a table the driver holds, as one block (`ray.data.from_pandas` runs a task asking for a
    whole CPU, which never starts on a small node whose CPUs stage services hold)."""
    import ray.data

    if hasattr(frame, "reset_index"):
        frame = frame.reset_index(drop=True)
    return ray.data.from_blocks([frame])


def is_object_ref(value) -> bool:
    import ray

    return isinstance(value, ray.ObjectRef)


def shared_value(ref_or_value):
    """`fn_args` as Ray Data hands them over: an ObjectRef (one shared copy of a large array) fetched here."""
    import ray

    return ray.get(ref_or_value) if is_object_ref(ref_or_value) else ref_or_value


def in_sorted(values, sorted_ids):
    """Whether each of `values` is in `sorted_ids` (sorted ascending), by binary search (np.isin sorts copies)."""
    import numpy as np

    values = np.asarray(values)
    if len(sorted_ids) == 0:
        return np.zeros(len(values), bool)
    at = np.minimum(np.searchsorted(sorted_ids, values), len(sorted_ids) - 1)
    return np.asarray(sorted_ids)[at] == values


def select_rows(loc, id_column: str, ids, columns: list[str]):
    """Rows of a (large) Parquet folder whose id is in `ids`, by a distributed scan: only matches reach the driver."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import ray
    import ray.data

    wanted = ray.put(np.unique(np.asarray(ids, np.int64)))

    def keep(batch: pa.Table, wanted) -> pa.Table:
        mask = in_sorted(batch[id_column].to_numpy(), shared_value(wanted))
        return batch.filter(pa.array(mask))

    ds = read_parquet(loc, columns=columns)
    ds = ds.map_batches(keep, fn_args=(wanted,), batch_format="pyarrow", num_cpus=LIGHT_CPUS)
    tables = [t for t in ray.get(ds.to_arrow_refs()) if t.num_rows]
    return pa.concat_tables(tables).to_pandas() if tables else pd.DataFrame(columns=columns)


def read_parquet(loc: Location, num_cpus: float = LIGHT_CPUS, **kwargs) -> ray.data.Dataset:
    """`ray.data.read_parquet` of a run folder's Parquet folder, its read tasks holding `num_cpus`. The files it
    samples as it is made print no bar of their own (a tqdm bar, line after line in a log): a pass's progress is
    its one line (`progress`)."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    bars, ctx.enable_progress_bars = ctx.enable_progress_bars, False
    try:
        return ray.data.read_parquet(loc.path, filesystem=loc.fs, num_cpus=num_cpus, **kwargs)
    finally:
        ctx.enable_progress_bars = bars


def run_tasks(fn, shared, items, *, num_cpus: float = 1.0, num_gpus: float = 0.0, memory: int | None = None,
              parallel: bool | None = None, own_errors: tuple[type[BaseException], ...] = (ValueError,)) -> list:
    """fn(shared, item) for every item, in order: Ray tasks when Ray is up (or `parallel`), `shared` put once in
    the object store; else a loop here. An error of `own_errors` comes back as itself. Failed tasks are retried
    twice (a lost node), so `fn` must be idempotent: it writes whole files named by its item."""
    import ray

    if parallel is None:
        parallel = ray.is_initialized()
    if not parallel:
        return [fn(shared, item) for item in items]
    remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus or None, memory=memory or None, max_retries=2)(fn)
    ref = ray.put(shared)
    refs = [remote.remote(ref, item) for item in items]
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, own_errors):
            raise exc.cause from None
        raise


CLOSE_S = 30.0  # how long an actor may take to end what it started before it is killed anyway


def end_child_processes(timeout_s: float = 1.0) -> list[int]:
    """End every process this one started that is still up (a vLLM engine's leftovers), SIGKILL after `timeout_s`;
    their pids. Ray kills only a worker's direct children when it exits, and none where the worker crashed."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(alive, timeout=timeout_s)
    return [child.pid for child in children]


def call_actor(actors: list, method: str, *args, attempts: int = 6):
    """`actors[i].<method>(*args)` on one of interchangeable actors, chosen at random; a call that meets a lost
    actor is sent again to the next one after a back-off (the methods are pure)."""
    import ray

    order = random.sample(actors, len(actors))
    for attempt in range(attempts):
        actor = order[attempt % len(order)]
        try:
            return ray.get(getattr(actor, method).remote(*args))
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            if attempt == attempts - 1:
                raise
            log.warning("actor call %s failed on a lost actor; retrying (%d/%d)", method, attempt + 1, attempts - 1)
            time.sleep(min(2.0 ** attempt, 15.0))  # Ray restarts the actor on another node meanwhile


def start_restartable(remote_cls, *args):
    """`remote_cls.remote(*args)` for an actor Ray restarts after a failure: its arguments must be inlined in the
    creation spec, since a restart cannot find store objects their owner released (ray-project/ray#53727)."""
    from ray import cloudpickle

    limit = int(os.environ.get("RAY_max_direct_call_object_size", 100 * 1024))  # Ray's setting, its default
    size = len(cloudpickle.dumps(args))
    if size > limit:
        raise ValueError(f"the arguments of a restartable {remote_cls} actor pickle to {size:,} bytes, more than "
                         f"Ray inlines ({limit:,}): pass large inputs by path, loaded in the actor")
    return remote_cls.remote(*args)


def call_actors(actors: list, method: str, calls: list[tuple], *, in_flight: int = 2,
                on_result: Callable[[int, Any], None] | None = None) -> list:
    """`actors[j].<method>(*calls[i])` for every i, at most `in_flight` unanswered calls per actor, each next to the
    least busy; results in the order of `calls`, `on_result(i, result)` as each arrives; lost actors as `call_actor`."""
    import ray

    results: list = [None] * len(calls)
    pending: dict = {}  # ObjectRef -> (call index, actor index)
    load = [0] * len(actors)  # unanswered calls per actor
    next_call = 0
    while next_call < len(calls) or pending:
        while next_call < len(calls):
            j = min(range(len(actors)), key=load.__getitem__)
            if load[j] >= in_flight:
                break
            pending[getattr(actors[j], method).remote(*calls[next_call])] = (next_call, j)
            load[j] += 1
            next_call += 1
        [ready], _ = ray.wait(list(pending), num_returns=1)
        i, j = pending.pop(ready)
        load[j] -= 1
        try:
            results[i] = ray.get(ready)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            results[i] = call_actor(actors, method, *calls[i])
        if on_result is not None:
            on_result(i, results[i])
    return results


def reset_peak_rss() -> float:
    """Start a task's own peak-memory count (Ray reuses worker processes); returns the resident MiB now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM, the peak resident set size
        return _proc_status_mb("VmRSS")
    except OSError:
        return 0.0


def _proc_status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise OSError(key)


def peak_rss_mb() -> float:
    """Peak resident MiB since the last `reset_peak_rss` (Linux), else since the process started."""
    try:
        return _proc_status_mb("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux and BSD units differ; KiB here


def stable_names(prefix: str, fence=None):
    """A Ray Data file-name provider, a pure function of (write, task) as Ray's checkpointing needs: a retried
    task overwrites its own file. `fence` (`lease.TaskFence`): checked in the write task just before it writes, so a
    pass's tasks commit nothing once another command took the run folder's lease."""
    from ray.data.datasource import FilenameProvider

    class StableNames(FilenameProvider):
        def __init__(self):
            super().__init__(file_format="parquet")

        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            if fence is not None:
                fence.check()
            return f"{prefix}-{write_uuid}-{task_index:06d}.parquet"

    return StableNames()


# vLLM logs about 150 INFO lines per engine start; only the workers that import it get this (`Resources.env`)
QUIET_VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}


def vllm_env(verbose: bool | None = None) -> dict[str, str]:
    """The environment of the workers that import vLLM: QUIET_VLLM_ENV unless `verbose` (default: -v), this
    process's values winning; none the job's own runtime env sets (it reaches every worker)."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR as JOB

    if verbose is None:
        verbose = logging.getLogger().isEnabledFor(logging.DEBUG)
    job_env = (json.loads(os.environ.get(JOB) or "{}").get("runtime_env") or {}).get("env_vars") or {}
    env = {k: os.environ.get(k, v) for k, v in QUIET_VLLM_ENV.items() if k in os.environ or not verbose}
    return {k: v for k, v in env.items() if k not in job_env}


def init_ray(config: RayConfig, run_dir: str | None = None, trains: bool = False) -> None:
    """Join `ray.address` (or RAY_ADDRESS), else start a local cluster (with its dashboard where the command
    `trains`: `_start_local`); check `run_dir` reaches every node."""
    PENDING_TIMEOUT_S["seconds"] = config.pending_timeout_s
    address = config.address or os.environ.get("RAY_ADDRESS")
    if address and not ("ray" in sys.modules and sys.modules["ray"].is_initialized()):
        _check_reachable(address)  # before the second it takes to import Ray: a wrong address fails at once
    import ray
    import ray.data

    if not ray.is_initialized():
        kwargs = {"ignore_reinit_error": True, "logging_level": logging.WARNING, "log_to_driver": True}
        # a driver that imports vllm obeys it too (and a local cluster's processes, which inherit this environment)
        os.environ.update(vllm_env())
        if address:
            try:
                ray.init(address=address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ConfigError(
                    f"cannot reach the Ray cluster at ray.address={address!r}: {str(exc).splitlines()[0]}. "
                    "Check the address (ray status on the head node prints it) or drop --address to run locally."
                ) from None
        else:
            # "local", not None: ray.init(None) would silently join the last cluster `ray start` made here.
            if not logging.getLogger().isEnabledFor(logging.DEBUG):  # -v: each worker's model-loading bars
                os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the local workers inherit it
            _start_local(config.num_cpus, kwargs, trains)
    configure_data_context()
    if run_dir is not None:
        check_run_dir(run_dir)


class _AuthDefaultNote(logging.Filter):
    """Ray 2.60 turns token auth on for every new local cluster and says so on each `ray.init`: the first line of
    every command, about a default. Dropped; the warning that a cluster runs without auth is not."""

    LOGGER = "ray._private.authentication.authentication_token_setup"

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def _start_local(num_cpus: int | None, kwargs: dict, dashboard: bool) -> None:
    """A local cluster; with a dashboard on a port of its own (RAY_API_SERVER_ADDRESS) only where Ray Train runs:
    its placement-group cleaner asks the dashboard's State API each second whether the controller lives, and
    warns each second without one. Elsewhere the dashboard's processes are about 1 GB of memory for nothing
    (benchmarks/RESULTS.md)."""
    import ray

    auth = logging.getLogger(_AuthDefaultNote.LOGGER)
    if not any(isinstance(f, _AuthDefaultNote) for f in auth.filters):
        auth.addFilter(_AuthDefaultNote())
    if not dashboard:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
        return
    with socket.socket() as probe:  # a free port (another cluster's dashboard may hold Ray's 8265)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with environ_while({"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}):  # dashboard: where Ray can start one
        ray.init(address="local", num_cpus=num_cpus, dashboard_host="127.0.0.1", dashboard_port=port, **kwargs)


@contextlib.contextmanager
def environ_while(values: dict[str, str]):
    """`values` in this process's environment while the block runs, the previous values (or none) back after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# 1: a local path is on storage every node sees at that path, which /proc/mounts does not show (a bind mount)
SHARED_RUN_DIR_ENV = "WBRAG_SHARED_RUN_DIR"
_warned_run_dirs: set[str] = set()  # one warning per path and process


def _spread() -> str | None:
    """How this driver's tasks may run on other machines ('with 3 nodes', 'through Ray Client'); None if not."""
    import ray

    client = ray.util.client.ray.is_connected()
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    if nodes <= 1 and not client:
        return None
    return "through Ray Client" if client else f"with {nodes} nodes"


def _check_shared(path: str, what: str, where: str, fix: str) -> None:
    """Refuse a local `path` other machines cannot see, unless on a shared filesystem or WBRAG_SHARED_RUN_DIR=1
    says so (then a warning, once per path)."""
    if os.environ.get(SHARED_RUN_DIR_ENV, "").strip().lower() in ("1", "true", "yes"):
        reason = f"{SHARED_RUN_DIR_ENV}=1 says every node sees it at that path"
    else:
        mount = storage.mount_of(path)
        if mount is None or not storage.is_shared_filesystem(mount[1]):
            raise ConfigError(
                f"{what} {path} is a local path, but Ray runs this command's tasks on a cluster {where}: workers on "
                f"other machines cannot read this machine's disk. {fix}; if {path} is already on a filesystem every "
                f"node mounts at the same path, set {SHARED_RUN_DIR_ENV}=1."
            )
        reason = f"it is on a {mount[1]} mount ({mount[0]}), which every node must mount at the same path"
    if path not in _warned_run_dirs:
        _warned_run_dirs.add(path)
        log.warning("%s %s is a local path on a Ray cluster %s: allowed, as %s", what, path, where, reason)


def check_run_dir(run_dir: str) -> None:
    """Refuse a local run folder when Ray runs tasks on other machines: their workers would write to their own
    disks (`_check_shared`)."""
    if "://" in run_dir and not run_dir.startswith("file://"):
        return  # object storage: every node reaches it
    where = _spread()
    if where is not None:
        _check_shared(storage.resolve(run_dir).path, "run folder", where,
                      "Put the run folder on object storage (s3://bucket/prefix) or on a filesystem every node mounts "
                      "at the same path (NFS, Lustre, a FUSE mount)")


def check_model_paths(config) -> None:
    """On several machines, refuse up front a model or adapter at a local path other nodes cannot read."""
    where = _spread()
    if where is None:
        return
    found = {"generator.model": config.generator.model, "generator.lora_adapter": config.generator.lora_adapter,
             "embedder.model": config.embedder.model, "zerorag.lm_pruner.backbone": config.zerorag.lm_pruner.backbone}
    if config.zerorag.qa_generator is not None:
        found["zerorag.qa_generator.model"] = config.zerorag.qa_generator.model
        found["zerorag.qa_generator.lora_adapter"] = config.zerorag.qa_generator.lora_adapter
    for key, value in found.items():
        if value and "://" not in value and not value.startswith("bundled:") and os.path.exists(os.path.expanduser(value)):
            _check_shared(os.path.abspath(os.path.expanduser(value)), key, where,
                          "Put the model on object storage (s3://...: each node fetches it once) or on a shared mount")


def configure_data_context() -> None:
    """Ray Data settings every wbrag pipeline runs with, whoever started Ray."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = True
    progress.configure(verbose=logging.getLogger().isEnabledFor(logging.DEBUG))
    ctx.print_on_execution_start = False
    # Ray 2.60's V2 Parquet read adds a ListFiles task of a whole CPU, which can wait forever beside a model actor
    ctx.use_datasource_v2 = False


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not minutes: ray.init keeps retrying an address where nothing listens."""
    if address == "auto" or address.startswith("local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address={address!r} is not host:port, ray://host:port or 'auto'")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            dashboard = not address.startswith("ray://") and _is_ray_dashboard(conn, host)
    except OSError as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at ray.address={address!r} ({exc.strerror or exc}). "
            "Check the address (`ray status` on the head node prints it) or drop --address to run locally."
        ) from None
    if dashboard:
        raise ConfigError(
            f"ray.address={address!r} is the Ray dashboard's port (HTTP), not the cluster's: commands join the cluster "
            f"at {host}:6379 (the GCS port `ray start --head` prints) or ray://{host}:10001 (Ray Client); the "
            "dashboard's address is for `wbrag submit / status / logs / stop`.")


def _is_ray_dashboard(conn, host: str, timeout_s: float = 2.0) -> bool:
    """Whether the server on `conn` answers HTTP as Ray's dashboard does (ray.init would retry it for minutes)."""
    conn.settimeout(timeout_s)
    try:
        conn.sendall(f"GET /api/version HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        reply = b""
        while len(reply) < 65536:
            chunk = conn.recv(4096)
            if not chunk:
                break
            reply += chunk
    except OSError:  # no answer in time: not an HTTP server
        return False
    return reply.startswith(b"HTTP/") and b"ray_version" in reply
