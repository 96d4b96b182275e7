"""Starting or joining Ray, once per process, with messages that say what to do when it fails; and the generic
Ray Data helpers every pipeline shares (a driver frame as a dataset, a distributed row selection, stable
output file names)."""

from __future__ import annotations

import logging
import os

from wbrag_ray.config import ConfigError, RayConfig

log = logging.getLogger(__name__)

# CPUs that reads, writes and other light tasks ask for: small, so model actors (which ask for most of a
# node) never starve the tasks that feed them.
LIGHT_CPUS = 0.25


def local_dataset(frame):
    """A Ray Dataset over a table the driver already holds (a pandas DataFrame or a pyarrow Table), as one
    block. `ray.data.from_pandas` / `from_arrow` compute block metadata in a remote task that asks for a whole
    CPU; on a small node whose other CPUs are held by stage services (a loaded generator, an open index) that
    task never starts and the pass hangs. The metadata of a block in hand is computed here instead."""
    import ray.data

    if hasattr(frame, "reset_index"):
        frame = frame.reset_index(drop=True)
    return ray.data.from_blocks([frame])


def shared_value(ref_or_value):
    """Ray Data hands `fn_args` to the function as given: an ObjectRef (one shared copy of a large id array in
    the object store, instead of one per task) has to be fetched by the function itself."""
    import ray

    return ray.get(ref_or_value) if isinstance(ref_or_value, ray.ObjectRef) else ref_or_value


def select_rows(loc, id_column: str, ids, columns: list[str]):
    """Rows of a (large) Parquet folder whose id is in `ids`, as a DataFrame, by a distributed scan: only the
    matches reach the driver."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import ray
    import ray.data

    wanted = ray.put(np.unique(np.asarray(ids, np.int64)))

    def keep(batch: pa.Table, wanted) -> pa.Table:
        mask = np.isin(batch[id_column].to_numpy(), shared_value(wanted))
        return batch.filter(pa.array(mask))

    ds = ray.data.read_parquet(loc.path, filesystem=loc.fs, columns=columns, num_cpus=LIGHT_CPUS)
    ds = ds.map_batches(keep, fn_args=(wanted,), batch_format="pyarrow", num_cpus=LIGHT_CPUS)
    tables = [t for t in ray.get(ds.to_arrow_refs()) if t.num_rows]
    return pa.concat_tables(tables).to_pandas() if tables else pd.DataFrame(columns=columns)


def stable_names(prefix: str):
    """A Ray Data file-name provider: `<prefix>-<write uuid>-<task index>.parquet`, a pure function of (write,
    task), as Ray 2.60's checkpointing needs to predict a file's name before it is written (and to delete it
    if the write died before its checkpoint was committed); a retried task overwrites its own file."""
    from ray.data.datasource import FilenameProvider

    class StableNames(FilenameProvider):
        def __init__(self):
            super().__init__(file_format="parquet")

        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"{prefix}-{write_uuid}-{task_index:06d}.parquet"

    return StableNames()


def init_ray(config: RayConfig) -> None:
    """Join `ray.address` (or RAY_ADDRESS) when given; otherwise start a local cluster."""
    import ray
    import ray.data

    if ray.is_initialized():
        configure_data_context()
        return
    address = config.address or os.environ.get("RAY_ADDRESS")
    kwargs = {"ignore_reinit_error": True, "logging_level": logging.WARNING, "log_to_driver": True}
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(
                f"cannot reach the Ray cluster at ray.address={address!r}: {str(exc).splitlines()[0]}. "
                "Check the address (ray status on the head node prints it) or drop --address to run locally."
            ) from None
    else:
        # "local", not None: ray.init(None) would silently join the last cluster `ray start` made here.
        ray.init(address="local", num_cpus=config.num_cpus, include_dashboard=False, **kwargs)
    configure_data_context()


def configure_data_context() -> None:
    """Ray Data settings every wbrag pipeline runs with, whoever started Ray."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = True
    ctx.print_on_execution_start = False
    # Ray 2.60's V2 Parquet read adds a ListFiles task that always asks for a whole CPU; beside a model actor
    # (and the CheckpointFilter actor of a resumed run) it can wait forever on a small node. The V1 read plans
    # its files on the driver, and its read tasks take the LIGHT_CPUS the pipelines give them.
    ctx.use_datasource_v2 = False


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not minutes: ray.init keeps retrying an address where nothing listens."""
    import socket

    if address == "auto" or address.startswith("local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address={address!r} is not host:port, ray://host:port or 'auto'")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at ray.address={address!r} ({exc.strerror or exc}). "
            "Check the address (`ray status` on the head node prints it) or drop --address to run locally."
        ) from None
