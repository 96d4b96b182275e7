"""The GPU placement rules (wbrag_ray.placement.gpus) on simulated inventories: one GPU, two H200s (the WriteBack-RAG
paper's), one node of 8 and 4 nodes of 8 (the paper configs'). No GPU is used: every rule is a function of the
nodes' GPU counts and a GPU's memory, as the commands apply them to Ray's nodes and `wbrag plan` to the stated
cluster; the plan of each paper config on each shape is checked end to end through `make_plan`."""

import itertools

import pytest

from wbrag_ray.config import ConfigError, load_config
from wbrag_ray.index.gpu_clone import GPU_TEMP_MEMORY_BYTES
from wbrag_ray.models.size import model_size
from wbrag_ray.placement.gpus import (
    RetrievalActors,
    apply_gpu_layout,
    best_fit_node,
    gpu_layout,
    gpu_memory_of,
    index_on_gpu,
    retrieval_node,
    retrieval_waits_for_engine,
    share_capacity,
    share_of,
    tensor_parallel_auto,
)

PAPER_WRITEBACK = "jobs/configs/paper_writeback.yaml"
PAPER_ZERO_RAG = "jobs/configs/paper_zero_rag.yaml"
SHAPES = {"1x1 H100": (1, 1, 80.0), "1x2 H200": (1, 2, 141.0), "1x8 H100": (1, 8, 80.0), "4x8 H100": (4, 8, 80.0)}
RETRIEVAL = [RetrievalActors("search actor", 1, 3.3), RetrievalActors("query embedder", 1, 0.3)]


def test_tensor_parallel_sizes_vllm_can_shard_divide_the_heads_or_replicate_the_kv_heads():
    assert model_size("meta-llama/Llama-3.3-70B-Instruct").tensor_parallel_sizes(8) == [1, 2, 4, 8]
    assert model_size("bundled:smollm2").tensor_parallel_sizes(8) == [1, 3]  # 9 heads, 3 KV heads: 2 splits neither
    assert model_size("google/gemma-3-270m").tensor_parallel_sizes(8) == [1, 2, 4]  # one KV head, repeated


def test_tensor_parallel_auto_is_the_fewest_gpus_of_a_node_that_hold_a_70b_and_its_kv_cache():
    llama70 = model_size("meta-llama/Llama-3.3-70B-Instruct")
    assert tensor_parallel_auto(llama70, [2], 141.0, 0.85, 64, 1032) == 2  # two H200s hold 141 GB of weights
    assert tensor_parallel_auto(llama70, [8], 80.0, 0.85, 64, 1032) == 4
    assert tensor_parallel_auto(model_size("meta-llama/Llama-3.1-8B-Instruct"), [1], 80.0, 0.85, 64, 1032) == 1
    with pytest.raises(ConfigError, match=r"^generator.tensor_parallel_size auto: .* needs 141 GB of bf16 weights .*"
                                          r"4 GPUs of one node of 80 GB .* the largest node has 1 GPU"):
        tensor_parallel_auto(llama70, [1], 80.0, 0.85, 64, 1032)


def test_retrieval_takes_whole_gpus_only_where_that_costs_at_most_one_replica_in_eight():
    """4 x 8 keeps the paper configs' layout (a whole GPU each; 30 one-GPU replicas, or 7 of 8 four-GPU ones);
    every smaller shape gives retrieval shares beside every replica, which then asks for what they leave."""
    whole = gpu_layout([8] * 4, 80.0, 1, None, RETRIEVAL, 0.85)
    assert whole.whole and whole.replicas == 30 and whole.shares == (1.0, 1.0)
    assert gpu_layout([8] * 4, 80.0, 4, None, RETRIEVAL, 0.85).replicas == 7
    for nodes, group, replicas in (([1], 1, 1), ([2], 1, 2), ([8], 1, 8), ([8], 4, 2), ([2], 2, 1)):
        layout = gpu_layout(nodes, 80.0, group, None, RETRIEVAL, 0.85)
        assert not layout.whole and layout.replicas == replicas, (nodes, group, layout)
        assert layout.shares == (share_of(3.3, 80.0), share_of(0.3, 80.0)) == (0.06, 0.02)
        # the shares fit beside the replicas on the GPUs, and vLLM leaves them their memory
        assert layout.replica_gpu + max(layout.shares) <= 1.0 + 1e-9
        assert layout.utilization <= layout.replica_gpu
    one = gpu_layout([1], 80.0, 1, None, RETRIEVAL, 0.85)
    assert one.replica_gpu == pytest.approx(0.92)  # both shares on the one GPU


