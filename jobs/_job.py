"""What every job entry point shares: `python jobs/<name>.py CONFIG [--run RUN] [--set k=v ...] [--force]`
calls a fixed sequence of the library API (wbrag_ray.api) on one run folder. Also the entrypoint for
`ray job submit`."""

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from wbrag_ray.config import ConfigError, load_config

Steps = Callable[..., object]  # steps(run: str, config: WbragConfig, force: bool, **the job's own options)
Option = tuple[tuple[str, ...], dict[str, Any]]  # (flags, keyword arguments) of argparse's add_argument


def run_job(description: str, steps: Steps, options: Sequence[Option] = ()) -> int:
    """Parse the job's command line and call `steps(run, config, force, **job_options)` (the job's own `options`,
    by their dest); a ConfigError exits with code 2."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("config", help="YAML config (see jobs/configs/)")
    parser.add_argument("--run", help="run folder (default: the config's `run` key)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--force", action="store_true")
    own = [parser.add_argument(*flags, **kwargs).dest for flags, kwargs in options]
    args = parser.parse_args()
    try:
        config = load_config(args.config, args.overrides)
        run = args.run or config.run
        if not run:
            raise ConfigError(f"no run folder: pass --run RUN or set `run:` in {args.config}")
        from wbrag_ray.lease import run_lease

        with run_lease(run, " ".join([parser.prog, *sys.argv[1:]])):  # one writer per run folder, as `wbrag`
            steps(run, config, args.force, **{dest: getattr(args, dest) for dest in own})
    except ConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    return 0
