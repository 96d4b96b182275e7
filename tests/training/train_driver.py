"""A training driver for `test_ray_train.py`: runs the LM pruner's Ray Train job with its checkpoints in a given
folder (local or s3://), as `wbrag train-pruner` runs it in a stage. It joins the cluster RAY_ADDRESS names (the
session's, as a submitted job's driver joins its own), handing the object store's settings in this process's
environment (AWS_*) to its workers through the job's runtime environment, as a submitted job would.

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
    s3 = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING", runtime_env={"env_vars": s3} if s3 else None)
    training, section = pruner_training(workers, sys.argv[4])
    stats = fit(training, section, out, "lm-pruner", "zerorag.lm_pruner", storage=resolve(storage))
    print(json.dumps({k: stats[k] for k in ("steps", "resumed_from_steps", "losses", "workers", "examples_seen",
                                            "epochs_seen")}))
