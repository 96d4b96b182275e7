"""`wbrag doctor`: each check against what this machine really has (no GPU, faiss-cpu, a CPU torch), the flags
that make a finding fail the command, and the credential checks under environments the test sets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wbrag_ray import doctor

WBRAG = str(Path(sys.executable).with_name("wbrag"))


def _by_name(checks):
    return {c.name: c for c in checks}


def test_a_gpu_required_on_a_machine_without_one_fails_the_command_and_says_which_checks():
    assert not torch.cuda.is_available()  # this machine: the reference the expected failures rest on
    out = subprocess.run([WBRAG, "doctor", "--gpu", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is False
    # torch without CUDA, no driver, faiss without GPUs: each fails; the packages and CPUs are not GPU checks
    assert {"torch", "nvidia driver", "faiss"} <= set(report["failed"])
    assert "packages" not in report["failed"] and checks["packages"]["required"] is False
    assert torch.__version__ in checks["torch"]["detail"]
    assert "without GPU support" in checks["faiss"]["detail"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the findings below are those of a machine without a GPU")
def test_without_flags_the_same_findings_report_and_exit_zero(capsys):
    """The table, without flags and with --gpu: the same rows (this machine has no GPU: torch, the driver and faiss
    warn), "ready" and exit 0 only where no flag requires them; --gpu marks the same rows FAIL and names them."""
    out = subprocess.run([WBRAG, "doctor"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "doctor: ready"
    gpu_checks = ("torch", "nvidia driver", "faiss")

    def marks(table: list[str]) -> dict[str, str]:  # each check's row: its name, then its mark
        return {n: row[len(n):].split()[0] for row in table[:-1]
                for n in (*gpu_checks, row.split()[0]) if row.startswith(n + " ")}

    plain = marks(lines)
    assert {plain[n] for n in gpu_checks} == {"warn"}
    # --gpu on the same machine (in process: the command's own function): the same rows, those three FAIL, exit 1
    assert doctor.main(["--gpu"]) == 1
    gpu = capsys.readouterr().out.splitlines()
    assert gpu[-1].startswith("doctor: failed: ")
    assert set(gpu_checks) <= set(gpu[-1].removeprefix("doctor: failed: ").split(", "))
    assert marks(gpu).keys() == plain.keys() and {marks(gpu)[n] for n in gpu_checks} == {"FAIL"}


@pytest.fixture
def bare_env(monkeypatch, tmp_path):
    """No AWS or hub settings from this machine: none of ~/.aws, no instance metadata, an empty hub home."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return monkeypatch


def test_s3_needs_credentials_and_a_region_or_an_endpoint(bare_env):
    assert _by_name(doctor.run_checks({"s3"}))["s3 credentials"].failed
    bare_env.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    bare_env.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    check = _by_name(doctor.run_checks({"s3"}))["s3 credentials"]
    assert check.failed and "set AWS_REGION" in check.detail
    bare_env.setenv("AWS_REGION", "eu-west-1")
    check = _by_name(doctor.run_checks({"s3"}))["s3 credentials"]
    assert not check.failed and "region eu-west-1" in check.detail and "from env" in check.detail
    bare_env.delenv("AWS_REGION")
    bare_env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")  # an S3-compatible server needs no region
    assert not _by_name(doctor.run_checks({"s3"}))["s3 credentials"].failed


def test_the_hub_token_is_required_only_where_asked(bare_env):
    checks = _by_name(doctor.run_checks(set()))
    assert checks["hub token"].status == doctor.WARN and not checks["hub token"].failed
    assert _by_name(doctor.run_checks({"hf"}))["hub token"].failed
    bare_env.setenv("HF_TOKEN", "hf_example")
    check = _by_name(doctor.run_checks({"hf"}))["hub token"]
    assert not check.failed and "HF_TOKEN" in check.detail


def test_a_small_dev_shm_is_a_warning_with_the_fix(monkeypatch):
    # a container's default /dev/shm is 64 MiB; mocked here (this machine's is large)
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda path: type("U", (), {"total": 64 << 20})())
    check = doctor.check_shm()
    assert check.status == doctor.WARN and "0.1 GiB" in check.detail and "memory-backed /dev/shm" in check.detail


def test_a_check_that_raises_is_reported_as_failed_not_a_crash(monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    broken.__name__ = "check_torch"
    monkeypatch.setattr(doctor, "CHECKS", [broken])
    [check] = doctor.run_checks({"gpu"})
    assert check.name == "torch" and check.status == doctor.FAIL and check.failed
    assert "CUDA driver initialization failed" in check.detail


def test_a_config_whose_embedder_asks_for_xformers_gets_a_line_and_passes(tiny, tmp_path, monkeypatch, capsys):
    """`wbrag doctor CONFIG`: an embedder whose config asks for memory-efficient attention and unpadding, on this
    machine without xformers: ok, saying both are turned off; the paper's stella config where the hub cannot be
    reached and nothing is cached: a warning in one line, and the command still passes."""
    import huggingface_hub.constants

    model = tmp_path / "asks"
    __import__("shutil").copytree(tiny.embedder, model)
    config_json = model / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "use_memory_efficient_attention": True,
                                       "unpad_inputs": True}))
    config = tmp_path / "asks.yaml"
    config.write_text(f"embedder:\n  model: {model}\n")
    monkeypatch.setattr(doctor, "CHECKS", [])  # the node's own checks: the tests above
    check = _by_name(doctor.run_checks(set(), str(config)))["embedder"]
    assert check.status == doctor.OK and not check.failed
    assert "xformers does not import here" in check.detail and "unpad_inputs=False" in check.detail

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no hub here: fail at once, no retries
    paper = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "paper_zero_rag.yaml"
    assert doctor.main([str(paper), "--json"]) == 0
    [stella] = [doctor.Check(**c) for c in json.loads(capsys.readouterr().out)["checks"]]
    if stella.status == doctor.WARN:  # not in this machine's hub cache
        assert "\n" not in stella.detail and "NovaSearch/stella_en_400M_v5: its config cannot be read" in stella.detail
    else:
        assert "xformers" in stella.detail or "loads as its config says" in stella.detail
    assert doctor.main([str(tmp_path / "none.yaml")]) == 1
    assert "does not exist" in capsys.readouterr().out
