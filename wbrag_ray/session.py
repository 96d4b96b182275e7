"""A command's session: its run folder opened, its config bound to it, and Ray joined with the config's "auto"
settings decided on the cluster. What every command of `api` does before work, and what `--calibrate` does to time
the run's own stages in a run folder of its own (`plan.calibrate`), below both so neither imports the other."""

from __future__ import annotations

import os

from wbrag_ray.cluster_nodes import has_auto, needs_layout, resolve_auto_concurrency
from wbrag_ray.config import WbragConfig
from wbrag_ray.gpu_layout import index_on_gpu
from wbrag_ray.index.gpu_clone import faiss_has_gpu
from wbrag_ray.ray_runtime import check_model_paths, init_ray
from wbrag_ray.run import RunFolder

RunLike = str | os.PathLike[str] | RunFolder


def open_run(run: RunLike) -> RunFolder:
    return run if isinstance(run, RunFolder) else RunFolder(str(run))


def start(run: RunLike, config: WbragConfig, force: bool = False) -> RunFolder:
    """Bind `config` to the run folder (refused when a built stage was made with another, unless `force`; recorded
    in run.json once a stage runs with it) and join or start Ray."""
    from wbrag_ray.build_kb import KB_STAGES
    run = open_run(run)
    run.bind_config(config, force=force, guard=KB_STAGES, record="when_a_stage_runs")
    join_ray(run, config)
    return run


def join_ray(run: RunFolder, config: WbragConfig) -> None:
    """Join or start Ray (`config.ray`); on a cluster of several machines, refuse a local run folder or model path
    the other nodes cannot read, before any work; each "auto" count (`concurrency`, a training's `num_workers`)
    decided on the cluster by every command, after what the commands before it built: the index's search actors,
    whose GPUs the generator leaves to them (`cluster_nodes.resolve_auto_concurrency`)."""
    check_model_shapes(config)
    init_ray(config.ray, run.uri)
    check_model_paths(config)
    import ray

    # index.gpu: true where no GPU search can run: refused before any work (auto: CPUs, said where it searches)
    index_on_gpu(config.index.gpu, ray.cluster_resources().get("GPU", 0), faiss_has_gpu())
    if has_auto(config) or needs_layout(config):
        from wbrag_ray.retrieval.service import search_actors

        resolve_auto_concurrency(config, search=search_actors(run.layout.index.uri, config.index, config.retrieval))


def check_model_shapes(config: WbragConfig) -> None:
    """The generators' models against their engines' settings (tensor-parallel size and heads, context), before
    Ray starts (`generation.vllm.check_shape`)."""
    from wbrag_ray.generation.vllm import check_shape

    check_shape(config.generator)
    if config.zerorag.qa_generator is not None:
        check_shape(config.zerorag.qa_generator, "zerorag.qa_generator")
