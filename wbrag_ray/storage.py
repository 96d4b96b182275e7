"""All file access goes through pyarrow.fs, so a run folder or a corpus can be local or on s3://.

S3 endpoint and credentials come from the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...);
they are never written into a run folder.

Over 400 lines (about 430), not split: the one `Location` type and what every write through it goes through
(fencing by the run folder's lease, storage refusing a write as one error naming the path, temp-then-move), with
the node cache and the mount checks that decide whether a local path is shared.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import posixpath
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from wbrag_ray.config import ConfigError


@functools.cache
def _check_s3_credentials(env_key: tuple) -> None:
    """Refuse early, with the fix, when no AWS credentials can be found (env, profile files, instance role):
    S3-compatible servers may otherwise accept anonymous requests, or fail later with an opaque error."""
    import boto3

    if boto3.session.Session().get_credentials() is None:
        raise ConfigError(
            "no object-store credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE, or run with an instance role); for an S3-compatible server also set AWS_ENDPOINT_URL"
        )


def s3_endpoint() -> str | None:
    """The S3-compatible server to use instead of AWS's own (MinIO, a loopback server), from the AWS variables."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def s3_region() -> str | None:
    """The region the S3 client is given: pyarrow's client asks us-east-1 without one, and a bucket elsewhere
    answers with a redirect error."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")


def _s3_filesystem() -> pafs.S3FileSystem:
    _check_s3_credentials(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    endpoint = s3_endpoint()
    kwargs: dict[str, Any] = {}
    if endpoint:
        scheme = "https" if endpoint.startswith("https://") else "http"
        kwargs["endpoint_override"] = endpoint.split("://", 1)[-1]
        kwargs["scheme"] = scheme
    region = s3_region()
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs)


def s3_client():
    """A boto3 S3 client on the same endpoint and region, for what pyarrow.fs lacks (conditional puts, copies of
    objects past 5 GB); one per process and set of AWS variables (a client takes about 0.1 s to make)."""
    return _s3_client(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))


@functools.cache
def _s3_client(env_key: tuple):
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint(), region_name=s3_region())


class StorageError(OSError):
    """Storage refused a write (a full disk, no permission, a read-only mount, an object store that refuses it): one
    line naming the path and the error."""


# What a store answers when it refuses a write, as errno values and as the words of messages that carry none
# (pyarrow's "[errno 28] ...", botocore's AccessDenied)
_REFUSED_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
_REFUSED_WORDS = ("no space left", "disk quota", "read-only file system", "permission denied", "access denied", "access_denied",
                  "accessdenied", "file too large", "quotaexceeded")


def refused_write(exc: BaseException | None, _seen: set[int] | None = None) -> str | None:
    """The reason, in one line, where `exc` (or what it wraps: Ray keeps a task's error as `cause`) is storage
    refusing a write; None for any other error. The innermost error says it best (Ray's wrapper repeats it)."""
    seen = set() if _seen is None else _seen
    if exc is None or id(exc) in seen:
        return None
    seen.add(id(exc))
    if isinstance(exc, StorageError):
        return str(exc)
    cause = getattr(exc, "cause", None)
    for inner in (cause if isinstance(cause, BaseException) else None, exc.__cause__, exc.__context__):
        reason = refused_write(inner, seen)
        if reason is not None:
            return reason
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    if isinstance(exc, OSError) and (exc.errno in _REFUSED_ERRNOS or any(w in text.lower() for w in _REFUSED_WORDS)):
        return exc.strerror if exc.strerror and exc.errno in _REFUSED_ERRNOS else text
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))  # botocore's errors (boto3 copies)
    if code and any(w in code.lower() for w in _REFUSED_WORDS):
        return text
    return None


@contextlib.contextmanager
def refused_writes(loc: Location) -> Iterator[None]:
    """Storage refusing a write below `loc` becomes one `StorageError` naming it (the original is its cause)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        reason = refused_write(exc)
        if reason is None:
            raise
        raise StorageError(f"cannot write {loc.uri}: {reason}") from exc


def writer_suffix() -> str:
    """A part of a temporary name that is this writer's own (its process and a random tag): two writers of one
    file never write into, or move away, each other's temporary file."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


