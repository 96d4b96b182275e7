"""Every RAG method (no-retrieval, naive, replug, replug-vote, self-rag, flare; replug on the hf backend only) on
the config's `eval.dataset`, with the base
index alone and beside each trained write-back version: RUN/eval/methods_grid.json
(`python jobs/evaluate_methods.py CONFIG`)."""

import sys

from _job import run_job

from wbrag_ray import api, rag


def methods_grid(run, config, force):
    config.eval.methods = rag.available_methods(config.generator)
    return api.evaluate(run, config, methods_grid=True, force=force)


if __name__ == "__main__":
    sys.exit(run_job(__doc__, methods_grid))