def _ray_best_fit(asks, free):
    """Ray's placement of fractional GPU asks, simulated: one at a time in start order, each on the GPU with the least
    room that holds it; the room left on each GPU, or None where an ask finds none (it would wait forever)."""
    free = list(free)
    for ask in asks:
        fits = [i for i, room in enumerate(free) if room + 1e-9 >= ask]
        if not fits:
            return None
        free[min(fits, key=free.__getitem__)] -= ask
    return free


@pytest.mark.parametrize("nodes, retrieval", [
    ([2], [RetrievalActors("search actor", 2, 3.3), RetrievalActors("query embedder", 2, 2.1)]),
    ([8], [RetrievalActors("search actor", 5, 3.3), RetrievalActors("query embedder", 3, 2.1)]),
    ([4, 4], [RetrievalActors("search actor", 4, 7.0), RetrievalActors("query embedder", 3, 0.3)]),
    ([1], RETRIEVAL),
])
def test_retrieval_shares_fit_what_the_replicas_leave_in_every_order_ray_may_place_them(nodes, retrieval):
    """Fault 6 of issue 74, on simulated inventories: Ray places each fractional ask best-fit as it starts, not the
    largest first; what each replica leaves on its GPU holds the shares in every start order, no GPU over."""
    layout = gpu_layout(nodes, 80.0, 1, None, retrieval, 0.85)
    assert not layout.whole
    asks = [s for r, s in zip(retrieval, layout.shares, strict=True) for _ in range(r.count)]
    left = round(1.0 - layout.replica_gpu, 4)
    for order in set(itertools.permutations(asks)):
        assert _ray_best_fit(order, [left] * max(nodes)) is not None, (nodes, order, left)


def test_first_fit_decreasing_room_strands_a_share_when_ray_places_the_small_ones_first():
    """0.04, 0.04, 0.06, 0.06 on two GPUs: first fit decreasing fits them in 0.10 each; Ray, given the 0.04s first,
    puts both on one GPU and leaves the second 0.06 no room. The rule leaves 0.13: (0.14 of the others) / 2 + 0.06,
    room for each ask whichever GPUs with room Ray picks for the rest."""
    assert _ray_best_fit((0.06, 0.06, 0.04, 0.04), [0.10, 0.10]) is not None
    assert _ray_best_fit((0.04, 0.04, 0.06, 0.06), [0.10, 0.10]) is None
    assert share_capacity([0.04, 0.04, 0.06, 0.06], 2) == 0.13
    retrieval = [RetrievalActors("search actor", 2, 3.3), RetrievalActors("query embedder", 2, 2.1)]
    assert gpu_layout([2], 80.0, 1, None, retrieval, 0.85).replica_gpu == pytest.approx(0.87)


def test_retrieval_too_large_for_a_share_runs_on_cpus_or_is_refused_where_gpu_search_was_demanded():
    huge = [RetrievalActors("search actor", 1, 40.0)]
    layout = gpu_layout([1], 80.0, 1, None, huge, 0.85)
    assert layout.shares == (0.0,) and "retrieval on CPUs" in layout.why
    with pytest.raises(ConfigError, match="set index.gpu: auto"):
        gpu_layout([1], 80.0, 1, None, huge, 0.85, on_cpus_ok=False)


def test_retrievals_whole_gpus_go_to_the_node_where_they_break_the_fewest_tensor_parallel_groups():
    """Defect 3 of issue 66: spread over nodes by Ray's default scheduler, 3 search / embedder GPUs on 4 x 8 with
    4-GPU replicas left 4 whole groups, not the 7 counted; on one node they cost one group."""
    assert retrieval_node([8, 8, 8, 8], 4, 3) == 0
    assert retrieval_node([8, 7, 8], 4, 3) == 1  # 3 of 7 GPUs leave its one group whole: nothing lost
    assert retrieval_node([2, 2], 4, 3) is None
    # at run time, each retrieval actor starts on the node with the fewest free GPUs that hold it: after 7 replicas
    # of 4 GPUs on 4 x 8, the node with 4 free; on a fresh cluster the search actor's node, then the embedder's too
    assert best_fit_node({"a": 0.0, "b": 4.0, "c": 0.0, "d": 0.0}, 1.0) == "b"
    assert best_fit_node({"a": 8.0, "b": 7.0, "c": 8.0}, 1.0) == "b"
    assert best_fit_node({"a": 0.5}, 1.0) is None


def test_index_gpu_true_without_a_gpu_search_is_refused_and_auto_says_cpus():
    """Defect 6 of issue 66: a run that asked for GPU search no longer runs at CPU speed without a word."""
    assert index_on_gpu("auto", 0, False) is False and index_on_gpu("auto", 8, True) is True
    assert index_on_gpu(False, 8, True) is False
    with pytest.raises(ConfigError, match=r"^index.gpu: true, but the cluster has no GPU; set index.gpu: auto"):
        index_on_gpu(True, 0, True)
    with pytest.raises(ConfigError, match=r"this faiss has no GPU support"):
        index_on_gpu(True, 8, False)


