"""A command's session: run folder opened, config bound, Ray joined with "auto" settings decided on the cluster;
used by `api` and by `--calibrate` (below both, so neither imports the other)."""

from __future__ import annotations

import os

from wbrag_ray.build_kb import KB_STAGES
from wbrag_ray.config import GeneratorConfig, WbragConfig
from wbrag_ray.generation.vllm import check_shape
from wbrag_ray.index.gpu_clone import cluster_faiss_gpu
from wbrag_ray.placement.gpus import auto_keys, index_on_gpu, needs_layout, resolve_auto_concurrency
from wbrag_ray.ray_runtime import check_model_paths, init_ray
from wbrag_ray.retrieval.service import search_actors
from wbrag_ray.run import RunFolder

RunLike = str | os.PathLike[str] | RunFolder


def open_run(run: RunLike) -> RunFolder:
    return run if isinstance(run, RunFolder) else RunFolder(str(run))


def start(run: RunLike, config: WbragConfig, force: bool = False) -> RunFolder:
    """Bind `config` to the run folder (refused when a built stage used another, unless `force`) and join Ray."""
    run = open_run(run)
    run.bind_config(config, force=force, guard=KB_STAGES, record="when_a_stage_runs")
    join_ray(run, config)
    return run


def join_ray(run: RunFolder, config: WbragConfig) -> None:
    """Join or start Ray; on a multi-node cluster refuse paths the other nodes cannot read; decide "auto" counts."""
    check_model_shapes(config.generator, config.zerorag.qa_generator)
    init_ray(config.ray, run.uri, trains=config.zerorag.enabled)  # Zero-RAG trains its pruner and tuning
    check_model_paths(config)
    import ray  # here, not at the top: a command refused before it joins Ray never imports it

    # index.gpu: true where no GPU search can run: refused before any work (auto: CPUs, said where it searches)
    index_on_gpu(config.index.gpu, ray.cluster_resources().get("GPU", 0), cluster_faiss_gpu())
    if auto_keys(config) or needs_layout(config):
        resolve_auto_concurrency(config, search=search_actors(run.layout.index.uri, config.index, config.retrieval))


def check_model_shapes(generator: GeneratorConfig, qa_generator: GeneratorConfig | None) -> None:
    """The generators' models against their engines' settings, before Ray starts."""
    check_shape(generator)
    if qa_generator is not None:
        check_shape(qa_generator, "zerorag.qa_generator")
