"""The run folder: every stage's outputs (paths in `layout`), the resolved config, per-stage stats and completion
markers. A stage's fingerprint derives from its declaration (`RunStage`): its config values, the call's parameters
and the fingerprints of the stages it reads; a complete stage is skipped, or, where its fingerprint changed,
refused (unless --force) or redone."""

from __future__ import annotations

import operator
import re
import string
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from wbrag_ray import __version__
from wbrag_ray.checkpoints import stage_checkpoint
from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.layout import RunLayout, subdirs
from wbrag_ray.lease import LeaseLost, fence
from wbrag_ray.models.hardware import resolved_dtype_name
from wbrag_ray.storage import Location, commit, committed, next_version, refused_writes, resolve, sweep

# Where and how wide a stage runs never changes what it writes (a section's own such keys: its `RUNTIME_KEYS`).
PLACEMENT_KEYS = {"num_cpus", "num_gpus", "concurrency", "threads", "checkpoint_rows", "checkpoint_seconds", "memory_gb",
                  "tensor_parallel_size", "pipeline_parallel_size"}


def settings_value(value: Any) -> Any:
    """A config value as it shapes outputs: without placement or runtime-only keys, `dtype: auto` resolved to this
    machine's dtype (so another CPU kind counts as a change)."""
    if isinstance(value, BaseModel):
        skip = PLACEMENT_KEYS | set(getattr(type(value), "RUNTIME_KEYS", ()))
        out = {k: settings_value(getattr(value, k)) for k in type(value).model_fields if k not in skip}
        if out.get("dtype") == "auto":
            out["dtype"] = resolved_dtype_name("auto", getattr(value, "num_gpus", 0.0))
        if out.get("batch_invariant") == "auto" and value.batch_invariance() is not None:  # as in effect (generator)
            out["batch_invariant"] = value.batch_invariance()
        return out
    if isinstance(value, dict):
        return {k: settings_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [settings_value(v) for v in value]
    return value


class _Keep(dict):
    """format_map helper: unknown fields stay as written ('RUN --kind {kind}' without a kind)."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _one(config: WbragConfig) -> list[dict[str, Any]]:
    return [{}]


@dataclass(frozen=True)
class RunStage:
    """One stage of a run, declared once; `pipeline.PIPELINE` lists those `wbrag run` makes.

    Its fingerprint: `name` and `settings` (config paths) may hold the call's parameters ("pruner-{kind}",
    "rag.{method}"); `ignore`: paths under them that do not shape the output; `requires` / `uses`: stages it reads
    (required / optional); `command`: how a person makes it. Its work, where `wbrag run` makes it: `run(folder,
    config, force, services, params)` for each of its `instances(config)`; `work(config, sizes, params)` as
    `wbrag_ray.work` items, which `wbrag plan` prices under its `title`; the config sections it holds (`resources`);
    its `outputs` (`RunLayout` paths); `measured_by`: a pattern of the run stages whose stats measure it."""

    name: str
    settings: tuple[str, ...] = ()
    requires: tuple[RunStage, ...] = ()
    uses: tuple[RunStage, ...] = ()
    ignore: tuple[str, ...] = ()
    on_change: Literal["refuse", "redo"] = "refuse"
    command: str = ""
    fix: str = "pass --force to redo it (and the stages after it)"
    title: str = ""
    work: Callable[..., list] | None = None
    run: Callable[..., Any] | None = None
    instances: Callable[[WbragConfig], list[dict[str, Any]]] = _one
    resources: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    measured_by: str = ""

    def instance(self, params: dict[str, Any] | None = None) -> str:
        return string.Formatter().vformat(self.name, (), _Keep(params or {}))

    def heading(self, params: dict[str, Any]) -> str:
        """What the plan calls the instance `params`."""
        return (self.title or self.name).format_map(_Keep(params))

    def pattern(self, params: dict[str, Any]) -> str:
        """A pattern of the run's stage names whose stats measure the instance `params`."""
        return self.measured_by.format_map(_Keep(params)) if self.measured_by else re.escape(self.instance(params))

    def config_settings(self, config: WbragConfig, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """{declared path: its value}, derived from the config (see `settings_value`)."""
        out: dict[str, Any] = {}
        for template in self.settings:
            path = template.format_map(_Keep({k: "" if v is None else v for k, v in (params or {}).items()}))
            if "{" in path or not all(path.split(".")):
                continue  # a parameterized path whose parameter is empty or not given: nothing to record
            out[path] = settings_value(operator.attrgetter(path)(config))
        for path in self.ignore:
            for declared, value in out.items():
                if path.startswith(declared + ".") and isinstance(value, dict):
                    value.pop(path[len(declared) + 1:], None)
        return out


class RunFolder:
    def __init__(self, uri: str):
        self.root: Location = resolve(uri)
        self.layout = RunLayout(self.root)
        self._unrecorded: WbragConfig | None = None  # bound, to be written to run.json when a stage runs
        # while a stage runs: output folder URI -> (folder, next version), committed when it completes
        self._staged: dict[str, tuple[Location, Location]] | None = None
        self._redo = False  # the running stage was complete: its outputs are written beside the ones in use

    @property
    def uri(self) -> str:
        return self.root.uri

    # --- config ------------------------------------------------------------------------------------

    def bind_config(self, config: WbragConfig, force: bool = False, guard: Iterable[RunStage] = (),
                    record: Literal["now", "when_a_stage_runs"] = "now") -> None:
        """Bind the resolved config to the run; refuse it, unless `force`, where a complete stage of `guard` was made
        with other settings. `record`: write run.json now, or once a stage runs (it describes what made the files)."""
        if not force:
            for stage in guard:
                changed = self._changed(stage, {"config": stage.config_settings(config)}, only_config=True)
                if changed:
                    raise ConfigError(
                        f"run folder {self.uri} was made with a different config (stage '{stage.name}': "
                        f"{'; '.join(changed[:5])}). Use a new run folder, or pass --force to rerun with the new config."
                    )
        self._unrecorded = config
        if record == "now":
            self._record_config()

    def _record_config(self) -> None:
        config, self._unrecorded = self._unrecorded, None
        if config is not None:
            self.layout.run_json.write_json(
                {"wbrag_version": __version__, "config": config.fingerprint(), "ray": config.ray.model_dump()})

    def is_run(self) -> bool:
        return self.layout.run_json.exists()

    def require_run(self) -> None:
        """Refuse a folder that is not a run (no run.json): a mistyped path, an empty folder."""
        if not self.is_run():
            raise ConfigError(f"{self.uri} is not a run folder (no run.json); check the path, or start one with "
                              "`wbrag ingest RUN --corpus PATH` or `wbrag run CONFIG`")

    def load_config(self) -> WbragConfig:
        self.require_run()
        return WbragConfig.model_validate(self.layout.run_json.read_json()["config"])

    # --- stages ------------------------------------------------------------------------------------

    def is_complete(self, name: str) -> bool:
        return self.layout.stage(name).success.exists()

    def stats(self, name: str) -> dict[str, Any] | None:
        loc = self.layout.stage(name).stats
        return loc.read_json() if loc.exists() else None

    def mark_complete(self, name: str, stats: dict[str, Any],
                      staged: Iterable[tuple[Location, Location]] = ()) -> None:
        """Record the stage's stats, then its marker; `staged`: (folder, new version) of a redone stage's outputs,
        committed first (the old marker goes before, so a stop between commits is an incomplete stage)."""
        record = self.layout.stage(name)
        fence(record.success)  # a commit: this command must still hold the run folder's lease
        staged = list(staged)
        if staged:
            record.success.delete()
            for final, new in staged:
                if new.exists():
                    commit(new)
                else:  # the redo wrote nothing there: nor does the stage hold anything there now
                    final.delete()
        record.stats.write_json(stats)
        record.success.write_bytes(b"")  # last: the marker's presence means everything above is written

    def output(self, final: Location) -> Location:
        """Where the running stage writes its output folder `final`: in place (its committed version), or, for a
        complete stage redone or a commit a kill stopped, in its next version (`storage.next_version`), committed once the
        stage completes. What an earlier kill left behind goes first (`storage.sweep`)."""
        if self._staged is None:
            return final
        sweep(final)
        new = next_version(final)
        if not self._redo and not new.exists():
            return committed(final)
        folder = new.parent().parent()
        self._staged.setdefault(folder.uri, (folder, new))
        return new

    def completed_stages(self) -> list[str]:
        done = [name for name in subdirs(self.layout.stages) if self.is_complete(name)]

        def completed_at(name: str) -> int:
            marker = self.layout.stage(name).success
            return marker.fs.get_file_info(marker.path).mtime_ns or 0

        return sorted(done, key=lambda n: (completed_at(n), n))  # completion order = the pipeline's order

    def require(self, stage: RunStage, params: dict[str, Any] | None = None) -> None:
        name = stage.instance(params)
        if not self.is_complete(name):
            command = stage.command.format_map(_Keep(params or {})) or f"the stage '{name}'"
            raise ConfigError(f"stage '{name}' of run {self.uri} is not complete; run `{command}` first")

    def require_inputs(self, stage: RunStage, params: dict[str, Any] | None = None) -> None:
        """Every stage `stage` reads is complete (else the command that makes the first missing one is named)."""
        for dep in stage.requires:
            self.require(dep, params)

    def fingerprint(self, stage: RunStage, config: WbragConfig, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """What `stage` would be made from now: its config values, parameters and inputs' fingerprints."""
        inputs = {}
        for dep in (*stage.requires, *stage.uses):
            name = dep.instance(params)
            if self.is_complete(name):
                inputs[name] = (self.stats(name) or {}).get("settings")
        out: dict[str, Any] = {"config": stage.config_settings(config, params)}
        if params:
            out["params"] = params
        if inputs:
            out["inputs"] = inputs
        return out

    def check(self, stage: RunStage, config: WbragConfig, params: dict[str, Any] | None = None,
              force: bool = False) -> tuple[dict[str, Any], list[str]]:
        """What `execute` checks before any work (callable before Ray starts): inputs complete, a changed stage
        refused per `stage.on_change` unless `force`; the fingerprint and what changed."""
        self.require_inputs(stage, params)
        fingerprint = self.fingerprint(stage, config, params)
        changed = [] if force else self._changed(stage, fingerprint, params)
        if changed and stage.on_change == "refuse":
            raise ConfigError(f"stage '{stage.instance(params)}' of {self.uri} was made with other settings "
                              f"({'; '.join(changed[:5])}); {stage.fix}")
        return fingerprint, changed

    def _changed(self, stage: RunStage, fingerprint: dict[str, Any], params: dict[str, Any] | None = None,
                 only_config: bool = False) -> list[str]:
        """What differs from the complete stage's recorded fingerprint ([] where there is none)."""
        name = stage.instance(params)
        previous = (self.stats(name) or {}).get("settings") if self.is_complete(name) else None
        if not isinstance(previous, dict) or "config" not in previous:
            return []
        # a setting this version no longer records is no change (it no longer shapes the output: the
        # evaluation's methods)
        if isinstance(previous["config"], dict):
            previous = {**previous, "config": {k: v for k, v in previous["config"].items() if k in fingerprint["config"]}}
        if only_config:
            previous = {"config": previous["config"]}
        else:
            previous = {**previous, "params": _plain_params(previous.get("params") or {})}
            fingerprint = {**fingerprint, "params": _plain_params(fingerprint.get("params") or {})}
        return _diff(previous, fingerprint)

    def execute(self, stage: RunStage, config: WbragConfig, work: Callable[[], dict[str, Any]],
                params: dict[str, Any] | None = None, force: bool = False,
                on_skip: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run a declared stage: its inputs must be complete; a complete one with the same fingerprint is skipped
        (`on_skip` sees its stats), one with another is refused or redone (`stage.on_change`). `work` runs with the
        stage's checkpoint open (resumed for the same fingerprint); then its stats, its marker, a one-line summary."""
        fingerprint, changed = self.check(stage, config, params, force)
        name = stage.instance(params)
        if changed:
            print(f"[{name}] settings changed ({'; '.join(changed[:3])}): redoing it", flush=True)
        elif self.is_complete(name) and not force:
            stats = self.stats(name) or {}
            if on_skip is not None:
                on_skip(stats)
            print(f"[{name}] complete, skipped ({_summary(stats)})", flush=True)
            return stats
        # a complete stage redone keeps its marker and its outputs (in use) until the new ones replace them
        outer_staged, outer_redo = self._staged, self._redo
        self._staged, self._redo = {}, self.is_complete(name)
        # run.json describes completed stages only: restored if this stage does not complete
        records = self._unrecorded is not None
        recorded = self.layout.run_json.read_json() if records and self.is_run() else None
        self._record_config()
        t0 = time.perf_counter()
        checkpoint_folder = self.layout.checkpoint(name)
        try:
            # a refused write (a full disk): one line naming the run folder
            with refused_writes(self.root), stage_checkpoint(checkpoint_folder, fingerprint, name) as checkpoint:
                stats = {**(work() or {}), "settings": fingerprint}
        except BaseException:
            self._staged, self._redo = outer_staged, outer_redo
            if isinstance(sys.exc_info()[1], LeaseLost):
                raise  # run.json is the new holder's now
            if recorded is not None:
                self.layout.run_json.write_json(recorded)
            elif records:
                self.layout.run_json.delete()
            raise
        staged, self._staged, self._redo = self._staged, outer_staged, outer_redo
        stats = {**checkpoint.stats(), **stats}
        stats.setdefault("seconds", round(time.perf_counter() - t0, 3))
        if stats.get("rows_out") is not None and stats["seconds"] > 0:
            stats.setdefault("rows_per_s", round(stats["rows_out"] / stats["seconds"], 1))
        self.mark_complete(name, stats, (staged or {}).values())
        checkpoint_folder.delete()
        print(f"[{name}] done: {_summary(stats)}", flush=True)
        return stats


def _summary(stats: dict[str, Any]) -> str:
    keys = ("rows_in", "rows_out", "rows_rejected", "rows_resumed", "seconds", "rows_per_s")
    return ", ".join(f"{k.replace('rows_', '')}={stats[k]}" for k in keys if k in stats)


def _plain_params(params: dict[str, Any]) -> dict[str, Any]:
    """A stage's call parameters as they shape its output: not given, None and False are one setting."""
    return {k: v for k, v in params.items() if v is not None and v is not False}


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out.extend(_diff(a.get(key), b.get(key), f"{prefix}{key}."))
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} -> {b!r}"]
