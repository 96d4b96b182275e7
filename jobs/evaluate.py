"""Evaluate a built knowledge base on the config's `eval.dataset` (`python jobs/evaluate.py CONFIG`)."""

import sys

from _job import run_steps

if __name__ == "__main__":
    sys.exit(run_steps(__doc__, [["eval"]]))