def test_a_search_actors_share_counts_the_scratch_memory_its_faiss_gpu_resources_are_capped_at():
    """Fault 3 of issue 74: faiss's default GPU resources reserved about 1.5 GiB beside the shards, outside the
    search actor's share; it makes its own, scratch capped at GPU_TEMP_MEMORY_BYTES, and its share counts that."""
    from wbrag_ray.placement.gpus import _restore_layout

    config = load_config(PAPER_WRITEBACK)
    _restore_layout(config)
    apply_gpu_layout(config, [{"CPU": 32.0, "GPU": 1.0}], (1, 3.3e9), 80.0)
    assert config.retrieval.search_gpus == share_of(3.3 + GPU_TEMP_MEMORY_BYTES / 1e9, 80.0) == 0.07
    assert share_of(3.3, 80.0) == 0.06  # the shards and a CUDA context alone


def test_gpu_memory_comes_from_the_setting_or_the_gpu_model_ray_labels_the_nodes_with():
    assert gpu_memory_of([{"GPU": 2.0, "accelerator_type:H200": 1.0}], None) == (141.0, "the nodes' accelerator_type H200")
    assert gpu_memory_of([{"GPU": 2.0}], 40.0)[0] == 40.0
    assert gpu_memory_of([{"GPU": 2.0}], None)[0] == 80.0


def test_applying_the_layout_sets_the_replicas_share_and_vllms_memory_and_decides_again():
    from wbrag_ray.placement.gpus import _restore_layout

    config = load_config(PAPER_ZERO_RAG)
    nodes = [{"CPU": 96.0, "GPU": 2.0}]
    _restore_layout(config)
    said, layout = apply_gpu_layout(config, nodes, (2, 9.5e9), 141.0)
    assert not layout.whole and layout.replicas == 1
    g, r = config.generator, config.retrieval
    assert (g.tensor_parallel_size, g.num_gpus) == (2, 2.0) and g.gpu_share < 1
    assert 0 < r.search_gpus < 1 and 0 < r.embed_gpus < 1
    # the engine keeps its memory within its share of each GPU (a placement setting: not in vllm_engine_kwargs,
    # which would make a run resumed on another cluster's layout "made with other settings")
    from wbrag_ray.generation.vllm import VLLMGenerator

    assert "gpu_memory_utilization" not in g.vllm_engine_kwargs
    assert VLLMGenerator(g).engine_kwargs()["gpu_memory_utilization"] == pytest.approx(g.gpu_share - 0.05)
    assert any("tensor_parallel_size auto: 2" in line for line in said)
    _restore_layout(config)  # the next command decides again from what the config said
    assert g.tensor_parallel_size == "auto" and r.search_gpus == "auto" and g.gpu_share == 1.0


def _plan(config: str, shape: str):
    from wbrag_ray.placement import Cluster
    from wbrag_ray.plan import make_plan

    nodes, gpus, memory = SHAPES[shape]
    cluster = Cluster.uniform(nodes, 96.0, gpus, 1024.0, memory)
    return make_plan(load_config(config), cluster, passages=21_000_000, gpu=shape.split()[1])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_paper_writeback_places_on_every_shape_using_seven_of_every_eight_gpus(shape):
    plan = _plan(PAPER_WRITEBACK, shape)
    assert plan.places, plan.problems
    total = plan.cluster.gpus
    for stage in plan.stages:
        if stage.gpus and stage.name not in ("index",):  # the index's k-means is one task on one GPU (said)
            assert stage.gpus >= min(total, 7 / 8 * total) - 1e-9, (shape, stage.name, stage.gpus)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_paper_zero_rag_places_where_the_gpus_hold_a_70b_and_is_refused_on_one_gpu_naming_why(shape):
    plan = _plan(PAPER_ZERO_RAG, shape)
    if shape == "1x1 H100":
        assert not plan.places
        assert any("tensor_parallel_size auto" in p and "141 GB of bf16 weights" in p for p in plan.problems)
        return
    assert plan.places, plan.problems
    total = plan.cluster.gpus
    generation = [s for s in plan.stages if s.name in ("mastery", "evaluation grid")]
    for stage in generation:
        assert stage.gpus >= 7 / 8 * total - 1e-9, (shape, stage.name, stage.gpus)


