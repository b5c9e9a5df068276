"""Where outputs go: one small key/value interface over a local folder and S3.

Keys are POSIX-style paths relative to the storage root (``images/abc.png``). Both backends make
every write atomic — a reader sees the old object or the whole new one, never a torn file — because
exactly-once output rests on it: a retried item rewrites the same key, and a metadata part is either
committed or absent.

S3 calls survive short outages: botocore retries each request (``retry_mode``/``max_attempts``), and
on top of that connection errors and 5xx answers are retried with backoff for up to
``outage_tolerance_s`` (120 s), so that an object store restarting for a few seconds does not fail a job
that has run for hours. Before a job runs, `probe_s3` sends one request with short timeouts and no retry, so
that a mistake (no credentials, a wrong endpoint, a store that is down) is one line at once rather than minutes
of retries.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import mimetypes
import os
import random
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

log = logging.getLogger(__name__)

T = TypeVar("T")

# The monotonic time by which the calls of this context must have landed (None: the outage tolerance alone).
# A driver commits only under a lease that is good until a known time; a write retried past it could land
# after another driver took the output over (`bounded_by`, storage/job_output.py).
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("storage_deadline", default=None)


@contextlib.contextmanager
def bounded_by(seconds: float):
    """S3 calls inside stop retrying `seconds` from now (StorageError), however long the outage tolerance is."""
    token = _DEADLINE.set(time.monotonic() + max(seconds, 0.0))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


class StorageError(IOError):
    """A storage operation failed; the message names the storage root and the key."""


@dataclass(frozen=True)
class S3Options:
    """How to reach an S3-compatible store. Fields left as None fall back to the standard AWS settings.

    Credentials left as None go through boto3's own chain (environment ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, config files, instance profiles), which is what a
    cluster node with an instance profile needs. ``endpoint_url`` falls back to ``AWS_ENDPOINT_URL_S3``
    then ``AWS_ENDPOINT_URL`` (MinIO, SeaweedFS, R2); ``region`` to ``AWS_REGION`` then
    ``AWS_DEFAULT_REGION``.
    """

    endpoint_url: str | None = None
    region: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    # adaptive = standard retries plus client-side rate limiting when the store answers SlowDown.
    retry_mode: str = "adaptive"
    max_attempts: int = 10
    # Seconds of connection errors / 5xx answers tolerated per call before giving up: a store that
    # restarts (or a node whose network blips) must not fail a long job.
    outage_tolerance_s: float = 120.0

    def resolved(self) -> S3Options:
        """The options with endpoint and region filled from the environment where they were None."""
        env = os.environ
        return replace(
            self,
            endpoint_url=self.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
            region=self.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
        )


@runtime_checkable
class Storage(Protocol):
    """A flat key space under a root (a local folder or ``s3://bucket/prefix``)."""

    uri: str

    def put_bytes(self, key: str, data: bytes, content_type: str | None = None) -> None:
        """Store `data` under `key`, replacing any old object atomically."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Store `data` only if `key` does not exist yet; False (and nothing written) if it did."""

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        """Store the local file `path` under `key` (streamed, for objects too large to hold in memory);
        atomic like put_bytes. The file is consumed: it may be moved into place."""

    def get_bytes(self, key: str) -> bytes:
        """The object's bytes; StorageError naming the root and key when it is missing."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes of the object from byte `start` (one member of a tar shard, without the rest);
        StorageError when the object is missing or shorter than the range."""

    def exists(self, key: str) -> bool:
        """Whether an object is stored under `key`."""

    def list(self, prefix: str) -> list[str]:
        """Keys (relative to the root) that start with `prefix`, sorted."""

    def copy(self, src: str, dst: str) -> None:
        """Store the object `src` also under `dst` (server-side on S3: the bytes never pass through this process);
        atomic like put_bytes. StorageError when `src` is missing."""

    def delete(self, key: str) -> None:
        """Remove `key`; a missing key is not an error."""

    def uri_for(self, key: str) -> str:
        """The absolute location of `key`: a filesystem path or ``s3://bucket/prefix/key``."""


def _botocore_retries(response: object) -> int:
    """How many times botocore retried the request behind `response` (0 for non-dict results)."""
    if isinstance(response, dict):
        return int(response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)
    return 0


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in key.split("/")):
        raise StorageError(
            f"invalid storage key {key!r}: expected a relative path like 'images/x.png' without '.', '..' "
            f"or empty parts"
        )
    return key


