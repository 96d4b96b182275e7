"""Deployment files: no Docker engine or Kubernetes here, so check what can be checked by reading them."""

import re
from pathlib import Path

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
