"""Zero-RAG corpus pruning on a built sentence index: mastery scores on a sample -> pruner(s) -> prediction for
every sentence -> pruned corpus and index at each of zerorag.ratios -> [noise-tolerant tuning] -> [query router]
(`python jobs/prune_corpus.py jobs/configs/zero_rag_demo.yaml`; build the index first with jobs/build_index.py)."""

import sys

from _job import run_job

from wbrag_ray import api


def prune_corpus(run, config, force):
    api.mastery(run, config, force=force)
    api.train_pruner(run, config, force=force)
    ratios = [r for r in config.zerorag.ratios if r > 0]
    if ratios:
        api.prune(run, config, ratios, force=force)
    if config.zerorag.tune.enabled:
        api.tune(run, config, force=force)
    if config.zerorag.router:
        api.train_router(run, config, force=force)


if __name__ == "__main__":
    sys.exit(run_job(__doc__, prune_corpus))
