"""Zero-RAG corpus pruning on a built sentence index: mastery scores on a sample -> pruner(s) -> prediction for
every sentence -> pruned corpus and index at each of zerorag.ratios -> [noise-tolerant tuning] -> [query router]
(`python jobs/prune_corpus.py jobs/configs/zero_rag_demo.yaml`; build the index first with jobs/build_index.py)."""

import sys

from _job import run_steps

from wbrag_ray.config import load_config

if __name__ == "__main__":
    config_file = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    z = load_config(config_file).zerorag if config_file else None
    ratios = [f"--ratio={r:g}" for r in (z.ratios if z else []) if r > 0]
    steps = [["mastery"], ["train-pruner"], *([["prune", *ratios]] if ratios else [])]
    steps += [["tune"]] if z and z.tune.enabled else []
    steps += [["train-router"]] if z and z.router else []
    sys.exit(run_steps(__doc__, steps))
