"""Build the knowledge base: ingest -> embed -> index (`python jobs/build_index.py jobs/configs/X.yaml`)."""

import sys

from _job import run_job

from wbrag_ray import api

if __name__ == "__main__":
    sys.exit(run_job(__doc__, api.build_kb))
