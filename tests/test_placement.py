"""What a pool of actors needs against what the cluster's nodes hold (wbrag_ray.placement), by hand: whole
actors per node, each resource counted, and a fix that fits. The refusals on a real cluster, before any actor
starts: tests/stages/test_service.py and tests/retrieval/test_service.py."""

from tests.conftest import wait_idle
from wbrag_ray.placement import pool_refusal, room_for

GIB = 1 << 30


def test_room_counts_whole_actors_per_node_on_every_resource_they_ask():
    nodes = [{"CPU": 8.0, "GPU": 2.0, "memory": 16.0 * GIB}, {"CPU": 3.0, "memory": 64.0 * GIB}]
    assert room_for({"CPU": 1.0}, nodes) == 8 + 3
    assert room_for({"CPU": 1.5}, nodes) == 5 + 2  # 1.5 CPUs: 5 on 8, 2 on 3 (no half actor)
    assert room_for({"CPU": 1.0, "GPU": 1.0}, nodes) == 2  # the GPUs bind; the second node has none
    assert room_for({"CPU": 0.1, "memory": 10.0 * GIB}, nodes) == 1 + 6  # memory binds
    assert room_for({"CPU": 1.0, "GPU": 0.0}, nodes) == 11  # asking 0 of a resource asks nothing of it
    assert room_for({"GPU": 1 / 3}, [{"GPU": 1.0}]) == 3  # not floored to 2 by float rounding
    # a share of a GPU lies on one GPU: 0.4 twice per GPU (not 20 on 8), 0.9 once; shares held on one GPU
    assert room_for({"GPU": 0.4}, [{"GPU": 8.0}]) == 16 and room_for({"GPU": 0.9}, [{"GPU": 8.0}]) == 8
    assert room_for({"GPU": 0.9}, [{"GPU": 7.8}]) == 7 and room_for({"GPU": 0.8}, [{"GPU": 7.8}]) == 8


def test_a_pool_that_does_not_fit_is_refused_with_a_fix_that_fits():
    laptop = [{"CPU": 2.0, "memory": 8.0 * GIB}]
    assert pool_refusal("the generate service", 2, {"CPU": 1.0, "GPU": 0.0}, laptop) is None
    why = pool_refusal("the generate service", 3, {"CPU": 1.0, "GPU": 0.0}, laptop)
    assert why == ("the generate service: 3 actors of 1 CPU each do not fit the cluster's 1 node (room for 2); "
                   "lower its concurrency to 2, or add nodes")
    why = pool_refusal("the embed pass", 1, {"CPU": 1.0, "GPU": 1.0}, laptop)  # a GPU stage on a CPU machine
    assert "1 actor of 1 CPU and 1 GPU each" in why and "ask less: the largest node has 0 GPU" in why
    why = pool_refusal("the search pool", 4, {"CPU": 0.1, "memory": 12.0 * GIB}, laptop + laptop)
    assert "12 GiB memory" in why and "the largest node has 8 GiB memory" in why and "2 nodes" in why


def test_a_pool_of_groups_is_told_the_replicas_per_group_that_fit():
    """A search pool of 4 shard groups x 6 replicas, 0.5 CPU each, on 8 CPUs: room for 16 actors, 4 per group."""
    why = pool_refusal("the search pool", 24, {"CPU": 0.5}, [{"CPU": 8.0}], groups=4)
    assert "(room for 16); lower its concurrency to 4" in why
    # fewer actors fit than there are groups: no concurrency fits, the nodes are too small
    assert "lower its concurrency, or add nodes" in pool_refusal("the search pool", 8, {"CPU": 4.0}, [{"CPU": 8.0}],
                                                                  groups=4)


def _config(*overrides: str):
    from wbrag_ray.config import load_config

    return load_config(overrides=list(overrides))


