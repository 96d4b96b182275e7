"""An index build run as a run folder's stage, as `wbrag index` runs it (the stage's checkpoint open), for
tests/index/test_build_resume.py to kill part way and run again. Joins the Ray cluster at RAY_ADDRESS, so the
build's tasks are Ray tasks of this driver and die with it; prints the stage's stats as JSON.

    python -m tests.index.stage_build RUN EMBEDDINGS FACTORY NUM_SHARDS
"""

import json
import sys


def main(run_dir: str, embeddings: str, factory: str, num_shards: str) -> None:
    import ray

    from tests.index.conftest import index_config
    from wbrag_ray.config import WbragConfig
    from wbrag_ray.index.build import build_index
    from wbrag_ray.run import RunFolder, RunStage
    from wbrag_ray.storage import resolve

    ray.init(address="auto", log_to_driver=False)
    run = RunFolder(run_dir)
    settings = {"factory": factory, "embeddings": embeddings, "num_shards": int(num_shards)}
    ic = index_config(factory, num_shards=int(num_shards), num_cpus=1)
    stats = run.execute(RunStage("index"), WbragConfig(),
                        lambda: build_index(resolve(embeddings), run.layout.index, "m", "passage", ic),
                        params=settings)
    print(json.dumps(stats))


if __name__ == "__main__":
    main(*sys.argv[1:5])
