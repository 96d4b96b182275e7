"""WriteBack-RAG training on a built knowledge base; the labeled set is the config's `writeback.train`
(`python jobs/writeback.py jobs/configs/writeback_demo.yaml`)."""

import sys

from _job import run_job

from wbrag_ray import api

if __name__ == "__main__":
    sys.exit(run_job(__doc__, lambda run, config, force: api.train_writeback(run, config, force=force)))
