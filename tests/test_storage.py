"""Storage through pyarrow.fs: local paths and s3:// on a real S3-compatible server on loopback."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest

from tests.conftest import DEMO_CORPUS, DEMO_QA
from wbrag_ray.index.files import MANIFEST
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


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_write_is_seen_whole_or_not_at_all_and_two_writers_of_one_file_never_collide(where, tmp_path, request):
    """Temp-then-move: while a write is open, readers see the old file (never a half-written one), and a write that
    fails part way leaves the old file and nothing else; two writers of one file at once (overlapping writes, as two
    commands on one run folder would) both finish, and the file is one of them whole."""
    if where == "s3":
        request.getfixturevalue("s3_env")
    root = resolve(str(tmp_path / "root") if where == "local" else "s3://wbrag/atomic-test")
    target = root.join("metrics.json")
    target.write_bytes(b"old")
    with target.open_write() as f:
        f.write(b"new, half written")
        assert target.read_bytes() == b"old"  # the reader's view until the write is complete
        assert [g.name for g in root.list_files()] == ["metrics.json"]  # and folder listings never show the half
    assert target.read_bytes() == b"new, half written"
    with pytest.raises(RuntimeError), target.open_write() as f:
        f.write(b"cut short")
        raise RuntimeError("the writer died")
    assert target.read_bytes() == b"new, half written"
    if where == "local":
        assert sorted(os.listdir(root.path)) == ["metrics.json"]  # no temporary file left behind
    first, second = target.open_write(), target.open_write()
    a, b = first.__enter__(), second.__enter__()
    a.write(b"from the first writer")
    b.write(b"from the second writer")
    second.__exit__(None, None, None)
    first.__exit__(None, None, None)  # its temporary file was its own: not truncated or moved away by the second
    assert target.read_bytes() == b"from the first writer"


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


@pytest.mark.slow
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
                layout.index.join(MANIFEST), layout.index.join("index-00000.faiss"), layout.eval_result("qa", "naive").metrics):
        assert loc.path.removeprefix("wbrag/") in keys, loc.uri  # as the object store lists it
    run_json = layout.run_json.read_bytes().decode()
    assert s3_env["AWS_SECRET_ACCESS_KEY"] not in run_json and s3_env["AWS_ACCESS_KEY_ID"] not in run_json
    assert s3_env["AWS_SECRET_ACCESS_KEY"] not in out.stdout + out.stderr
    # a quiet console: neither Ray's note on its default token auth nor Ray Data's bar of sampled Parquet files
    for noise in ("Token authentication is enabled", "Parquet dataset sampling"):
        assert noise not in out.stdout + out.stderr, noise
    metrics = layout.eval_result("qa", "naive").metrics.read_json()
    assert metrics["n"] == len(qa)


def test_missing_object_store_credentials_fail_clearly(s3_server, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_ENDPOINT_URL": s3_server["AWS_ENDPOINT_URL"], "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")})
    out = _wbrag(["ingest", "s3://wbrag/runs/nocreds", "--corpus", "s3://wbrag/in/corpus.jsonl"], env, timeout=120)
    assert out.returncode == 2
    assert "s3://wbrag/runs/nocreds" in out.stderr and "AWS_ACCESS_KEY_ID" in out.stderr


MOUNTS = """\
overlay / overlay rw,relatime,lowerdir=/var/lib/docker/l1 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
/dev/nvme0n1p1 /home ext4 rw,relatime 0 0
fs1:/export/runs /home/me/runs nfs4 rw,relatime,vers=4.2 0 0
/dev/sdb1 /home/me/runs/scratch xfs rw,relatime 0 0
s3fs /mnt/my\\040bucket fuse.s3fs rw,nosuid,nodev 0 0
JuiceFS:kb /jfs fuse.juicefs rw,relatime 0 0
lxcfs /var/lib/lxcfs fuse.lxcfs rw,nosuid,nodev 0 0
10.0.0.5@tcp:/lustre /lustre lustre rw,flock 0 0
/dev/sdc1 /data ext4 rw 0 0
//nas/share /data cifs rw 0 0
"""


def test_the_mount_of_a_path_and_whether_other_machines_share_it():
    """The longest mount point holding the path wins (a local disk mounted inside an NFS tree is local again);
    the later of two mounts on one point wins; escaped spaces are read; the path need not exist yet."""
    from wbrag_ray.storage import is_shared_filesystem, mount_of

    assert mount_of("/home/me/runs/r1/new", MOUNTS) == ("/home/me/runs", "nfs4")
    assert mount_of("/home/me/runs/scratch/r1", MOUNTS) == ("/home/me/runs/scratch", "xfs")
    assert mount_of("/home/me/runsx", MOUNTS) == ("/home", "ext4")  # a prefix of the name is not the mount
    assert mount_of("/mnt/my bucket/runs", MOUNTS) == ("/mnt/my bucket", "fuse.s3fs")
    assert mount_of("/data/run", MOUNTS) == ("/data", "cifs")
    assert mount_of("/tmp/run", MOUNTS) == ("/", "overlay")
    shared = {p: is_shared_filesystem(mount_of(p, MOUNTS)[1])
              for p in ("/home/me/runs/r", "/home/me/runs/scratch/r", "/mnt/my bucket/r", "/jfs/r", "/lustre/r",
                        "/var/lib/lxcfs/r", "/tmp/r", "/home/r", "/data/r")}
    assert shared == {"/home/me/runs/r": True, "/home/me/runs/scratch/r": False, "/mnt/my bucket/r": True,
                      "/jfs/r": True, "/lustre/r": True, "/var/lib/lxcfs/r": False, "/tmp/r": False,
                      "/home/r": False, "/data/r": True}
    for fstype in ("nfs", "gpfs", "beegfs", "ceph", "glusterfs", "fuse.gcsfuse", "fuse", "smb3"):
        assert is_shared_filesystem(fstype), fstype
    for fstype in ("ext4", "xfs", "tmpfs", "overlay", "fuseblk", "fuse.fuse-overlayfs", "zfs", "btrfs"):
        assert not is_shared_filesystem(fstype), fstype
    assert mount_of("/tmp/x") is not None  # this machine's own table


def test_a_folder_is_made_local_on_the_node_that_uses_it(s3_env, tmp_path, monkeypatch):
    """node_local_dir: a local folder as it is; an s3:// one fetched into this node's cache; a local path that
    this node does not have refused with the fix."""

    from wbrag_ray.config import ConfigError
    from wbrag_ray.storage import node_local_dir

    monkeypatch.setenv("WBRAG_CACHE", str(tmp_path / "cache"))
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    assert node_local_dir(tmp_path / "adapter") == str(tmp_path / "adapter")
    resolve("s3://wbrag/models/a2").upload_dir(tmp_path / "adapter")
    fetched = node_local_dir("s3://wbrag/models/a2")
    assert fetched.startswith(str(tmp_path / "cache")) and os.path.exists(os.path.join(fetched, "adapter_config.json"))
    with pytest.raises(ConfigError, match="does not exist on node .*s3://"):
        node_local_dir(tmp_path / "missing")


def test_a_local_run_folder_on_one_node_is_not_checked_further(ray_cluster, tmp_path, monkeypatch, caplog):
    """One alive node (the test cluster): a local run folder is accepted without looking at its mount (which
    here is made a local disk, so a check would refuse it) and without a warning; s3:// is accepted anywhere,
    without asking Ray for its nodes. The same local folder with two alive nodes is refused: the node count is
    what spared it."""

    from wbrag_ray import storage
    from wbrag_ray.config import ConfigError
    from wbrag_ray.ray_runtime import check_run_dir

    looked_at = []
    monkeypatch.setattr(storage, "mount_of", lambda path: looked_at.append(path) or ("/", "ext4"))
    monkeypatch.delenv("WBRAG_SHARED_RUN_DIR", raising=False)
    alive = [node for node in ray_cluster.nodes() if node.get("Alive")]
    assert len(alive) == 1
    asked = []
    nodes = ray_cluster.nodes
    monkeypatch.setattr(ray_cluster, "nodes", lambda: asked.append(1) or nodes())
    with caplog.at_level("WARNING"):
        check_run_dir(str(tmp_path / "run"))
        assert asked and looked_at == []
        asked.clear()
        check_run_dir("s3://wbrag/runs/anything")
        assert asked == [] and looked_at == []
    assert not [r for r in caplog.records if "run folder" in r.getMessage()]
    monkeypatch.setattr(ray_cluster, "nodes", lambda: alive * 2)
    with pytest.raises(ConfigError, match="local path, but Ray runs this command's tasks on a cluster with 2 nodes"):
        check_run_dir(str(tmp_path / "run"))
    assert looked_at == [str(tmp_path / "run")]


def _build_slowly(args):
    """A process of the node that needs `dest` (run by a multiprocessing pool)."""
    import time

    from wbrag_ray.storage import node_cached

    dest, log = args

    def build(tmp):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough for every other process to arrive while it builds
        os.makedirs(tmp)
        open(os.path.join(tmp, "weights.bin"), "w").write("converted")

    return node_cached(dest, build)


def test_a_node_builds_a_cached_folder_once_while_its_other_processes_wait(tmp_path):
    """GGUF conversions and fetched model folders: one process of a node builds them, the rest wait for it
    and read the same folder; a failed build leaves nothing behind and the next caller tries again."""
    import multiprocessing

    from wbrag_ray.storage import node_cached

    dest, log = str(tmp_path / "cache" / "converted" / "model"), str(tmp_path / "builds.log")
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        got = pool.map(_build_slowly, [(dest, log)] * 4)
    assert got == [dest] * 4 and open(os.path.join(dest, "weights.bin")).read() == "converted"
    assert len(open(log).read().split()) == 1  # built once

    def fail(tmp):
        os.makedirs(tmp)
        raise RuntimeError("disk full")

    other = str(tmp_path / "cache" / "converted" / "other")
    with pytest.raises(RuntimeError, match="disk full"):
        node_cached(other, fail)
    assert not os.path.exists(other) and not [p for p in os.listdir(os.path.dirname(other)) if ".tmp" in p]
    assert sorted(os.listdir(os.path.dirname(other))) == ["model"]  # the cache lists what it holds, no locks
    assert node_cached(other, lambda tmp: os.makedirs(tmp)) == other


def test_a_generator_loads_its_model_folder_from_object_storage(s3_env, tmp_path, monkeypatch, tiny):
    """generator.model = s3://...: the driver only checks the folder exists; the worker that loads it fetches it
    into its node's cache, and answers as the local folder does."""

    from wbrag_ray.config import ConfigError, GeneratorConfig
    from wbrag_ray.generation.backends import make_generator
    from wbrag_ray.generation.hf import HFGenerator

    monkeypatch.setenv("WBRAG_CACHE", str(tmp_path / "cache"))
    resolve("s3://wbrag/models/tiny-generator").upload_dir(tiny.generator)
    config = GeneratorConfig(model="s3://wbrag/models/tiny-generator", dtype="float32", max_new_tokens=4)
    make_generator(config)  # checked, not fetched
    assert not os.path.exists(tmp_path / "cache")
    remote, local = HFGenerator(config), HFGenerator(config.model_copy(update={"model": str(tiny.generator)}))
    remote.setup()
    local.setup()
    assert os.listdir(tmp_path / "cache" / "remote")
    messages = [[{"role": "user", "content": "Who wrote Hamlet?"}]]
    assert remote.generate(messages) == local.generate(messages)
    with pytest.raises(ConfigError, match="does not exist"):
        make_generator(config.model_copy(update={"model": "s3://wbrag/models/missing"}))


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of its own (a real full disk; mounting one needs root: skipped where it cannot be mounted),
    unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _resize(disk, size_bytes: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(disk)], check=True)


