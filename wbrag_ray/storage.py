"""All file access goes through pyarrow.fs, so a run folder or a corpus can be local or on s3://. S3 endpoint and
credentials come from the standard AWS variables and are never written into a run folder. Over 400 lines: every
write's atomicity, refusal and lease guard live with the one `Location` that makes them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import posixpath
import re
import shutil
import signal
import socket
import tempfile
import time
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
    """Refuse early without AWS credentials: some S3 servers accept anonymous requests or fail opaquely."""
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
    """The S3 region: pyarrow asks us-east-1 without one, and a bucket elsewhere answers with a redirect error."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")


def _s3_filesystem() -> pafs.S3FileSystem:
    _check_s3_credentials(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    endpoint, region = s3_endpoint(), s3_region()
    kwargs: dict[str, Any] = {"region": region} if region else {}
    if endpoint:
        kwargs.update(endpoint_override=endpoint.split("://", 1)[-1],
                      scheme="https" if endpoint.startswith("https://") else "http")
    return pafs.S3FileSystem(**kwargs)


def s3_client():
    """A boto3 S3 client on the same endpoint, for conditional puts and copies over 5 GB (one per process)."""
    return _s3_client(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))


@functools.cache
def _s3_client(env_key: tuple):
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint(), region_name=s3_region())


class StorageError(OSError):
    """Storage refused a write: one line naming the path and the error."""


# What a store answers when it refuses a write: errno values, and words of messages that carry none
_REFUSED_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
_REFUSED_WORDS = ("no space left", "disk quota", "read-only file system", "permission denied", "access denied", "access_denied",
                  "accessdenied", "file too large", "quotaexceeded")


def refused_write(exc: BaseException | None, _seen: set[int] | None = None) -> str | None:
    """One line where `exc` (or its innermost cause) is storage refusing a write; None for any other error."""
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
    code = error_code(exc)  # botocore's errors (boto3 copies)
    if code and any(w in code.lower() for w in _REFUSED_WORDS):
        return text
    return None


def error_code(exc: BaseException) -> str:
    """The code of a botocore error ("NoSuchKey", "PreconditionFailed"); "" for any other error."""
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


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
    """A temporary-name part unique to this writer, so two writers of one file never clash."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


_WRITE_GUARDS: dict[str, Any] = {}  # fencing: leased root -> its guard (`lease.RunLease`)


def guard_writes(root: Location, guard: Any | None) -> None:
    """Run `guard.fence(location, commit)` before every write or delete below `root` in this process; None ends it."""
    if guard is None:
        _WRITE_GUARDS.pop(root.uri.rstrip("/"), None)
    else:
        _WRITE_GUARDS[root.uri.rstrip("/")] = guard


def write_guard(loc: Location) -> Any | None:
    """The guard of the leased folder holding `loc` in this process (`guard_writes`), or None."""
    return next((g for r, g in list(_WRITE_GUARDS.items()) if loc.uri == r or loc.uri.startswith(r + "/")), None)


def before_write(loc: Location, commit: bool = False) -> None:
    """The guard of the leased folder holding `loc`, if any (`guard_writes`); `commit`: a commit is next."""
    guard = write_guard(loc)
    if guard is not None:
        guard.fence(loc, commit)


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
        if self.is_local:  # object stores have no directories
            self.fs.create_dir(self.path, recursive=True)

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
        # a hidden name unique to this writer, then a move: readers never see half a file
        tmp = posixpath.join(parent.path, f".{self.name}.{writer_suffix()}.tmp")
        with refused_writes(self):
            parent.mkdir()
            try:
                # On S3 too: a stream closed by an exception completes its upload, so write aside and copy in place.
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
        """A local path holding this folder's files: itself on local disk, else a cached download."""
        if self.is_local:
            return self.path
        # keyed by names, sizes and times too: a folder rewritten in place is fetched again
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True))
        listing = sorted((i.path, i.size, i.mtime_ns) for i in infos if i.type == pafs.FileType.File)
        key = hashlib.sha1(repr((self.uri, listing)).encode()).hexdigest()[:16]

        def fetch(tmp: str) -> None:
            os.makedirs(tmp, exist_ok=True)  # copy_files makes subfolders, not the folder of top-level files
            pafs.copy_files(self.path, tmp, source_filesystem=self.fs, destination_filesystem=pafs.LocalFileSystem())

        return node_cached(os.path.join(cache_root(), "remote", key), fetch)