def test_auto_concurrency_fills_the_free_gpus_less_the_search_actors_and_leaves_a_cpu_to_the_reads():
    """The rule by hand, on free resources: 4 nodes of 8 GPUs and 96 CPUs (the paper's cluster), a laptop."""
    from wbrag_ray.placement.gpus import auto_concurrency

    cluster = [{"CPU": 96.0, "GPU": 8.0} for _ in range(4)]
    engines = _config("generator.concurrency=auto", "generator.num_gpus=1", "embedder.concurrency=auto",
                      "embedder.num_gpus=1")
    # 32 GPUs: 32 engines, 28 beside 4 search actors' GPUs (the embed stage runs alone: all 32)
    assert auto_concurrency(engines, cluster) == {"embedder": 32, "generator": 32}
    assert auto_concurrency(engines, cluster, search_gpus=4) == {"embedder": 32, "generator": 28}
    # the search actors' GPUs come off the nodes with the most free GPUs first: a 4-GPU replica per node fits
    # where 4 GPUs are free on one node, not on 4 nodes of 1
    sharded = _config("generator.concurrency=auto", "generator.num_gpus=4", "generator.backend=vllm")
    assert auto_concurrency(sharded, cluster, search_gpus=4) == {"generator": 7}
    assert auto_concurrency(sharded, [{"CPU": 96.0, "GPU": 4.0}, {"CPU": 96.0, "GPU": 5.0}], search_gpus=1) == \
        {"generator": 2}
    stages = _config("generator.concurrency=auto", "generator.num_gpus=8", "generator.pipeline_parallel_size=2",
                     "generator.backend=vllm")
    assert auto_concurrency(stages, cluster) == {"generator": 4}  # 8 groups of 4 GPUs, 2 per replica
    # retrieval sharing GPUs with the engines (retrieval.search_gpus 0.05 x 4 actors): an engine of 0.8 beside
    # them on one GPU, so every GPU holds an engine; of 0.9, the GPU they fill holds none
    shared = _config("generator.concurrency=auto", "generator.num_gpus=0.8")
    assert auto_concurrency(shared, cluster, search_gpus=0.2) == {"generator": 32}
    assert auto_concurrency(_config("generator.concurrency=auto", "generator.num_gpus=0.9"), cluster,
                            search_gpus=0.2) == {"generator": 31}
    # CPU actors: one CPU of the largest node left to the reads and writes; at least one actor
    laptop = [{"CPU": 2.0}]
    cpu = _config("generator.concurrency=auto", "embedder.concurrency=auto", "embedder.num_cpus=0.5")
    assert auto_concurrency(cpu, laptop) == {"embedder": 2, "generator": 1}
    assert auto_concurrency(cpu, [{"CPU": 4.0}, {"CPU": 4.0}]) == {"embedder": 14, "generator": 7}
    assert auto_concurrency(engines, laptop) == {"embedder": 1, "generator": 1}  # no GPU: the checks refuse
    assert auto_concurrency(_config("generator.concurrency=3"), cluster) == {}  # a number stays as set
    # the LM pruner's prediction actors: a pass of its own, so every free GPU (or CPU less one)
    pruner = _config("zerorag.lm_pruner.concurrency=auto", "zerorag.lm_pruner.num_gpus=0.5")
    assert auto_concurrency(pruner, cluster, search_gpus=4) == {"zerorag.lm_pruner": 64}
    assert auto_concurrency(_config("zerorag.lm_pruner.concurrency=auto"), laptop) == {"zerorag.lm_pruner": 1}


def test_concurrency_takes_a_positive_number_or_auto():
    import pytest

    from wbrag_ray.config import ConfigError

    assert _config("generator.concurrency=auto").generator.concurrency == "auto"
    assert _config("embedder.concurrency=3").embedder.concurrency == 3
    for bad in ("0", "many", "1.5"):
        with pytest.raises(ConfigError, match="generator.concurrency.*must be a positive integer or 'auto'"):
            _config(f"generator.concurrency={bad}")