def test_each_command_decides_the_layout_again_from_what_the_config_said(monkeypatch):
    """As the commands apply it (`resolve_auto_concurrency`, on Ray's nodes): the build (no index yet) and a later
    evaluation (its search actor known) on one H100, then the same config on two H200s Ray labels as such."""
    from wbrag_ray.placement import gpus

    config = load_config(PAPER_WRITEBACK)
    monkeypatch.setattr(gpus, "auto_nodes", lambda: ([{"CPU": 32.0, "GPU": 1.0}], "stated"))
    gpus.resolve_auto_concurrency(config, search=(0, 0.0))  # the build: the query embedder only
    g, r = config.generator, config.retrieval
    assert g.concurrency == 1 and g.num_gpus == pytest.approx(0.98) and r.embed_gpus == 0.02
    gpus.resolve_auto_concurrency(config, search=(1, 3.3e9))  # the evaluation: its search actor too (and its scratch)
    assert g.concurrency == 1 and g.num_gpus == pytest.approx(0.91) and (r.search_gpus, r.embed_gpus) == (0.07, 0.02)
    assert config.fingerprint()["generator"]["num_gpus"] == 1.0  # run.json records what the config said
    assert config.fingerprint()["retrieval"]["search_gpus"] == "auto"
    assert config.fingerprint()["generator"]["concurrency"] == "auto"
    zero_rag = load_config(PAPER_ZERO_RAG)
    h200 = [{"CPU": 64.0, "GPU": 2.0, "accelerator_type:H200": 1.0}]
    monkeypatch.setattr(gpus, "auto_nodes", lambda: (h200, "stated"))
    gpus.resolve_auto_concurrency(zero_rag, search=(2, 9.5e9))
    assert zero_rag.generator.parallel_sizes() == (2, 1) and zero_rag.generator.concurrency == 1
    assert zero_rag.zerorag.tune.trainer.num_workers == 2  # the FSDP tuning still takes both GPUs


def test_the_plan_refuses_a_model_shape_the_commands_refuse():
    """`wbrag plan` applies the commands' shape check (`generation.vllm.shape_refusal`: heads and key-value heads,
    context), on CPUs too: SmolLM2's 9 heads do not split over 2 vLLM CPU ranks."""
    from wbrag_ray.placement import Cluster
    from wbrag_ray.plan import make_plan

    config = load_config(overrides=["generator.backend=vllm", "generator.tensor_parallel_size=2", "eval.dataset=qa.jsonl"])
    problems = make_plan(config, Cluster.uniform(1, 2, 0, 8, 80)).problems
    assert any(p.startswith("generator.tensor_parallel_size=2 cannot shard") and "choose one of 1, 3, 9" in p
               for p in problems)


@pytest.mark.parametrize("generator, retrieval_gpus, waits", [
    ({"backend": "vllm", "num_gpus": 1}, 0.25, True),  # a share beside the replica: after its profiling
    ({"backend": "vllm", "num_gpus": 1}, 0.0, False),  # retrieval on CPUs frees no GPU memory
    ({"backend": "vllm", "num_gpus": 0}, 0.25, False),  # vLLM's CPU build profiles no GPU
    ({"backend": "hf", "num_gpus": 1}, 0.25, False),  # hf does not profile
    # a KV cache sized by bytes: vLLM skips the profiling, nothing to upset
    ({"backend": "vllm", "num_gpus": 1, "vllm_engine_kwargs": {"kv_cache_memory_bytes": 8 << 30}}, 0.25, False),
])
def test_gpu_retrieval_beside_a_vllm_engine_waits_for_its_memory_profiling(generator, retrieval_gpus, waits):
    config = load_config(extra={"generator": generator})
    assert retrieval_waits_for_engine(config.generator, retrieval_gpus) is waits


class _Stop(Exception):
    pass


@pytest.mark.parametrize("index_gpu, embed_gpus, waits", [
    (True, None, True),  # the search actors' shares beside the engine
    (False, 0.1, True),  # the query embedders' shares beside the engine
    (False, None, False),  # retrieval on CPUs: no wait, the engine loads while the questions are searched
])
def test_an_answer_pass_searches_on_gpus_only_once_the_vllm_engine_is_ready_stand_in_passes_and_search(
        index_gpu, embed_gpus, waits):
    """`rag.answer` itself, with stand-ins for the generator service and the search (no GPU here): it starts the
    engine, and where GPU retrieval shares its GPUs waits for it to be ready before searching."""
    import pyarrow as pa

    from wbrag_ray import rag

    events: list[str] = []

    class Passes:
        services = None

        def start(self):
            events.append("start")

        def wait_ready(self):
            events.append("ready")

    class Search:
        def search(self, frame, services=None):
            events.append("search")
            raise _Stop

    questions = pa.table({"id": ["q"], "question": ["Who?"], "golden_answers": [["x"]]})
    config = load_config(extra={"generator": {"backend": "vllm", "num_gpus": 1}, "index": {"gpu": index_gpu},
                                "retrieval": {"search_gpus": 0.25, "embed_gpus": embed_gpus}})
    with pytest.raises(_Stop):
        rag.answer(questions, ["naive"], config, Search(), Passes())
    assert events == (["start", "ready", "search"] if waits else ["start", "search"])
