"""What every job entry point shares: `python jobs/<name>.py CONFIG [--run RUN] [--set k=v ...] [--force]`
runs a fixed sequence of `wbrag` subcommands on one run folder. Also the entrypoint for `ray job submit`."""

import argparse
import sys

from wbrag_ray.cli import main
from wbrag_ray.config import load_config


def run_steps(description: str, steps: list[list[str]]) -> int:
    """Each step is a subcommand plus its own flags; RUN, --config, --set and --force are added to each."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("config", help="YAML config (see jobs/configs/)")
    parser.add_argument("--run", help="run folder (default: the config's `run` key)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    run = args.run or load_config(args.config, args.overrides).run
    if not run:
        print(f"{parser.prog}: no run folder: pass --run RUN or set `run:` in {args.config}", file=sys.stderr)
        return 2
    common = ["--config", args.config, *[f"--set={o}" for o in args.overrides], *(["--force"] if args.force else [])]
    for step in steps:
        rc = main([step[0], run, *step[1:], *common])
        if rc:
            return rc
    return 0