# --- conditional writes: create where absent, replace only the version read (the lease, a commit's pointer) ---

SETTLE_S = 1.0  # where a store has no conditional writes: the pause before a write is read back
HOST_LOCK = ".lease.lock"  # this host's lock around a local compare-and-replace (`lock_path`)
HOST_LOCK_WAIT_S = 5.0  # a replace takes milliseconds: a lock held longer is held by a stalled process


def read_versioned(loc: Location) -> tuple[bytes, Any] | None:
    """(bytes, version) of a small object, or None; the version is what `put_if` compares (an ETag, or the bytes)."""
    if loc.is_local:
        try:
            with open(loc.path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):  # below a file (`sweep` of an output that is one): none
            return None
        return data, data
    bucket, key = loc.path.split("/", 1)
    try:
        got = s3_client().get_object(Bucket=bucket, Key=key)
    except Exception as exc:  # noqa: BLE001 - botocore's errors: a missing key is None
        if error_code(exc) in ("NoSuchKey", "404"):
            return None
        raise
    return got["Body"].read(), got["ETag"]


def put_if(loc: Location, data: bytes, version: Any = None) -> bool:
    """Write `data` whole at `loc` only where nothing is (`version` None) or the version read is still there; False
    where another writer came first. Local: a hard link or a rename (atomic); S3: If-None-Match / If-Match."""
    if loc.is_local:
        tmp = posixpath.join(loc.parent().path, f".{loc.name}.{writer_suffix()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            crash_point("put-written")
            if version is None:
                try:
                    os.link(tmp, loc.path)  # fails where a file is, on any host of a shared filesystem too
                    return True
                except FileExistsError:
                    return False
            with host_lock(loc.path, HOST_LOCK, HOST_LOCK_WAIT_S):  # TimeoutError: a stalled holder
                current = read_versioned(loc)
                if current is None or current[1] != version:
                    return False
                os.rename(tmp, loc.path)  # under the lock: the version read is still there
                return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    bucket, key = loc.path.split("/", 1)
    try:
        s3_client().put_object(Bucket=bucket, Key=key, Body=data,
                               **({"IfNoneMatch": "*"} if version is None else {"IfMatch": version}))
        return True
    except Exception as exc:  # noqa: BLE001 - botocore's errors, sorted by their code
        code = error_code(exc)
        if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
            return False
        if code not in ("NotImplemented", "InvalidArgument", "InvalidRequest", "501"):
            raise
    # a store without conditional writes: write, pause, read back; the write that is there holds
    s3_client().put_object(Bucket=bucket, Key=key, Body=data)
    time.sleep(SETTLE_S)
    back = read_versioned(loc)
    return back is not None and back[0] == data


# --- committed folders: versions below a folder, readers sent to the one its pointer names -------------------

COMMIT = "_COMMIT"  # {"version": "_v<n>"}: the version of the folder readers read (a plain folder has none)
_VERSION = re.compile(r"_v(\d+)")


def crash_point(step: str) -> None:
    """Tests kill the process at a named step of a commit (WBRAG_CRASH_AT=step) to prove no kill leaves it half."""
    if os.environ.get("WBRAG_CRASH_AT") == step:
        os.kill(os.getpid(), signal.SIGKILL)


def _pointer(folder: Location) -> int | None:
    """The committed version number of `folder` (its pointer's), or None for a plain folder."""
    got = read_versioned(folder.join(COMMIT))
    try:
        match = _VERSION.fullmatch(str(json.loads(got[0])["version"])) if got else None
    except (ValueError, TypeError, KeyError):
        match = None
    return int(match.group(1)) if match else None


def committed(folder: Location) -> Location:
    """What readers of the output `folder` read: the version its pointer names (`_v<n>/<name>`), else itself."""
    current = _pointer(folder)
    return folder if current is None else folder.join(f"_v{current}", folder.name)


def versioned_root(loc: Location) -> Location:
    """The output folder of `loc`, a committed version (`F/_v<n>/<name>`) or the folder itself."""
    up = loc.parent()
    return up.parent() if _VERSION.fullmatch(up.name) and up.parent().name == loc.name else loc


def next_version(loc: Location) -> Location:
    """Where a new output of the folder of `loc` is written until `commit`: the same on every attempt, so a redo cut
    short resumes into it; hidden from readers of the committed one (a `_` name)."""
    folder = versioned_root(loc)
    current = _pointer(folder)
    return folder.join(f"_v{(current or 0) + 1}", folder.name)


def commit(version: Location) -> None:
    """Make `version` (from `next_version`) the folder's output in one atomic write of its pointer, then remove
    what the pointer no longer names; a kill at any step leaves the old output or the new one, whole."""
    folder = versioned_root(version)
    before_write(folder, commit=True)
    crash_point("commit-begin")
    old = read_versioned(folder.join(COMMIT))
    data = json.dumps({"version": version.parent().name}).encode()
    if not put_if(folder.join(COMMIT), data, None if old is None else old[1]):
        raise StorageError(f"cannot commit {folder.uri}: another writer committed it meanwhile")
    crash_point("commit-pointer-written")
    sweep(folder)


def sweep(loc: Location) -> None:
    """Remove what a commit of the folder of `loc` left behind: the plain files beside its pointer and the versions
    before the one it names (a later command finishes what a kill stopped); newer ones stay (a redo resumes them)."""
    folder = versioned_root(loc)
    current = _pointer(folder)
    if current is None:
        return
    for info in folder.fs.get_file_info(pafs.FileSelector(folder.path)):
        match = _VERSION.fullmatch(info.base_name)
        if info.base_name != COMMIT and (match is None or int(match.group(1)) < current):
            folder.join(info.base_name).delete()
            crash_point("commit-swept-one")


def cache_root() -> str:
    """This node's cache folder (`WBRAG_CACHE`, default ~/.cache/wbrag)."""
    return os.path.expanduser(os.environ.get("WBRAG_CACHE", "~/.cache/wbrag"))


def lock_path(path: str, suffix: str = ".lock") -> str:
    """This host's lock file for `path`: apart from it, and kept (removing an open one would let a third process in)."""
    locks = os.path.join(tempfile.gettempdir(), "wbrag-locks")
    os.makedirs(locks, exist_ok=True)
    return os.path.join(locks, hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:20] + suffix)