def _check_range(key: str, start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise StorageError(f"invalid byte range of {key!r}: start {start}, length {length} (both must be >= 0)")


def _whole_range(uri: str, key: str, start: int, length: int, data: bytes) -> bytes:
    """`data` if it is the whole range asked for: a short read means the object is not what the caller's
    index says (a shard replaced or truncated), which must not pass as an image."""
    if len(data) != length:
        raise StorageError(
            f"object {key!r} in storage {uri} is shorter than the range asked for: bytes {start}..{start + length}, "
            f"got {len(data)}"
        )
    return data


# ----------------------------------------------------------------------------------------------
# Local folder


_TMP_MARK = ".tmp-"


# A claim older than this is a writer's that died between claiming and renaming (a rename's time): it is broken.
_STALE_CLAIM_S = 30.0


def _publish_exclusively(tmp: Path, path: Path) -> bool:
    """Move the complete file `tmp` to `path` unless `path` exists; whether it did. For filesystems without hard
    links: an O_EXCL create of a side name (hidden from listings like any temporary file) decides between racing
    writers, and the one that holds it checks that `path` is still absent and renames its whole file into place, so a
    reader never sees `path` half written (an O_EXCL create of `path` itself and then a write would show it empty).
    A claim left by a writer that died holding it is broken after `_STALE_CLAIM_S` (two writers breaking the same
    stale claim at once could both publish: a crash inside a rename, then a race, on such a filesystem)."""
    claim = path.with_name(f".{path.name}{_TMP_MARK}claim")
    for _ in range(2):
        try:
            os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            break
        except FileExistsError:
            if path.exists() or not _break_stale(claim):
                return False  # published already, or another writer is publishing now
    else:
        return False
    try:
        if path.exists():
            return False
        os.rename(tmp, path)
        return True
    finally:
        claim.unlink(missing_ok=True)


def _break_stale(claim: Path) -> bool:
    """Remove `claim` if its writer died holding it; whether it may be taken again."""
    try:
        if time.time() - claim.stat().st_mtime < _STALE_CLAIM_S:
            return False
        claim.unlink()
    except FileNotFoundError:
        pass  # released meanwhile
    return True


class LocalStorage:
    """A folder on a filesystem. Writes go to a temporary file beside the target, then os.replace."""

    def __init__(self, root: str | os.PathLike):
        path = Path(os.fspath(root).removeprefix("file://")).expanduser().resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create output folder {path}: {e}") from e
        self.root = path
        self.uri = str(path)

    def __repr__(self) -> str:
        return f"LocalStorage({self.uri!r})"

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def _write_tmp(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}{_TMP_MARK}{uuid.uuid4().hex}")
        # No fsync: the guarantee needed is against a crashed *process* (the page cache survives it);
        # syncing every image would cost more than re-rendering after a rare machine crash.
        with open(tmp, "wb") as f:
            f.write(data)
        return tmp

    def put_bytes(self, key: str, data: bytes, content_type: str | None = None) -> None:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path, data)
            os.replace(tmp, path)
        except OSError as e:
            raise StorageError(f"cannot write {path} (storage {self.uri}, key {key!r}): {e}") from e

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        target = self._path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)  # one rename when on the same filesystem (write the file beside the target)
        except OSError:
            try:
                tmp = target.with_name(f".{target.name}{_TMP_MARK}{uuid.uuid4().hex}")
                shutil.copyfile(path, tmp)
                os.replace(tmp, target)
                os.unlink(path)
            except OSError as e:
                raise StorageError(f"cannot write {target} (storage {self.uri}, key {key!r}): {e}") from e

    def temp_path_for(self, key: str) -> Path:
        """A temporary file name beside `key`'s file (listings skip it): write there, then put_file."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.with_name(f".{path.name}{_TMP_MARK}{uuid.uuid4().hex}")

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path, data)
        except OSError as e:
            raise StorageError(f"cannot write {path} (storage {self.uri}, key {key!r}): {e}") from e
        try:
            # link() fails if the target exists and publishes the complete file in one step, which
            # O_EXCL + write cannot (a reader could see it half written).
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:
            try:
                return _publish_exclusively(tmp, path)
            except OSError as e:
                raise StorageError(f"cannot write {path} (storage {self.uri}, key {key!r}): {e}") from e
        finally:
            tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise StorageError(f"no object {key!r} in storage {self.uri} (file {path} does not exist)") from None
        except OSError as e:
            raise StorageError(f"cannot read {path} (storage {self.uri}, key {key!r}): {e}") from e

    def get_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(key, start, length)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(length)
        except FileNotFoundError:
            raise StorageError(f"no object {key!r} in storage {self.uri} (file {path} does not exist)") from None
        except OSError as e:
            raise StorageError(f"cannot read {path} (storage {self.uri}, key {key!r}): {e}") from e
        return _whole_range(self.uri, key, start, length, data)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        # Prefix semantics as in S3 (a string prefix, not a folder): walk the deepest folder the
        # prefix names, then filter.
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(".") and _TMP_MARK in name:
                    continue  # an in-flight write
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def abandon_partial_writes(self, prefix: str) -> int:
        """Delete the temporary files of writes that never finished under `prefix` (a killed writer's, up to a
        shard's size each); how many. Only for a prefix whose writers are gone."""
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        removed = 0
        for path in base.rglob(f".*{_TMP_MARK}*") if base.is_dir() else ():
            if path.relative_to(self.root).as_posix().startswith(prefix.rsplit("/", 1)[0]):
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def copy(self, src: str, dst: str) -> None:
        source, target = self._path(src), self._path(dst)
        if not source.is_file():
            raise StorageError(f"no object {src!r} in storage {self.uri} to copy to {dst!r} (file {source})")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}{_TMP_MARK}{uuid.uuid4().hex}")
            try:
                os.link(source, tmp)  # a second name for the same bytes: no copy of a 1 GB shard
            except OSError:
                shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        except OSError as e:
            raise StorageError(f"cannot copy {source} to {target} (storage {self.uri}): {e}") from e

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise StorageError(f"cannot delete {path} (storage {self.uri}, key {key!r}): {e}") from e

    def uri_for(self, key: str) -> str:
        return str(self._path(key))


