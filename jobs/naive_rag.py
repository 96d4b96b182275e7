"""Entry point for `ray job submit` or `python jobs/naive_rag.py CONFIG [--run RUN]`: ingest, embed, index and
evaluate as one job (and whatever else the config enables: write-back, Zero-RAG), from jobs/configs/."""

import sys

from _job import run_job

from wbrag_ray import api

if __name__ == "__main__":
    sys.exit(run_job(__doc__, api.run))
