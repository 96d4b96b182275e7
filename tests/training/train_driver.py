"""A training driver for the kill test (`test_ray_train.py`): joins the session's cluster (RAY_ADDRESS) and runs
the LM pruner's Ray Train job with its checkpoints in a given folder, as `wbrag train-pruner` runs it in a stage.

    python -m tests.training.train_driver STORAGE OUT WORKERS
"""

import json
import sys

import ray

from tests.training.test_ray_train import pruner_training
from wbrag_ray.storage import resolve
from wbrag_ray.training.workers import fit

if __name__ == "__main__":
    storage, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ray.init(address="auto", logging_level="WARNING")
    training, section = pruner_training(workers)
    stats = fit(training, section, out, "lm-pruner", "zerorag.lm_pruner", storage=resolve(storage))
    print(json.dumps({k: stats[k] for k in ("steps", "resumed_from_steps")}))
