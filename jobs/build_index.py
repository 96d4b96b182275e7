"""Build the knowledge base: ingest -> embed -> index (`python jobs/build_index.py jobs/configs/X.yaml`)."""

import sys

from _job import run_steps

if __name__ == "__main__":
    sys.exit(run_steps(__doc__, [["ingest"], ["embed"], ["index"]]))
