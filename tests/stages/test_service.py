"""Stage services on a local Ray cluster with the tiny generator: one loaded model serves every pass of a
command whatever each pass asks (mode, token budget, stop strings), answers exactly as in-process generation
does, loads another model in the same actors when a pass needs one (new actors only for other resources,
never two sets at once), and gives its CPUs back when closed."""

import time

import pandas as pd
import pytest

from wbrag_ray import prompts
from wbrag_ray.config import GeneratorConfig
from wbrag_ray.generation.hf import HFGenerator
from wbrag_ray.generation.passes import GeneratorPasses

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "Name a river.", "How high is Everest?"]


def _frame():
    return pd.DataFrame({"id": range(len(QUESTIONS)),
                         "prompt": [prompts.dumps(prompts.no_retrieval_messages(q)) for q in QUESTIONS]})


def _cpus_free(ray, want: float, timeout: float = 30) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ray.available_resources().get("CPU", 0) >= want:
            return True
        time.sleep(0.2)
    return False


# each test's passes are one command's (the test of keeping them for the next command sets its own time)
pytestmark = pytest.mark.usefixtures("one_command")


def test_one_generator_service_serves_every_pass_and_answers_as_in_process(ray_cluster, tiny):
    config = GeneratorConfig(model=tiny.generator, dtype="float32", max_new_tokens=6, batch_size=2, num_cpus=1,
                             threads=2)
    local = HFGenerator(config)
    local.setup()
    chat = [prompts.no_retrieval_messages(q) for q in QUESTIONS]
    with GeneratorPasses(config) as passes:
        passes.start()
        passes.wait_ready()  # returns once the actor has loaded the model, and starts nothing more
        assert passes.services.actor_stats("setups") == {"generate": [1]}
        # a frame the driver holds goes to the service's actors directly; the same prompts again, to the memo
        direct = passes.generate("direct", _frame(), "prompt", "answer")
        text = passes.generate("text", _frame(), "prompt", "answer").sort_values("id")
        longer = passes.generate("longer", _frame(), "prompt", "answer", 12).sort_values("id")
        multiline = passes.generate("multiline", _frame(), "prompt", "answer", 12,
                                    multiline=True).sort_values("id")
        scored = passes.generate("scored", _frame(), "prompt", "out", mode="scored").sort_values("id")
        choice = passes.generate("choice", _frame(), "prompt", "p", mode="choice",
                                 choices=("yes", "no")).sort_values("id")
        # six passes, four settings of the pass (budget, stop strings, mode), one loaded model: counted by the
        # driver and by the actor itself
        assert passes.services.started == {"generate": 1} and passes.services.loads == {"generate": 1}
        assert passes.services.actor_stats("setups") == {"generate": [1]}
        # a prompt the command already answered with the same settings is not decoded again (a grid's cells
        # ask the same prompts); another token budget, stop list or mode is another answer
        again = passes.generate("again", pd.concat([_frame(), _frame()]), "prompt", "answer")
        assert passes.stats["again"]["answers_reused"] == 8
        assert again["answer"].tolist() == direct["answer"].tolist() * 2
        assert not any("answers_reused" in passes.stats[p] for p in ("direct", "longer", "scored"))
    assert direct["id"].tolist() == list(range(len(QUESTIONS)))  # in the frame's order, every row once
    assert text["answer"].tolist() == direct["answer"].tolist() == local.generate(chat)
    assert longer["answer"].tolist() == local.generate(chat, 12)
    assert multiline["answer"].tolist() == local.with_config(config.model_copy(update={"stop": []})).generate(chat, 12)
    want = local.generate_scored(chat)
    assert scored["out_tokens"].map(list).tolist() == [s.tokens for s in want]
    for got, s in zip(scored["out_probs"], want, strict=True):
        assert max(abs(a - b) for a, b in zip(got, s.probs, strict=True)) < 1e-5
    for got, p in zip(choice["p"], local.choice_probs(chat, ("yes", "no")), strict=True):
        assert max(abs(a - b) for a, b in zip(got, p, strict=True)) < 1e-6
    assert set(passes.stats) == {"text", "direct", "longer", "multiline", "scored", "choice", "again"}
    assert _cpus_free(ray_cluster, 2), "closing the passes gives the service's CPUs back"


def test_a_pass_with_another_model_loads_it_in_the_same_actors(ray_cluster, tiny):
    config = GeneratorConfig(model=tiny.generator, dtype="float32", max_new_tokens=4, num_cpus=1, threads=2)
    other = config.model_copy(update={"chat_template": False})  # another way of loading: set up again
    wider = config.model_copy(update={"num_cpus": 0.5})  # other resources: other actors
    chat, plain = HFGenerator(config), HFGenerator(other)
    chat.setup()
    plain.setup()
    messages = [prompts.no_retrieval_messages(q) for q in QUESTIONS]
    with GeneratorPasses(config) as passes:
        # another command's passes on these services (their own answer memo): c decodes a's prompts again
        a = GeneratorPasses(config, passes.services).generate("a", _frame(), "prompt", "answer").sort_values("id")
        b = passes.generate("b", _frame(), "prompt", "answer", generator=other).sort_values("id")
        c = passes.generate("c", _frame(), "prompt", "answer").sort_values("id")
        assert passes.services.started == {"generate": 1} and passes.services.loads == {"generate": 3}
        # a, b's other model, a's again: in one actor
        assert passes.services.actor_stats("setups") == {"generate": [3]}
        # each pass answered with the model it asked for
        assert a["answer"].tolist() == c["answer"].tolist() == chat.generate(messages)
        assert b["answer"].tolist() == plain.generate(messages) != a["answer"].tolist()
        GeneratorPasses(config, passes.services).generate("d", _frame(), "prompt", "answer", generator=wider)
        assert passes.services.started == {"generate": 2}
        # one model actor at a time: the other CPU stays free for reads and Ray's own tasks
        assert ray_cluster.available_resources().get("CPU", 0) >= 1
    assert _cpus_free(ray_cluster, 2)