def test_a_command_decides_auto_as_it_joins_the_cluster(ray_cluster, tmp_path):
    """On the session's real cluster: `api.start` sets each `auto` to the rule's number on the cluster's nodes, in
    the config every stage of the command then reads (and the next command decides again)."""
    from wbrag_ray import api
    from wbrag_ray.placement import auto_nodes, free_nodes
    from wbrag_ray.placement.gpus import auto_concurrency

    config = _config(f"run={tmp_path / 'run'}", "generator.concurrency=auto", "embedder.concurrency=auto",
                     "embedder.num_cpus=0.5", "zerorag.lm_pruner.concurrency=auto", "zerorag.lm_pruner.num_cpus=0.25")
    wait_idle(ray_cluster)
    free = list(free_nodes().values())
    assert len(free) == 1 and free[0]["CPU"] == 2  # the session's one 2-CPU node, idle
    nodes, source = auto_nodes()
    assert [n["CPU"] for n in nodes] == [f["CPU"] for f in free] and source == "the nodes up now"  # idle: all free
    expected = auto_concurrency(config, nodes)
    api.start(tmp_path / "run", config)
    assert (config.embedder.concurrency, config.generator.concurrency, config.zerorag.lm_pruner.concurrency) == (
        expected["embedder"], expected["generator"], expected["zerorag.lm_pruner"]) == (2, 1, 4)
    assert all(isinstance(n, int) and n >= 1 for n in expected.values())


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
PAPER_ZERO_RAG = ROOT / "jobs" / "configs" / "paper_zero_rag.yaml"
PAPER_WRITEBACK = ROOT / "jobs" / "configs" / "paper_writeback.yaml"
FOUR_BY_EIGHT = [{"CPU": 96.0, "GPU": 8.0} for _ in range(4)]


# what tensor_parallel_size auto decides for the Zero-RAG paper config's 70B on GPUs of 80 GB
TP4 = ["generator.num_gpus=4", "generator.tensor_parallel_size=4"]


def test_auto_sizes_every_gpu_stage_of_the_paper_configs_to_the_four_by_eight_cluster():
    """The rule on the paper configs' own shapes (4 nodes x 8 GPUs): an embed actor, an LM pruner actor and a pruner
    training worker per GPU; 70B replicas of 4 GPUs on every 4 GPUs the search actors leave; the 70B tuning's FSDP
    workers on every GPU (its batch of 32 feeds 32); the write-back generator on every GPU beside retrieval."""
    from wbrag_ray.config import load_config
    from wbrag_ray.placement.gpus import auto_concurrency

    # tensor_parallel_size auto on 80 GB GPUs: 4 (tests/test_placement_gpus.py)
    zero_rag = load_config(PAPER_ZERO_RAG, TP4)
    assert auto_concurrency(zero_rag, FOUR_BY_EIGHT) == {
        "embedder": 32, "generator": 8, "zerorag.lm_pruner": 32, "zerorag.lm_pruner.trainer": 32,
        "zerorag.tune.trainer": 32}
    # the grid's search actors (2) and query embedder (1) hold 3 GPUs: the generator takes the 7 whole groups left,
    # the stages that run alone keep every GPU
    held = auto_concurrency(zero_rag, FOUR_BY_EIGHT, search_gpus=3)
    assert held["generator"] == 7 and held["embedder"] == held["zerorag.lm_pruner"] == 32
    writeback = load_config(PAPER_WRITEBACK)
    assert auto_concurrency(writeback, FOUR_BY_EIGHT) == {"embedder": 32, "generator": 32}
    assert auto_concurrency(writeback, FOUR_BY_EIGHT, search_gpus=2)["generator"] == 30
    # a training's workers at most its batch: every worker gets an example a step
    small_batch = load_config(PAPER_ZERO_RAG, ["zerorag.tune.batch_size=4", "zerorag.lm_pruner.batch_size=16", *TP4])
    counts = auto_concurrency(small_batch, FOUR_BY_EIGHT)
    assert counts["zerorag.tune.trainer"] == 4 and counts["zerorag.lm_pruner.trainer"] == 16


def test_a_training_takes_auto_workers_and_a_bad_count_is_named():
    import pytest

    from wbrag_ray.config import ConfigError

    assert _config("zerorag.tune.trainer.num_workers=auto").zerorag.tune.trainer.num_workers == "auto"
    with pytest.raises(ConfigError, match="zerorag.tune.trainer.num_workers.*positive integer or 'auto'"):
        _config("zerorag.tune.trainer.num_workers=0")