@contextlib.contextmanager
def host_lock(path: str, suffix: str = ".lock", wait_s: float | None = None) -> Iterator[None]:
    """This host's lock on `path` (`lock_path`), released at the block's end or when the process dies; waited for,
    or for at most `wait_s` seconds (then TimeoutError: a process that does not answer holds it)."""
    with open(lock_path(path, suffix), "w") as lock:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (fcntl.LOCK_NB if deadline is not None else 0))
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path} is locked by a process that does not answer (it holds {lock.name})"
                                       ) from None
                time.sleep(0.02)
        yield


def node_cached(dest: str, build: Callable[[str], None]) -> str:
    """`dest`, made by `build(tmp)` once per node under this host's lock and renamed into place."""
    if os.path.exists(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with host_lock(dest):
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
    """The folder at `uri` as a path on this node, fetched into the node cache when remote. Call it in the worker
    that loads the files: a driver's cache path does not exist on other nodes."""
    loc = resolve(uri)
    if loc.is_local and not os.path.exists(loc.path):
        raise ConfigError(
            f"{loc.uri} does not exist on node {socket.gethostname()}: on a cluster, a local path must be on a "
            "filesystem every node mounts at the same path; or put the folder on object storage (s3://...)"
        )
    return loc.local_dir()


# Filesystem types other machines can mount (network and cluster filesystems; FUSE unless machine-local).
SHARED_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "ocfs2", "gfs2",
    "afs", "wekafs", "panfs", "orangefs", "pvfs2", "cvfs", "quobyte", "fuse",
})
LOCAL_FUSE = frozenset({"fuse.lxcfs", "fuse.fuse-overlayfs", "fuse.gvfsd-fuse", "fuse.portal", "fuse.snapfuse",
                        "fuse.squashfuse", "fuse.xdg-document-portal", "fuse.appimagelauncherfs"})


def mount_of(path: str, mounts: str | None = None) -> tuple[str, str] | None:
    """(mount point, filesystem type) holding local `path`, from /proc/mounts; None where unreadable."""
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
        # /proc/mounts writes space, tab, newline and backslash in paths as octal escapes (\040 ...)
        point, fstype = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]), fields[2]
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