# Fencing: while a command holds a run folder's lease (`lease.py`), every write below the folder asks the lease first
# (run folder URI -> the check), so a command whose lease another took stops before its next write.
_WRITE_GUARDS: dict[str, Callable[[Location], None]] = {}


def guard_writes(root: Location, check: Callable[[Location], None] | None) -> None:
    """Run `check(location)` before every write (and delete) below `root` made through a `Location` of this
    process; None ends it. `check` raises to refuse the write."""
    if check is None:
        _WRITE_GUARDS.pop(root.uri.rstrip("/"), None)
    else:
        _WRITE_GUARDS[root.uri.rstrip("/")] = check


def before_write(loc: Location) -> None:
    """The guard of the leased folder holding `loc`, if any (`guard_writes`)."""
    for root, check in list(_WRITE_GUARDS.items()):
        if loc.uri == root or loc.uri.startswith(root + "/"):
            check(loc)


@dataclass(frozen=True)
class Location:
    """A filesystem and a path inside it; `uri` is what users typed and what goes into manifests."""

    fs: pafs.FileSystem
    path: str
    uri: str

    def join(self, *parts: str) -> Location:
        path = posixpath.join(self.path, *parts)
        uri = posixpath.join(self.uri, *parts)
        return Location(self.fs, path, uri)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def exists(self) -> bool:
        return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.fs.get_file_info(self.path).type == pafs.FileType.File

    def size(self) -> int:
        return self.fs.get_file_info(self.path).size

    def mkdir(self) -> None:
        if self.is_local:
            self.fs.create_dir(self.path, recursive=True)
        # object stores have no directories: nothing to create

    def list_files(self, suffix: str = "") -> list[Location]:
        """Files directly below this folder (sorted by name), or [self] when this is a file."""
        info = self.fs.get_file_info(self.path)
        if info.type == pafs.FileType.File:
            return [self]
        if info.type == pafs.FileType.NotFound:
            return []
        sel = pafs.FileSelector(self.path, recursive=False)
        names = sorted(
            i.base_name for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File and i.base_name.endswith(suffix)
        )
        return [self.join(n) for n in names if not n.startswith((".", "_"))]

    def delete(self) -> None:
        before_write(self)
        info = self.fs.get_file_info(self.path)
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self.path)

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def write_bytes(self, data: bytes) -> None:
        with self.open_write() as f:
            f.write(data)

    @contextlib.contextmanager
    def open_write(self) -> Iterator[pa.NativeFile]:
        """An output stream for writing this file in pieces (large files that should not be built in memory)."""
        before_write(self)
        parent = self.parent()
        # Write to a temporary name, then move: a reader never sees half a file (local disks; S3 PUTs are atomic).
        # The name is this writer's own (a hidden name, so folder listings skip it): two writers of one file never
        # write into, or move away, each other's temporary file; the last move wins whole. Storage that refuses
        # the write (a full disk) leaves nothing, and is one error naming this file (`StorageError`).
        tmp = posixpath.join(parent.path, f".{self.name}.{writer_suffix()}.tmp")
        with refused_writes(self):
            parent.mkdir()
            try:
                # On S3 too: pyarrow's output stream completes its upload when closed, also by an exception, so a
                # write cut short would replace the object; the temporary object is copied in place by the server.
                with self.fs.open_output_stream(tmp) as f:
                    yield f
                if self.is_local:
                    self.fs.move(tmp, self.path)
                else:
                    bucket, key = self.path.split("/", 1)
                    s3_client().copy({"Bucket": bucket, "Key": tmp.split("/", 1)[1]}, bucket, key)  # multipart past 5 GB
            finally:
                if self.fs.get_file_info(tmp).type != pafs.FileType.NotFound:  # nothing left behind
                    self.fs.delete_file(tmp)

    def replace_with(self, staged: Location) -> None:
        """Make this folder hold `staged`'s files instead of its own, and remove `staged`: on a local disk by two
        renames (the old folder moved aside first, so a reader sees the old files or the new, never a mix of
        them); on object storage by a copy."""
        before_write(self)
        if self.is_local:
            aside = posixpath.join(self.parent().path, f".{self.name}.{writer_suffix()}.old")
            if os.path.exists(self.path):
                os.rename(self.path, aside)
            os.rename(staged.path, self.path)
            if os.path.exists(aside):
                import shutil

                shutil.rmtree(aside, ignore_errors=True)
            return
        self.delete()
        pafs.copy_files(staged.path, self.path, source_filesystem=staged.fs, destination_filesystem=self.fs)
        staged.delete()

    def read_json(self) -> Any:
        return json.loads(self.read_bytes().decode("utf-8"))

    def write_json(self, obj: Any) -> None:
        self.write_bytes((json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode("utf-8"))

    def parent(self) -> Location:
        return Location(self.fs, posixpath.dirname(self.path.rstrip("/")), posixpath.dirname(self.uri.rstrip("/")))

    def num_rows(self) -> int:
        """Rows of a Parquet file, or of every Parquet file in this folder, from the footers alone."""
        return sum(pq.ParquetFile(f.path, filesystem=f.fs).metadata.num_rows for f in self.list_files(".parquet"))

    def read_table(self, columns: list[str] | None = None) -> pa.Table:
        files = self.list_files(".parquet")
        if not files:
            raise FileNotFoundError(f"no Parquet files at {self.uri}")
        return pa.concat_tables(pq.read_table(f.path, filesystem=f.fs, columns=columns) for f in files)

    def write_table(self, table: pa.Table) -> None:
        """Write a Parquet file whole or not at all (`open_write`): a full disk leaves no truncated file."""
        with self.open_write() as f:
            pq.write_table(table, f)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    def upload_dir(self, local: str | os.PathLike[str]) -> None:
        """Copy a local folder (a trained adapter, a model) to this location, replacing what was there."""
        self.delete()
        with refused_writes(self):
            self.mkdir()
            pafs.copy_files(str(local), self.path, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=self.fs)

    def local_dir(self) -> str:
        """A local path holding this folder's files: the folder itself on local disk, else a cached download
        (libraries such as peft and transformers load models only from local paths)."""
        if self.is_local:
            return self.path
        import hashlib

        # Keyed by the files' names, sizes and times too: a folder rewritten in place (an adapter retrained with
        # --force) gets a fresh copy instead of the stale one.
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True))
        listing = sorted((i.path, i.size, i.mtime_ns) for i in infos if i.type == pafs.FileType.File)
        key = hashlib.sha1(repr((self.uri, listing)).encode()).hexdigest()[:16]

        def fetch(tmp: str) -> None:
            os.makedirs(tmp, exist_ok=True)  # copy_files makes subfolders, not the folder of top-level files
            pafs.copy_files(self.path, tmp, source_filesystem=self.fs, destination_filesystem=pafs.LocalFileSystem())

        return node_cached(os.path.join(cache_root(), "remote", key), fetch)


