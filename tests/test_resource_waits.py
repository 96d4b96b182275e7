"""Every wait for resources ends within `ray.pending_timeout_s` with a message naming what is missing: a Ray Data
actor pool (a pass with a pool of its own) and a Ray Train worker group, on the session's 2-CPU cluster while
another actor holds most of its CPUs. The pools ask for no more than the cluster has (the capacity checks refuse
that up front): what is missing is held by someone else, as on a shared cluster. CPUs stand in for GPUs here.
And a query embedding configured for GPUs on a cluster without any fails before any work, naming the setting."""

from __future__ import annotations

import re
import time

import numpy as np
import pandas as pd
import pytest

from tests.conftest import wait_idle
from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.placement import PENDING_TIMEOUT_S
from wbrag_ray.stages.base import Resources, Stage

TIMEOUT_S = 3.0


class Doubler(Stage):
    """A pass with an actor pool of its own (no service key): one actor of a whole CPU."""

    name = "doubler"
    section = "embedder"
    input_columns = ("x",)
    output_columns = ("y",)

    @property
    def resources(self) -> Resources:
        return Resources(num_cpus=1.0, concurrency=1, batch_size=4)

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        batch["y"] = batch["x"] * 2
        return batch


class Holder:
    def ready(self) -> bool:
        return True


@pytest.fixture
def cpus_held(ray_cluster, monkeypatch):
    """1.5 of the cluster's 2 CPUs held by another actor, with ray.pending_timeout_s set to TIMEOUT_S; yields a
    function that frees them."""
    monkeypatch.setitem(PENDING_TIMEOUT_S, "seconds", TIMEOUT_S)
    wait_idle(ray_cluster)
    holder = ray_cluster.remote(num_cpus=1.5)(Holder).remote()
    ray_cluster.get(holder.ready.remote())
    yield lambda: ray_cluster.kill(holder)
    ray_cluster.kill(holder)


def _pass(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` through Doubler on a pool of its own, as a resumable pass runs one (`checkpoints.resumable_write`)."""
    from wbrag_ray.placement.waits import pool_start_wait
    from wbrag_ray.ray_runtime import local_dataset
    from wbrag_ray.stages.base import apply_stage, concurrency_fix

    stage = Doubler()
    res = stage.resources
    with pool_start_wait(f"the {stage.name} pass", res.concurrency, res.need, concurrency_fix(stage.section)):
        return apply_stage(local_dataset(frame), stage).to_pandas()


def test_a_ray_data_pool_whose_actors_others_keep_out_ends_naming_it_and_runs_once_freed(ray_cluster, cpus_held):
    frame = pd.DataFrame({"x": range(8)})
    start = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        _pass(frame)
    took = time.monotonic() - start
    assert TIMEOUT_S <= took < TIMEOUT_S + 15, took
    message = str(refused.value)
    assert message.startswith(f"the doubler pass: its 1 actor of 1 CPU each did not start within {TIMEOUT_S:g} s "
                              "(ray.pending_timeout_s"), message
    assert re.search(r"Free now: 0(\.5)? CPU of 2 CPU;", message), message
    assert "Lower embedder.concurrency, free the resources, or raise ray.pending_timeout_s" in message
    cpus_held()  # the same pass runs once the CPUs are free: the refused pool left nothing behind
    wait_idle(ray_cluster)
    PENDING_TIMEOUT_S["seconds"] = 120.0  # an actor's start (a process, its imports) may take seconds on 2 busy cores
    assert _pass(frame)["y"].tolist() == [2 * x for x in range(8)]


def test_a_training_whose_workers_others_keep_out_ends_naming_them(ray_cluster, cpus_held, tmp_path):
    """The LM pruner's training through `fit`, one worker of 1 CPU (the node has 2: `check_placement` lets it
    through) while 1.5 are held: Ray Train would wait 60 s, start its worker group again and wait again, forever;
    `fit` ends it after ray.pending_timeout_s naming the training and the setting (`train_start_wait` with
    TRAIN_START_FAILURE)."""
    from wbrag_ray.config import LMPrunerConfig
    from wbrag_ray.storage import resolve
    from wbrag_ray.training.lm_pruner import PrunerTraining
    from wbrag_ray.training.workers import fit

    section = LMPrunerConfig(backbone="never-loaded", batch_size=2, trainer={"num_workers": 1, "num_cpus": 1.0})
    training = PrunerTraining(pd.DataFrame({"text": ["a sentence", "another one"], "score": [0.0, 1.0]}), section,
                              [])
    start = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        fit(training, section, str(tmp_path / "adapter"), "lm-pruner", "zerorag.lm_pruner",
            storage=resolve(str(tmp_path / "train")))
    took = time.monotonic() - start
    assert TIMEOUT_S <= took < TIMEOUT_S + 30, took
    message = str(refused.value)
    assert message.startswith("the lm-pruner training: 1 training worker of 1 CPU each still wait for resources "
                              f"after {TIMEOUT_S:g} s."), message
    assert re.search(r"Free now: 0(\.5)? CPU of 2 CPU;", message), message
    assert "Lower zerorag.lm_pruner.trainer.num_workers, free the resources" in message


def test_the_router_and_the_grid_with_a_gpu_query_embedder_fail_before_any_work_on_a_cluster_without_gpus(
        ray_cluster):
    """No run folder, no questions, no generator: the refusal comes first (none of them is touched)."""
    from wbrag_ray.zerorag.grid import evaluate_grid
    from wbrag_ray.zerorag.router import _train

    config = WbragConfig.model_validate({"embedder": {"num_gpus": 1}})
    with pytest.raises(ConfigError) as refused:
        _train(None, config, None, 0, None)
    assert str(refused.value).startswith("the query router embeds its queries on the retrieval actors, which ask "
                                         "for 1 GPU each (embedder.num_gpus), but no node of the cluster has one; "
                                         "set retrieval.embed_gpus: 0 to embed queries on CPU")
    config = WbragConfig.model_validate({"embedder": {"num_gpus": 0}, "retrieval": {"embed_gpus": 0.5}})
    with pytest.raises(ConfigError, match=r"^the Zero-RAG grid embeds .* ask for 0\.5 GPUs each \(retrieval\.embed_gpus\)"):
        evaluate_grid(None, config, "absent.jsonl")


def test_query_vectors_made_by_the_retrieval_actors_are_the_drivers(ray_cluster, one_command):
    """The stage a GPU query embedder runs on (its actors; on CPU here): the same vectors as the driver's."""
    from wbrag_ray.models.embedder import Embedder
    from wbrag_ray.retrieval.stage import QueryVectorsStage
    from wbrag_ray.stages.service import Services

    config = WbragConfig()
    questions = ["who wrote hamlet", "highest mountain in europe", "capital of peru"]
    with Services() as services:
        out = services.run_frame(pd.DataFrame({"question": questions}), QueryVectorsStage(config.embedder,
                                                                                          config.retrieval))
        assert services.started == {"retrieve": 1}
    np.testing.assert_allclose(np.stack(out["vector"].to_list()),
                               Embedder(config.embedder).encode_queries(questions), atol=1e-5)
