"""Every RAG method (no-retrieval, naive, replug, self-rag, flare) on the config's `eval.dataset`, with the base
index alone and beside each trained write-back version: RUN/eval/methods_grid.json
(`python jobs/evaluate_methods.py CONFIG`)."""

import sys

from _job import run_steps

if __name__ == "__main__":
    sys.exit(run_steps(__doc__, [["eval", "--methods-grid"]]))
