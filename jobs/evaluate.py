"""Evaluate a built knowledge base on the config's `eval.dataset` (`python jobs/evaluate.py CONFIG`)."""

import sys

from _job import run_job

from wbrag_ray import api

if __name__ == "__main__":
    sys.exit(run_job(__doc__, lambda run, config, force: api.evaluate(run, config, force=force)))