def cache_root() -> str:
    """This node's cache folder (`WBRAG_CACHE`, default ~/.cache/wbrag): fetched models, adapters and document
    files, converted GGUF models."""
    return os.path.expanduser(os.environ.get("WBRAG_CACHE", "~/.cache/wbrag"))


def node_cached(dest: str, build: Callable[[str], None]) -> str:
    """`dest`, made by `build(tmp)` once per node: the first process to need it builds it into a temporary
    path and renames it into place; the others on the node (a service's replicas, the tasks of a pass) wait on
    a file lock meanwhile instead of fetching or converting the same files beside it. A build that fails
    leaves nothing at `dest`, and the next process to need it tries again."""
    import fcntl
    import hashlib
    import shutil
    import tempfile

    if os.path.exists(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    # Lock files live apart from the cache (its folders list only what it holds) and are kept: removing one
    # that another process has open would let a third lock a new file beside it.
    locks = os.path.join(tempfile.gettempdir(), "wbrag-locks")
    os.makedirs(locks, exist_ok=True)
    with open(os.path.join(locks, hashlib.sha1(os.path.abspath(dest).encode()).hexdigest()[:20] + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if not os.path.exists(dest):
            tmp = f"{dest}.tmp{os.getpid()}"
            try:
                build(tmp)
                os.rename(tmp, dest)  # under the lock: nothing is at dest yet
            finally:
                if os.path.isdir(tmp):
                    shutil.rmtree(tmp, ignore_errors=True)
                elif os.path.exists(tmp):
                    os.remove(tmp)
    return dest


def node_local_dir(uri: str | os.PathLike[str]) -> str:
    """The folder at `uri` (a local path or s3://...) as a path on this node, for loaders that read only local
    files (peft, transformers): remote folders are fetched into this node's cache (`WBRAG_CACHE`).

    Call it where the files are used (in the Ray worker that loads them), and hand workers the URI, never the
    result: a path in the driver's cache does not exist on another node."""
    loc = resolve(uri)
    if loc.is_local and not os.path.exists(loc.path):
        import socket

        raise ConfigError(
            f"{loc.uri} does not exist on node {socket.gethostname()}: on a cluster, a local path must be on a "
            "filesystem every node mounts at the same path; or put the folder on object storage (s3://...)"
        )
    return loc.local_dir()


# Filesystem types whose folders other machines can mount too (network and cluster filesystems). A FUSE mount
# ("fuse.<driver>": s3fs, gcsfuse, juicefs, mountpoint-s3, sshfs, ...) counts as shared unless its driver is
# one of the machine-local ones below.
SHARED_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "ocfs2", "gfs2",
    "afs", "wekafs", "panfs", "orangefs", "pvfs2", "cvfs", "quobyte", "fuse",
})
LOCAL_FUSE = frozenset({"fuse.lxcfs", "fuse.fuse-overlayfs", "fuse.gvfsd-fuse", "fuse.portal", "fuse.snapfuse",
                        "fuse.squashfuse", "fuse.xdg-document-portal", "fuse.appimagelauncherfs"})


def _unescape_mount(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash in paths as octal escapes (\\040 ...)."""
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str, mounts: str | None = None) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the mount holding local `path` (which need not exist yet), from
    `mounts` (the text of /proc/mounts; read from this machine when None); None where it cannot be read."""
    if mounts is None:
        try:
            with open("/proc/mounts") as f:
                mounts = f.read()
        except OSError:
            return None
    real = os.path.realpath(path)
    best: tuple[str, str] | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point, fstype = _unescape_mount(fields[1]), fields[2]
        inside = point == "/" or real == point or real.startswith(point.rstrip("/") + "/")
        # the longest mount point wins; among equal ones the later line (a mount over a mount)
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fstype)
    return best


def is_shared_filesystem(fstype: str) -> bool:
    """Whether a filesystem of this type (as /proc/mounts names it) may be mounted by other machines too."""
    if fstype in LOCAL_FUSE:
        return False
    return fstype in SHARED_FILESYSTEMS or fstype.startswith("fuse.")


def resolve(uri: str | os.PathLike[str]) -> Location:
    """Resolve a local path or a URI (s3://bucket/prefix, file://...) into a Location."""
    uri = str(uri)
    if uri.startswith("s3://"):
        try:
            fs = _s3_filesystem()
        except ConfigError as exc:
            raise ConfigError(f"cannot access {uri}: {exc}") from None
        return Location(fs, uri[len("s3://") :].rstrip("/"), uri.rstrip("/"))
    if "://" in uri and not uri.startswith("file://"):
        fs, path = pafs.FileSystem.from_uri(uri)
        return Location(fs, path, uri)
    path = os.path.abspath(uri[len("file://") :] if uri.startswith("file://") else uri)
    return Location(pafs.LocalFileSystem(), path, path)
