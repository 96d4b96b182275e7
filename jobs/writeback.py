"""WriteBack-RAG training on a built knowledge base; the labeled set is the config's `writeback.train`
(`python jobs/writeback.py jobs/configs/writeback_demo.yaml`)."""

import sys

from _job import run_steps

from wbrag_ray.config import load_config

if __name__ == "__main__":
    config_file = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    train = load_config(config_file).writeback.train if config_file else None
    sys.exit(run_steps(__doc__, [["writeback", *(["--train", train] if train else [])]]))
