"""Submit pipelines to a Ray cluster with the Ray Jobs API (submit, status, logs, stop). The project folder is
the working_dir; submission ids derive from config and run folder, so a resubmission finds the earlier job."""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any

from wbrag_ray.config import ConfigError

# What never travels to the cluster: environments, outputs, caches (the working_dir upload limit is 500 MB).
UPLOAD_EXCLUDES = [".venv", "venv", "runs", ".git", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", "*.egg-info"]
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def _auth_env() -> None:
    """Ray 2.60's `ray start` turns on token auth; the SDK then needs RAY_AUTH_MODE=token to send the token."""
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token")).expanduser()
    if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN") or token_file.exists()):
        os.environ["RAY_AUTH_MODE"] = "token"


def dashboard_url(address: str) -> str:
    """The dashboard URL (port 8265) from http(s)://..., ray://HEAD:10001, HEAD:6379, HEAD:PORT or HEAD."""
    if address.startswith(("http://", "https://")):
        return address.rstrip("/")
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.partition(":")
    if address.startswith("ray://") or not port or port == "6379":
        port = "8265"
    return f"http://{host}:{port}"


def client(address: str):
    _auth_env()  # before ray is imported: it reads the auth mode once
    from ray.job_submission import JobSubmissionClient

    url = dashboard_url(address)
    try:
        return JobSubmissionClient(url)
    except Exception as exc:  # the SDK raises ConnectionError, RuntimeError or ValueError by case
        hint = ""
        if "authentication" in str(exc).lower():
            hint = " The cluster uses token auth: set RAY_AUTH_MODE=token and the token (~/.ray/auth_token)."
        raise ConfigError(f"cannot reach the Ray Jobs API at {url}: {str(exc).splitlines()[0]}.{hint} Pass the head "
                          "node's dashboard address, e.g. --address http://HEAD:8265") from None


def submission_id(config_text: str, run: str) -> str:
    digest = hashlib.sha1(f"{run}\n{config_text}".encode()).hexdigest()[:10]
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(run.rstrip("/")).name.lower()).strip("-") or "run"
    return f"wbrag-{stem}-{digest}"


def submit(config_file: str, run: str, address: str, working_dir: str = ".", overrides: list[str] | None = None,
           wait: bool = True, force: bool = False) -> dict[str, Any]:
    """Submit `wbrag run CONFIG --run RUN` as a Ray job; return {submission_id, status}."""
    work = Path(working_dir).resolve()
    cfg = Path(config_file).resolve()
    if not cfg.is_file():
        raise ConfigError(f"config file {config_file!r} does not exist")
    try:
        rel = cfg.relative_to(work)
    except ValueError:
        raise ConfigError(f"config {cfg} is outside the uploaded working dir {work}; put it under jobs/configs/ or "
                          "pass --working-dir") from None
    c = client(address)
    sid = submission_id(cfg.read_text() + "\n".join(overrides or []), run)
    existing = _status_or_none(c, sid)
    if existing in ("PENDING", "RUNNING"):
        print(f"job {sid} is already {existing.lower()}; not submitting a second copy", flush=True)
    elif existing == "SUCCEEDED" and not force:
        print(f"job {sid} already succeeded (run folder {run}); pass --force to submit again", flush=True)
        return {"submission_id": sid, "status": existing}
    else:
        if existing is not None:  # FAILED / STOPPED: a new attempt resumes from the run folder's markers
            sid = f"{sid}-r{int(time.time())}"
        sets = " ".join(f"--set {o}" for o in overrides or [])
        entrypoint = f"python -m wbrag_ray.cli run {rel.as_posix()} --run {run} {sets}".strip()
        env_vars = {k: v for k, v in os.environ.items() if k in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")}
        # The driver only orchestrates: a CPU reserved for it (entrypoint_num_cpus) can starve a small cluster's reads.
        _submit_with_retry(c, entrypoint=entrypoint, submission_id=sid, entrypoint_num_cpus=0,
                           runtime_env={"working_dir": str(work), "excludes": UPLOAD_EXCLUDES, "env_vars": env_vars},
                           metadata={"wbrag_run": run, "wbrag_config": rel.as_posix()})
        print(f"submitted {sid}: {entrypoint}", flush=True)
    if not wait:
        print(f"follow it with: wbrag status {sid} --address {address}; wbrag logs {sid} --address {address}")
        return {"submission_id": sid, "status": _status_or_none(c, sid)}
    return {"submission_id": sid, "status": wait_for(c, sid)}


def _submit_with_retry(c, attempts: int = 30, delay_s: float = 2.0, **kwargs: Any) -> str:
    """Retry for about a minute while the job agent starts or the upload drops (a taken id: accepted)."""
    import requests

    dropped = False
    for attempt in range(attempts):
        last = attempt == attempts - 1
        try:
            return c.submit_job(**kwargs)
        except requests.exceptions.ConnectionError:
            if last:
                raise
            dropped = True
        except RuntimeError as exc:
            if dropped and "already exists" in str(exc):
                return kwargs["submission_id"]
            if "No available agent" not in str(exc) or last:
                raise
        time.sleep(delay_s)
    raise AssertionError("unreachable")


def wait_for(c, sid: str, poll_s: float = 2.0) -> str:
    """Stream the job's new log lines until it ends; return its final status."""
    printed = 0
    while True:
        status = str(c.get_job_status(sid).value)
        logs = c.get_job_logs(sid)
        if len(logs) > printed:
            print(logs[printed:], end="", flush=True)
            printed = len(logs)
        if status in TERMINAL:
            print(f"job {sid}: {status}", flush=True)
            return status
        time.sleep(poll_s)


def _status_or_none(c, sid: str) -> str | None:
    try:
        return str(c.get_job_status(sid).value)
    except Exception:  # the SDK raises RuntimeError for an unknown id
        return None


def _job(sid: str, address: str):
    """(the Jobs API client, the job's info): a clear error for an unknown id."""
    c = client(address)
    try:
        return c, c.get_job_info(sid)
    except Exception:
        raise ConfigError(f"no job {sid!r} on {dashboard_url(address)}; `ray job list` shows the ids") from None


def status(sid: str, address: str) -> dict[str, Any]:
    info = _job(sid, address)[1]
    return {"submission_id": sid, "status": str(info.status.value), "message": info.message,
            "entrypoint": info.entrypoint, "metadata": info.metadata}


def logs(sid: str, address: str) -> str:
    return _job(sid, address)[0].get_job_logs(sid)


def stop(sid: str, address: str) -> bool:
    return bool(_job(sid, address)[0].stop_job(sid))
