"""A training driver for `test_ray_train.py`: runs the LM pruner's Ray Train job with its checkpoints in a given
folder (local or s3://), as `wbrag train-pruner` runs it in a stage. It joins the cluster RAY_ADDRESS names (the
session's, as a submitted job's driver joins its own) or, without it, starts a local one that inherits this
process's environment (the object store's credentials, as a cluster's nodes have them).

    python -m tests.training.train_driver STORAGE OUT WORKERS BACKBONE
"""

import json
import os
import sys

import ray

from tests.training.test_ray_train import pruner_training
from wbrag_ray.storage import resolve
from wbrag_ray.training.workers import fit

if __name__ == "__main__":
    storage, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level="WARNING")
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    training, section = pruner_training(workers, sys.argv[4])
    stats = fit(training, section, out, "lm-pruner", "zerorag.lm_pruner", storage=resolve(storage))
    print(json.dumps({k: stats[k] for k in ("steps", "resumed_from_steps", "losses", "workers", "examples_seen",
                                            "epochs_seen")}))