def test_auto_sizes_an_autoscaling_cluster_from_its_declared_maximum(monkeypatch):
    """Before any GPU node is up, an autoscaling cluster's auto counts come from the most nodes it may run: the node
    groups its autoscaler publishes, or (WBRAG_AUTOSCALING=1) the launcher config's node types; the project's own
    launcher config declares the 4 x 8 GPUs the paper configs name."""
    from types import SimpleNamespace

    import yaml

    from wbrag_ray import placement
    from wbrag_ray.config import load_config
    from wbrag_ray.placement import gpus

    launcher = ROOT / "cluster" / "cluster.yaml"
    declared = placement.launcher_nodes(yaml.safe_load(launcher.read_text()))
    assert sum(n.get("GPU", 0) for n in declared) == 32 and max(n.get("GPU", 0) for n in declared) == 8
    monkeypatch.setattr(placement, "_published_groups", lambda: [])
    monkeypatch.setenv(placement.AUTOSCALING_ENV, "1")
    monkeypatch.setenv(placement.LAUNCHER_CONFIG_ENV, str(launcher))
    nodes, source = placement.auto_nodes()
    assert nodes == declared and "launcher config" in source
    assert gpus.auto_concurrency(load_config(PAPER_ZERO_RAG, TP4), nodes)["generator"] == 8
    # node groups the autoscaler published (KubeRay, autoscaler v2): each group's max_count
    groups = [SimpleNamespace(resources={"CPU": 8.0}, max_count=1),
              SimpleNamespace(resources={"CPU": 96.0, "GPU": 8.0}, max_count=4)]
    monkeypatch.setattr(placement, "_published_groups", lambda: groups)
    nodes, source = placement.auto_nodes()
    assert sum(n.get("GPU", 0) for n in nodes) == 32 and source == "the autoscaler's declared maximum"


def test_each_command_decides_auto_again_after_the_index_exists(monkeypatch):
    """`resolve_auto_concurrency` remembers which counts were "auto": the first command (the build, no index yet)
    gives the generator every GPU; a later one (write-back, evaluation) decides again with the search actors'
    GPUs held, instead of keeping the first number."""
    from wbrag_ray.config import load_config
    from wbrag_ray.placement import gpus

    monkeypatch.setattr(gpus, "auto_nodes", lambda: (FOUR_BY_EIGHT, "stated"))
    stated = ["retrieval.search_gpus=1", "retrieval.embed_gpus=1"]  # whole GPUs (no layout to decide)
    config = load_config(PAPER_WRITEBACK, stated)
    gpus.resolve_auto_concurrency(config)  # query embedder only: 1 GPU held
    assert (config.embedder.concurrency, config.generator.concurrency) == (32, 31)
    assert gpus.auto_keys(config)  # numbers now, decided again by the next command
    gpus.resolve_auto_concurrency(config, search=(4, 3e9))
    assert (config.embedder.concurrency, config.generator.concurrency) == (32, 27)
    fixed = load_config(PAPER_WRITEBACK, ["generator.concurrency=4", "embedder.concurrency=8", *stated])
    gpus.resolve_auto_concurrency(fixed, search=(4, 3e9))
    assert (fixed.embedder.concurrency, fixed.generator.concurrency) == (8, 4)  # a number stays as set


def test_the_search_actors_gpus_are_held_where_no_gpu_setting_is_auto(monkeypatch):
    """With every GPU setting stated, the engines `resolve_auto_concurrency` counts still leave the search actors
    their GPUs (`search`, as `session.join_ray` passes it): 4 whole-GPU search actors and a query embedder."""
    from wbrag_ray.config import load_config
    from wbrag_ray.placement import gpus

    monkeypatch.setattr(gpus, "auto_nodes", lambda: (FOUR_BY_EIGHT, "stated"))
    config = load_config(PAPER_WRITEBACK, ["retrieval.search_gpus=1", "retrieval.embed_gpus=1"])
    assert not gpus.needs_layout(config)
    gpus.resolve_auto_concurrency(config, search=(4, 3e9))
    assert config.generator.concurrency == 32 - 4 - 1
