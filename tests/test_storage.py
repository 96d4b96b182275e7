"""Storage through pyarrow.fs: local paths and s3:// on a real S3-compatible server on loopback."""

import json
import os
import subprocess
import sys

import pyarrow as pa

from tests.conftest import DEMO_CORPUS, DEMO_QA
from wbrag_ray.index.faiss_index import INDEX_FILE, MANIFEST
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import resolve


def _roundtrip(root):
    loc = resolve(root)
    loc.join("a", "x.json").write_json({"k": 1})
    assert loc.join("a", "x.json").exists() and loc.join("a", "x.json").read_json() == {"k": 1}
    loc.join("a", "t.parquet").write_table(pa.table({"id": [1, 2]}))
    assert loc.join("a").read_table()["id"].to_pylist() == [1, 2]
    assert [f.name for f in loc.join("a").list_files()] == ["t.parquet", "x.json"]
    loc.join("a", "x.json").delete()
    assert not loc.join("a", "x.json").exists()


def test_local_roundtrip(tmp_path):
    _roundtrip(str(tmp_path / "root"))


def test_s3_roundtrip(s3_env):
    _roundtrip("s3://wbrag/storage-test")
    assert resolve("s3://wbrag/storage-test").uri == "s3://wbrag/storage-test"


def _wbrag(args, env, timeout=600):
    return subprocess.run([sys.executable, "-m", "wbrag_ray.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_model_folder_travels_to_s3_and_back_to_a_local_copy(s3_env, tmp_path, monkeypatch):
    """Adapters and pruners are trained into a local folder, uploaded to the run folder, and loaded on any node
    from a local copy; a folder rewritten in place (retrained with --force) is copied again."""
    monkeypatch.setenv("WBRAG_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "adapter"
    (src / "sub").mkdir(parents=True)
    (src / "adapter_config.json").write_text("{}")
    (src / "sub" / "weights.bin").write_bytes(b"v1")
    loc = resolve("s3://wbrag/models/adapter")
    loc.upload_dir(src)
    first = loc.local_dir()
    assert open(os.path.join(first, "sub", "weights.bin"), "rb").read() == b"v1"
    assert loc.local_dir() == first  # cached
    (src / "sub" / "weights.bin").write_bytes(b"version 2")
    loc.upload_dir(src)
    second = loc.local_dir()
    assert second != first and open(os.path.join(second, "sub", "weights.bin"), "rb").read() == b"version 2"


def test_whole_run_folder_on_s3(s3_env, tmp_path, tiny):
    """ingest -> embed -> index -> eval with corpus, dataset and run folder all on s3://, in a fresh process
    (the tiny models: what is checked is where everything lands)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"])
    corpus_lines = DEMO_CORPUS.read_text().splitlines()[:20]
    s3.put_object(Bucket="wbrag", Key="in/corpus.jsonl", Body="\n".join(corpus_lines).encode())
    qa = [q for q in (json.loads(x) for x in DEMO_QA.read_text().splitlines())
          if q["metadata"]["source_doc"] in {json.loads(c)["id"] for c in corpus_lines}][:3]
    s3.put_object(Bucket="wbrag", Key="in/qa.jsonl", Body="\n".join(json.dumps(q) for q in qa).encode())
    env = {**os.environ, **s3_env}
    env.pop("RAY_ADDRESS", None)
    config = tmp_path / "s3.yaml"
    config.write_text(
        "run: s3://wbrag/runs/r1\ningest:\n  corpus: s3://wbrag/in/corpus.jsonl\n  shard_bytes: 4096\n"
        + tiny.yaml(generator="  max_new_tokens: 8\n  num_cpus: 1\n  threads: 2\n",
                    embedder="  num_cpus: 1\n  threads: 2\n")
        + "eval:\n  dataset: s3://wbrag/in/qa.jsonl\n  name: qa\n  methods: [naive]\n"
    )
    out = _wbrag(["run", str(config)], env)
    errors = "\n".join(line for line in out.stderr.splitlines() if "logging_progress" not in line)
    assert out.returncode == 0, errors[-4000:]
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="wbrag", Prefix="runs/r1/")["Contents"]}
    layout = RunFolder("s3://wbrag/runs/r1").layout
    for loc in (layout.run_json, layout.stage("ingest").success, layout.stage("embed").success,
                layout.index.join(MANIFEST), layout.index.join(INDEX_FILE), layout.eval_result("qa", "naive").metrics):
        assert loc.path.removeprefix("wbrag/") in keys, loc.uri  # as the object store lists it
    run_json = layout.run_json.read_bytes().decode()
    assert s3_env["AWS_SECRET_ACCESS_KEY"] not in run_json and s3_env["AWS_ACCESS_KEY_ID"] not in run_json
    assert s3_env["AWS_SECRET_ACCESS_KEY"] not in out.stdout + out.stderr
    metrics = layout.eval_result("qa", "naive").metrics.read_json()
    assert metrics["n"] == len(qa)


def test_missing_object_store_credentials_fail_clearly(s3_server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_ENDPOINT_URL": s3_server["AWS_ENDPOINT_URL"], "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")})
    out = _wbrag(["ingest", "s3://wbrag/runs/nocreds", "--corpus", "s3://wbrag/in/corpus.jsonl"], env, timeout=120)
    assert out.returncode == 2
    assert "s3://wbrag/runs/nocreds" in out.stderr and "AWS_ACCESS_KEY_ID" in out.stderr