def test_a_service_actor_killed_after_its_arguments_were_released_restarts_and_serves(ray_cluster, tiny):
    """Issue 26: a service actor that Ray restarts (its node lost, its process killed) constructs itself again
    from its creation spec. The stage travels inside it (by value), so the restart needs nothing the driver
    may have released: here every driver-side reference to the stage is gone and the object store's unused
    objects freed before the kill."""
    import gc

    import pytest

    from wbrag_ray.generation.stage import GenerateStage
    from wbrag_ray.ray_runtime import start_restartable
    from wbrag_ray.stages.service import StageService

    config = GeneratorConfig(model=tiny.generator, dtype="float32", max_new_tokens=6, batch_size=2, num_cpus=1)
    service = StageService(GenerateStage(config))
    first = service.run_frame(_frame(), GenerateStage(config))
    gc.collect()
    ray_cluster._private.internal_api.global_gc()
    ray_cluster.kill(service.actors[0], no_restart=False)  # Ray restarts it (max_restarts=3)
    try:
        again = service.run_frame(_frame(), GenerateStage(config))
        assert again["answer"].tolist() == first["answer"].tolist()
        assert ray_cluster.get(service.actors[0].stat.remote("setups")) == 1  # a new process: set up again
    finally:
        service.close()
    # an argument too large to travel inside the creation spec is refused, not left to fail a later restart
    with pytest.raises(ValueError, match="pass large inputs by path"):
        start_restartable(ray_cluster.remote(num_cpus=0)(object), b"x" * (200 * 1024))
    # and so is a service whose stage pickles past what Ray inlines (100 KiB): the stage above is a few KiB, which
    # any `.remote(stage)` would inline; this one would go to the object store, where a restart finds it no more
    large = GenerateStage(config)
    large.ballast = b"x" * (150 * 1024)
    with pytest.raises(ValueError, match="pass large inputs by path"):
        StageService(large)


def test_a_service_the_cluster_cannot_place_is_refused_in_seconds_before_any_actor_starts(ray_cluster, tiny):
    """Three 1-CPU generator actors on this 2-CPU cluster: Ray would start two and leave the third pending, and
    the pass would wait on it forever. Refused before any actor starts, with the concurrency that fits."""
    import pytest

    from wbrag_ray.config import ConfigError

    config = GeneratorConfig(model=tiny.generator, dtype="float32", max_new_tokens=4, num_cpus=1, concurrency=3)
    assert _cpus_free(ray_cluster, 2)  # what earlier tests held is back
    started = time.monotonic()
    with GeneratorPasses(config) as passes, pytest.raises(ConfigError) as refused:
        passes.generate("too-wide", _frame(), "prompt", "answer")
    assert time.monotonic() - started < 30
    assert "the generate service: 3 actors of 1 CPU each do not fit the cluster's 1 node (room for 2)" in \
        str(refused.value) and "lower its concurrency to 2" in str(refused.value)
    assert passes.services.started == {} and ray_cluster.available_resources().get("CPU", 0) == 2


def test_a_ray_data_pool_of_which_no_actor_fits_is_refused_and_a_partial_fit_is_said(ray_cluster, caplog):
    """The embed pass (an actor pool of its own, what `wbrag embed` runs): Ray Data starts the actors the cluster
    places and runs on those. One asking for a GPU on this GPU-less cluster would wait forever: refused as the
    pass is planned. Three 1-CPU actors on 2 CPUs run as two: a warning says so."""
    import logging

    import pytest
    import ray.data

    from wbrag_ray.config import ConfigError, EmbedderConfig
    from wbrag_ray.stages.base import apply_stage
    from wbrag_ray.stages.embed import EmbedStage

    gpu = EmbedStage(EmbedderConfig(num_cpus=1, num_gpus=1), id_column="pid")
    with pytest.raises(ConfigError, match=r"the embed pass: 1 actor of 1 CPU and 1 GPU each .* \(room for 0\); "
                                          r"ask less: the largest node has 0 GPU"):
        apply_stage(ray.data.range(4), gpu)
    with caplog.at_level(logging.WARNING, logger="wbrag_ray.stages.base"):
        apply_stage(ray.data.range(4), EmbedStage(EmbedderConfig(num_cpus=1, concurrency=3), id_column="pid"))
    assert "the embed pass: 3 actors of 1 CPU each do not fit the cluster's 1 node (room for 2); lower its " \
           "concurrency to 2, or add nodes; it runs on the actors that fit" in caplog.text
