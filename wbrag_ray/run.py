"""The run folder: every stage's outputs, the resolved config, per-stage stats and completion markers.

Layout (local or s3://):
    RUN/run.json                    resolved config (no credentials) and the wbrag version
    RUN/<stage>/...                 the stage's outputs
    RUN/_stages/<stage>/stats.json  rows in / out / rejected, seconds, and stage-specific figures
    RUN/_stages/<stage>/_SUCCESS    empty marker, written last: its presence means the stage is complete

Rerunning a run skips stages whose marker exists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from wbrag_ray import __version__
from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.storage import Location, resolve

log = logging.getLogger(__name__)

PLACEMENT_KEYS = {"num_cpus", "num_gpus", "concurrency", "threads", "checkpoint_rows", "memory_gb"}


class RunFolder:
    def __init__(self, uri: str):
        self.root: Location = resolve(uri)

    @property
    def uri(self) -> str:
        return self.root.uri

    def path(self, *parts: str) -> Location:
        return self.root.join(*parts)

    # --- config ------------------------------------------------------------------------------------

    def bind_config(self, config: WbragConfig, force: bool = False) -> None:
        """Record the resolved config; refuse a changed one for an existing run unless `force`."""
        run_json = self.path("run.json")
        fingerprint = config.fingerprint()
        if run_json.exists() and not force:
            previous = run_json.read_json().get("config", {})
            diff = _diff(previous, fingerprint)
            # Settings that only add inputs (a new eval dataset) don't change completed outputs; write-back
            # settings only shape versioned write-back indices and Zero-RAG settings only shape its own stages,
            # which check their own settings; the adaptive methods' settings only shape answers.
            diff = [d for d in diff if not d.startswith(("eval.", "ingest.corpus", "writeback", "zerorag", "rag.", "rag:"))]
            # Where and how wide a stage runs (CPUs, GPUs, actors, threads, checkpoint size) never changes
            # what it writes: a run may move to a bigger cluster.
            diff = [d for d in diff if d.split(":")[0].rsplit(".", 1)[-1] not in PLACEMENT_KEYS]
            if diff:
                raise ConfigError(
                    f"run folder {self.uri} was made with a different config ({'; '.join(diff[:5])}). "
                    "Use a new run folder, or pass --force to rerun with the new config."
                )
        run_json.write_json({"wbrag_version": __version__, "config": fingerprint, "ray": config.ray.model_dump()})

    def load_config(self) -> WbragConfig:
        run_json = self.path("run.json")
        if not run_json.exists():
            raise ConfigError(f"{self.uri} is not a run folder (no run.json); start with `wbrag ingest` or `wbrag run`")
        return WbragConfig.model_validate(run_json.read_json()["config"])

    # --- stages ------------------------------------------------------------------------------------

    def _stage_dir(self, name: str) -> Location:
        return self.path("_stages", name)

    def is_complete(self, name: str) -> bool:
        return self._stage_dir(name).join("_SUCCESS").exists()

    def stats(self, name: str) -> dict[str, Any] | None:
        loc = self._stage_dir(name).join("stats.json")
        return loc.read_json() if loc.exists() else None

    def mark_complete(self, name: str, stats: dict[str, Any]) -> None:
        d = self._stage_dir(name)
        d.join("stats.json").write_json(stats)
        d.join("_SUCCESS").write_bytes(b"")  # last: the marker's presence means everything above is written

    def invalidate(self, name: str) -> None:
        self._stage_dir(name).join("_SUCCESS").delete()

    def completed_stages(self) -> list[str]:
        d = self.path("_stages")
        if not d.exists():
            return []
        import pyarrow.fs as pafs

        infos = d.fs.get_file_info(pafs.FileSelector(d.path, recursive=False))
        done = [i.base_name for i in infos if self.is_complete(i.base_name)]

        def completed_at(name: str) -> int:
            marker = self._stage_dir(name).join("_SUCCESS")
            return marker.fs.get_file_info(marker.path).mtime_ns or 0

        return sorted(done, key=lambda n: (completed_at(n), n))  # completion order = the pipeline's order

    def check_settings(self, name: str, settings: dict[str, Any], force: bool = False, fix: str = "") -> None:
        """Refuse to reuse a complete stage that recorded other `settings` (in its stats) unless `force`: stages
        whose settings are left out of the run's config check (write-back versions, Zero-RAG) guard themselves."""
        previous = self.stats(name) if self.is_complete(name) else None
        if previous is None or previous.get("settings") == settings or force:
            return
        old = previous.get("settings") or {}
        changed = sorted(k for k in set(settings) | set(old) if settings.get(k) != old.get(k))
        raise ConfigError(f"stage '{name}' of {self.uri} was made with other settings ({', '.join(changed)}); "
                          f"{fix or 'pass --force to redo it'}")

    def run_stage(self, name: str, fn: Callable[[], dict[str, Any]], force: bool = False) -> dict[str, Any]:
        """Run `fn` unless the stage is complete; record its stats and marker; print a one-line summary."""
        if self.is_complete(name) and not force:
            stats = self.stats(name) or {}
            print(f"[{name}] complete, skipped ({_summary(stats)})", flush=True)
            return stats
        self.invalidate(name)
        t0 = time.perf_counter()
        stats = dict(fn() or {})
        stats.setdefault("seconds", round(time.perf_counter() - t0, 3))
        if stats.get("rows_out") is not None and stats["seconds"] > 0:
            stats.setdefault("rows_per_s", round(stats["rows_out"] / stats["seconds"], 1))
        self.mark_complete(name, stats)
        print(f"[{name}] done: {_summary(stats)}", flush=True)
        return stats


def _summary(stats: dict[str, Any]) -> str:
    keys = ("rows_in", "rows_out", "rows_rejected", "seconds", "rows_per_s")
    return ", ".join(f"{k.replace('rows_', '')}={stats[k]}" for k in keys if k in stats)


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out.extend(_diff(a.get(key), b.get(key), f"{prefix}{key}."))
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} -> {b!r}"]
