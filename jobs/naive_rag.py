"""Entry point for `ray job submit` or `python jobs/naive_rag.py CONFIG [--run RUN]`: ingest, embed,
index and evaluate as one job, reading a YAML config from jobs/configs/."""

import sys

from wbrag_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