def test_an_embed_that_filled_the_disk_is_one_line_and_resumes_with_the_default_settings_on_2_cpus(small_disk, tiny,
                                                                                                  ray_cluster):
    """A real full disk (a tmpfs) during `wbrag embed`: the command ends with one line naming the folder and the
    error (exit 2, no traceback), and no file cut short stays among the embeddings. With room made, the same
    command with the default settings (a 1-CPU embed actor) resumes on the session's 2 CPUs, beside Ray Data's
    1-CPU CheckpointFilter actor: the pass narrows its actor to fit and says so, and every id is embedded once."""
    import shutil

    from tests.conftest import demo_records, joining_env, wait_idle, write_jsonl
    from wbrag_ray.checkpoints import rows_by_file
    from wbrag_ray.cli import main

    run = small_disk / "run"
    # 1,200 passages: the pass writes 3 files of about 37 KB (10 pages each) one after the other (measured)
    records = [{"id": f"{r['id']}-{k}", "contents": r["contents"]} for k in range(12) for r in demo_records()]
    corpus = write_jsonl(small_disk.parent / "corpus.jsonl", records)
    assert main(["ingest", str(run), "--corpus", str(corpus), *tiny.set_args(), "--set", "ingest.shard_bytes=32768"]) == 0
    folder = RunFolder(str(run))
    used = shutil.disk_usage(small_disk).used
    _resize(small_disk, used + 16 * 4096)  # the first file and the checkpoint's records fit, not the second
    wait_idle(ray_cluster)
    wbrag = os.path.join(os.path.dirname(sys.executable), "wbrag")
    full = subprocess.run([wbrag, "embed", str(run)], capture_output=True, text=True, timeout=600,
                          env=joining_env(ray_cluster))
    assert full.returncode == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr, full.stderr[-5000:]
    line = full.stderr.strip().splitlines()[-1]
    assert line.startswith(f"wbrag embed: storage error: cannot write {run}") and "No space left on device" in line, line
    files = folder.layout.embed.list_files(".parquet")
    assert files, "the disk filled before the first file: nothing to resume"
    assert len(rows_by_file(folder.layout.embed)) == len(files)  # every file left has its footer: none cut short
    assert not folder.is_complete("embed")

    _resize(small_disk, 64 << 20)  # room made
    wait_idle(ray_cluster)
    again = subprocess.run([wbrag, "embed", str(run)], capture_output=True, text=True, timeout=600,
                           env=joining_env(ray_cluster))
    assert again.returncode == 0, again.stderr[-3000:]
    # resumed, the default 1-CPU actor narrowed beside the filter
    assert "embedder.num_cpus 1 -> 0.75" in again.stdout, again.stdout[-3000:]
    assert "rows from the checkpoint" in again.stdout, again.stdout[-3000:]
    ids = folder.layout.embed.read_table(["pid"])["pid"].to_pylist()
    passages = folder.layout.ingest.passages.read_table(["pid"])["pid"].to_pylist()
    assert len(ids) == len(set(ids)) == len(passages) and set(ids) == set(passages)


def test_an_object_store_refusing_writes_is_one_error_naming_the_path_and_leaves_nothing(s3_env):
    """A bucket whose policy denies writes (the S3-compatible server on loopback enforces it): the write is one
    `StorageError` naming the object and the store's refusal, and no temporary object stays."""
    import boto3

    from wbrag_ray.cli import user_error
    from wbrag_ray.storage import StorageError

    s3 = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    s3.create_bucket(Bucket="read-only")
    s3.put_bucket_policy(Bucket="read-only", Policy=json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Deny", "Principal": "*", "Action": "s3:PutObject", "Resource": "arn:aws:s3:::read-only/*"}]}))
    loc = resolve("s3://read-only/run/stats.json")
    with pytest.raises(StorageError) as refused:
        loc.write_json({"rows": 1})
    message = user_error(refused.value)
    assert message.startswith("storage error: cannot write s3://read-only/run/stats.json: "), message
    assert "ACCESS_DENIED" in message, message
    assert s3.list_objects_v2(Bucket="read-only").get("KeyCount", 0) == 0