# ----------------------------------------------------------------------------------------------
# S3


_clients: dict[tuple[int, S3Options], object] = {}
_clients_lock = threading.Lock()


def s3_client(opts: S3Options | None = None):
    """The process's boto3 S3 client for these options, created on first use.

    Keyed by pid too, so a forked child (Ray worker, multiprocessing) never reuses its parent's
    connection pool. boto3 clients are thread-safe, so one per process is enough.
    """
    opts = (opts or S3Options()).resolved()
    key = (os.getpid(), opts)
    client = _clients.get(key)
    if client is None:
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                retries = {"mode": opts.retry_mode, "max_attempts": opts.max_attempts}
                client = _new_client(opts, retries=retries, connect_timeout=10, read_timeout=60)
                _clients[key] = client
    return client


def _new_client(opts: S3Options, *, retries: dict, connect_timeout: float, read_timeout: float):
    """A boto3 S3 client for resolved `opts` with these retries and timeouts."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries=retries,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        # SeaweedFS/MinIO are addressed by path; AWS accepts it too.
        s3={"addressing_style": "path"} if opts.endpoint_url else None,
    )
    # A Session per client: the default session is not thread-safe.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=opts.endpoint_url,
        region_name=opts.region or ("us-east-1" if opts.endpoint_url else None),
        aws_access_key_id=opts.access_key,
        aws_secret_access_key=opts.secret_key,
        config=config,
    )


# The first request's limits (`probe_s3`): a store that has not connected within PROBE_CONNECT_TIMEOUT_S or
# answered within PROBE_READ_TIMEOUT_S is taken as a mistake to report, not an outage to wait out.
PROBE_CONNECT_TIMEOUT_S = 5.0
PROBE_READ_TIMEOUT_S = 10.0

_CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an instance role provides them"
)


def check_local_folder(uri: str, what: str = "output") -> None:
    """A local folder a command writes must be one, or a place one can be made: a file there (or above it) is one
    line before anything starts, where a run would stop at its log file with "[Errno 17] File exists"."""
    if uri.startswith("s3://"):
        return
    path = Path(uri.removeprefix("file://")).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under {existing}, a file"
        raise ValueError(
            f"{what} {uri} {where}: give a folder" + (" (or s3://bucket/prefix)" if what == "output" else "")
        )


def probe_s3(uri: str, s3: S3Options | None = None, *, is_object: bool = False) -> None:
    """One request to `uri` (a HEAD of the object when `is_object`, else a LIST of one key under the prefix), with
    the short timeouts above and no retry: StorageError, in one line, when there are no credentials, the endpoint
    does not answer, the store refuses the credentials or the bucket does not exist.

    A missing object is not reported here: the caller's read says it in its own words. Callers probe once,
    before a job starts; the job's own calls then have the long outage tolerance (`S3Options.outage_tolerance_s`).
    """
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionClosedError,
        CredentialRetrievalError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    opts = (s3 or S3Options()).resolved()
    endpoint = opts.endpoint_url or "AWS"
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise StorageError(f"expected s3://bucket[/key], got {uri!r}")
    client = _new_client(
        opts,
        retries={"mode": "standard", "total_max_attempts": 1},
        connect_timeout=PROBE_CONNECT_TIMEOUT_S,
        read_timeout=PROBE_READ_TIMEOUT_S,
    )
    try:
        if is_object:
            client.head_object(Bucket=bucket, Key=key)
        else:
            client.list_objects_v2(Bucket=bucket, Prefix=key.strip("/"), MaxKeys=1)
    except (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError) as e:
        raise StorageError(f"no S3 credentials for {uri} ({e}): {_CREDENTIALS_HINT}") from None
    except (BotoConnectionError, ReadTimeoutError, ConnectionClosedError) as e:
        raise StorageError(
            f"the S3 endpoint {endpoint} did not answer a first request for {uri} within"
            f" {PROBE_CONNECT_TIMEOUT_S:g} s to connect and {PROBE_READ_TIMEOUT_S:g} s to answer ({e}): check"
            " AWS_ENDPOINT_URL and that the store is up"
        ) from None
    except ClientError as e:
        code, status = _code(e), _status(e)
        if is_object and status == 404:
            return
        if code == "NoSuchBucket":
            raise StorageError(f"bucket {bucket!r} does not exist at {endpoint} ({uri})") from None
        if status in (401, 403):
            raise StorageError(
                f"the S3 endpoint {endpoint} refused the credentials for {uri} ({code or status}): {_CREDENTIALS_HINT}"
            ) from None
        raise StorageError(f"a first request for {uri} at {endpoint} failed: {e}") from None
    except BotoCoreError as e:  # a malformed endpoint URL, a missing region: a setting to fix
        raise StorageError(f"a first request for {uri} at {endpoint} failed: {e}") from None


_RETRYABLE_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "503",
    "500",
    "502",
    "504",
}


def _status(err) -> int:
    return int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(err) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def _is_transient(err: BaseException) -> bool:
    from boto3.exceptions import RetriesExceededError as Boto3RetriesExceeded
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceeded

    # The RetriesExceeded errors are what download_file raises after its own retries of a broken stream.
    if isinstance(err, (BotoConnectionError, HTTPClientError, Boto3RetriesExceeded, TransferRetriesExceeded)):
        return True
    if isinstance(err, ClientError):
        return _status(err) >= 500 or _code(err) in _RETRYABLE_CODES
    return False


class S3Storage:
    """``s3://bucket/prefix`` through boto3 (any S3-compatible endpoint).

    Picklable: it holds only the bucket, prefix and options; the client is looked up per process
    (`s3_client`), so an instance sent to a Ray worker works there.
    """

    def __init__(self, uri: str, s3: S3Options | None = None):
        if not uri.startswith("s3://"):
            raise StorageError(f"not an s3:// URI: {uri!r}")
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise StorageError(f"no bucket in {uri!r}: expected s3://bucket[/prefix]")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options = s3 or S3Options()
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"

    def __repr__(self) -> str:
        return f"S3Storage({self.uri!r})"

    @property
    def client(self):
        return s3_client(self.options)

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, where: str, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying transient failures (outages, 5xx) for up to outage_tolerance_s.

        `where` is the URI, for messages."""
        deadline = None
        attempt = 0
        while True:
            try:
                result = fn()
            except Exception as e:
                if not _is_transient(e):
                    raise
                now = time.monotonic()
                deadline = deadline or now + self.options.outage_tolerance_s
                bound = _DEADLINE.get()
                if bound is not None and now >= bound:
                    raise StorageError(
                        f"{what} {where} did not land before the lease it was made under ran out "
                        f"(endpoint {self.options.resolved().endpoint_url or 'AWS'}): {e}"
                    ) from e
                if now >= deadline:
                    raise StorageError(
                        f"{what} {where} failed for {self.options.outage_tolerance_s:g} s "
                        f"(endpoint {self.options.resolved().endpoint_url or 'AWS'}): {e}"
                    ) from e
                delay = min(0.25 * 2**attempt, 5.0) * (0.5 + random.random() / 2)
                attempt += 1
                log.warning("S3 %s %s: %s; retrying in %.1f s", what, where, e, delay)
                time.sleep(min(delay, max(min(deadline, bound or deadline) - now, 0.0)))
                continue
            # botocore's own retries ride out short outages inside one call; say so, with the count.
            retries = attempt + _botocore_retries(result)
            if retries:
                log.warning("S3 %s %s succeeded after %d retries", what, where, retries)
            return result

    def _client_error(self, what: str, key: str, e: Exception) -> StorageError:
        return StorageError(f"{what} {self.uri_for(key)} failed (storage {self.uri}, key {key!r}): {e}")

    def put_bytes(self, key: str, data: bytes, content_type: str | None = None) -> None:
        from botocore.exceptions import ClientError

        content_type = content_type or mimetypes.guess_type(key)[0] or "application/octet-stream"
        try:
            self._call(
                "PUT",
                self.uri_for(key),
                lambda: self.client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=data, ContentType=content_type
                ),
            )
        except ClientError as e:
            raise self._client_error("PUT", key, e) from e

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Conditional PUT (``If-None-Match: *``): the store decides the race, 412 means it existed.

        If a request was retried, the first attempt may have landed before its answer was lost; a 412
        then is our own write, which shows as identical bytes, and counts as written.
        """
        from botocore.exceptions import ClientError

        retried = False

        def put():
            nonlocal retried
            try:
                return self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
            except ClientError as e:
                retried = retried or e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0
                raise
            except Exception:
                retried = True
                raise

        try:
            self._call("conditional PUT", self.uri_for(key), put)
            return True
        except ClientError as e:
            if _status(e) == 412 or _code(e) == "PreconditionFailed":
                return retried and self.get_bytes(key) == data
            if _status(e) == 409 or _code(e) == "ConditionalRequestConflict":
                # AWS: another conditional create of this key is in progress. Not ours: the caller looks again.
                return False
            raise self._client_error("conditional PUT", key, e) from e

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        """Multipart upload for large files: the object appears whole when the upload completes, or not at all."""
        from botocore.exceptions import ClientError

        content_type = mimetypes.guess_type(key)[0] or "application/octet-stream"
        try:
            self._call(
                "upload",
                self.uri_for(key),
                lambda: self.client.upload_file(
                    os.fspath(path), self.bucket, self._key(key), ExtraArgs={"ContentType": content_type}
                ),
            )
        except ClientError as e:
            raise self._client_error("upload", key, e) from e
        Path(path).unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            return self._call(
                "GET",
                self.uri_for(key),
                lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read(),
            )
        except ClientError as e:
            if _code(e) in ("NoSuchKey", "404") or _status(e) == 404:
                raise StorageError(
                    f"no object {key!r} in storage {self.uri} ({self.uri_for(key)} does not exist)"
                ) from None
            raise self._client_error("GET", key, e) from e

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged GET (``Range: bytes=start-end``): a shard's member costs its own size, not the shard's."""
        from botocore.exceptions import ClientError

        _check_range(key, start, length)
        if length == 0:
            return b""
        try:
            data = self._call(
                "ranged GET",
                self.uri_for(key),
                lambda: self.client.get_object(
                    Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
                )["Body"].read(),
            )
        except ClientError as e:
            if _code(e) in ("NoSuchKey", "404") or _status(e) == 404:
                raise StorageError(
                    f"no object {key!r} in storage {self.uri} ({self.uri_for(key)} does not exist)"
                ) from None
            if _status(e) == 416 or _code(e) == "InvalidRange":
                raise StorageError(
                    f"bytes {start}..{start + length} of {self.uri_for(key)} are past its end (storage {self.uri})"
                ) from None
            raise self._client_error("ranged GET", key, e) from e
        return _whole_range(self.uri, key, start, length, data)

    def head(self, key: str) -> dict | None:
        """The object's HEAD answer (ContentLength, ETag, ...), or None when it does not exist."""
        from botocore.exceptions import ClientError

        try:
            return self._call(
                "HEAD", self.uri_for(key), lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            )
        except ClientError as e:
            if _status(e) == 404 or _code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._client_error("HEAD", key, e) from e

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def download_file(self, key: str, dest: str | os.PathLike) -> None:
        """Stream the object into `dest` (parallel ranged GETs for large files; nothing held in memory)."""
        from botocore.exceptions import ClientError

        try:
            self._call(
                "download",
                self.uri_for(key),
                lambda: self.client.download_file(self.bucket, self._key(key), os.fspath(dest)),
            )
        except ClientError as e:
            raise self._client_error("download", key, e) from e

    def list(self, prefix: str) -> list[str]:
        from botocore.exceptions import ClientError

        root = f"{self.prefix}/" if self.prefix else ""

        def list_all() -> list[str]:
            keys = []
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root + prefix):
                keys.extend(obj["Key"][len(root) :] for obj in page.get("Contents", ()))
            return keys

        try:
            return sorted(self._call("LIST", f"s3://{self.bucket}/{root}{prefix}", list_all))
        except ClientError as e:
            raise StorageError(f"LIST s3://{self.bucket}/{root}{prefix} failed (storage {self.uri}): {e}") from e

    def copy(self, src: str, dst: str) -> None:
        """A server-side copy (boto3's managed copy: multipart for objects over its threshold)."""
        from botocore.exceptions import ClientError

        try:
            self._call(
                "COPY",
                f"{self.uri_for(src)} -> {self.uri_for(dst)}",
                lambda: self.client.copy({"Bucket": self.bucket, "Key": self._key(src)}, self.bucket, self._key(dst)),
            )
        except ClientError as e:
            if _code(e) in ("NoSuchKey", "404") or _status(e) == 404:
                raise StorageError(f"no object {src!r} in storage {self.uri} to copy to {dst!r}") from None
            raise self._client_error("COPY", src, e) from e

    def abandon_partial_writes(self, prefix: str) -> int:
        """Abort the unfinished multipart uploads under `prefix` (a killed worker leaves its parts stored and
        billed); how many. Only for a prefix whose writers are gone."""
        root = f"{self.prefix}/" if self.prefix else ""
        aborted = 0
        for page in self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=root + prefix
        ):
            for upload in page.get("Uploads", ()):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
        return aborted

    def delete(self, key: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call(
                "DELETE", self.uri_for(key), lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
            )
        except ClientError as e:
            raise self._client_error("DELETE", key, e) from e

    def uri_for(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"


# ----------------------------------------------------------------------------------------------


def open_storage(uri: str, s3: S3Options | None = None) -> Storage:
    """``s3://bucket/prefix`` -> S3Storage; anything else is a local folder, created if missing."""
    if uri.startswith("s3://"):
        return S3Storage(uri, s3)
    return LocalStorage(uri)


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b.bin`` -> ("bucket", "a/b.bin"); StorageError if there is no key."""
    bucket, _, key = uri[len("s3://") :].partition("/") if uri.startswith("s3://") else ("", "", "")
    if not bucket or not key or key.endswith("/"):
        raise StorageError(f"expected an object URI s3://bucket/key, got {uri!r}")
    return bucket, key


def read_uri(uri: str, s3: S3Options | None = None) -> bytes:
    """One file by its full location: a local path (or file://) or ``s3://bucket/key``."""
    if uri.startswith("s3://"):
        bucket, key = split_s3_uri(uri)
        return S3Storage(f"s3://{bucket}", s3).get_bytes(key)
    path = Path(uri.removeprefix("file://")).expanduser()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise StorageError(f"file {path} does not exist") from None
    except OSError as e:
        raise StorageError(f"cannot read {path}: {e}") from e
