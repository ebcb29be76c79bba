"""An S3 bucket as a store (:class:`S3Store`); the one module that talks to boto3 and botocore.

boto3 and botocore are imported inside the methods that use them, so that importing
``hsx.store`` (every CLI command, every reader) does not pay for them (about 0.25 s) when the run
is local.
"""

from __future__ import annotations

import base64
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from hsx.errors import BadConfig, FidelityError, StoreError, StoreFull
from hsx.store.hashing import CHUNK_BYTES, Sha256Beside
from hsx.store.protocol import S3_FULL_CODES, MissingKey, check_key, check_prefix
from hsx.storeurl import S3, StoreURL, mask_url, parse_store_url

if TYPE_CHECKING:
    from settings import Settings

#: objects at least this big are uploaded in parts, each this big (64 MiB).
MULTIPART_BYTES = 64 << 20
#: parallel part uploads of one big object.
MULTIPART_CONCURRENCY = 8
#: S3 connect / read timeouts of ordinary calls (seconds); retries are botocore's "adaptive" mode,
#: few of them: a worker's own retries (``hsx/store/retry.py``, ``HSX_STORE_RETRY_S``) ride out long
#: outages, and a shard the store does not take within seconds goes to the overflow spool.
S3_CONNECT_TIMEOUT_S = 10
S3_READ_TIMEOUT_S = 120
S3_MAX_ATTEMPTS = 3
#: the probe at open: short timeouts and few attempts, so a bad endpoint fails in seconds.
PROBE_CONNECT_TIMEOUT_S = 3
PROBE_READ_TIMEOUT_S = 5
PROBE_MAX_ATTEMPTS = 2
#: a 409 ConditionalRequestConflict (AWS: another conditional write is in flight) is retried this
#: many times, this far apart (seconds), so that the loser sees the winner's 412.
CONFLICT_RETRIES = 5
CONFLICT_BACKOFF_S = 0.2


def _error_code(e: Exception) -> tuple[str, int]:
    resp = getattr(e, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _is_not_found(e: Exception) -> bool:
    code, status = _error_code(e)
    return status == 404 or code in ("404", "NoSuchKey", "NotFound")


#: S3 error codes that a later attempt may not get (throttling, server-side trouble).
TRANSIENT_S3_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout",
                      "InternalError", "ServiceUnavailable", "ServiceUnavailableException", "RequestThrottled",
                      "TooManyRequestsException", "BandwidthLimitExceeded", "OperationAborted"}


def transient_s3_error(e: BaseException) -> bool:
    """Whether trying again later may succeed: no answer (connection refused, reset, timeouts, a
    body cut short), throttling, or HTTP 5xx; not credentials, a missing bucket or a bad request."""
    from botocore import exceptions as bx

    if isinstance(e, bx.ClientError):
        code, status = _error_code(e)
        return status >= 500 or status == 429 or code in TRANSIENT_S3_CODES
    if isinstance(e, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError, bx.ResponseStreamingError,
                      ConnectionError, TimeoutError)):
        return True
    try:
        import urllib3.exceptions

        return isinstance(e, urllib3.exceptions.HTTPError)
    except ImportError:  # pragma: no cover - urllib3 ships with botocore
        return False


def _b64(hex_digest: str) -> str:
    """A hex digest as S3 writes checksums: base64 of the raw bytes."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


class S3Store:
    """An S3 bucket (optionally under a prefix) as a store: key ``a/b`` is ``s3://bucket/prefix/a/b``.

    One boto3 client, shared by threads (boto3 clients are thread-safe), with botocore's adaptive
    retries (``S3_MAX_ATTEMPTS``); errors left after retries become StoreError naming the object
    and the endpoint.
    """

    multipart_bytes: int = MULTIPART_BYTES
    """Files this big or bigger are uploaded in parts of this size (bytes; S3 minimum 5 MiB)."""

    def __init__(self, client: Any, bucket: str, prefix: str = "", *, endpoint: str | None = None,
                 probe_client: Any = None):
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.endpoint = endpoint or getattr(getattr(client, "meta", None), "endpoint_url", None) or "AWS default"
        self._probe_client = probe_client
        self.location = StoreURL(S3, bucket=bucket, prefix=self.prefix)
        self.url = str(self.location)

    def __repr__(self) -> str:
        return f"S3Store({self.url} at {self.endpoint})"

    @classmethod
    def from_url(cls, url: "str | StoreURL", settings: "Settings | None" = None) -> "S3Store":
        """Build (without probing) the store for ``s3://bucket[/prefix]``; BadConfig on a bad URL
        (:func:`hsx.storeurl.parse_store_url`'s rules) or a URL of another kind."""
        import boto3
        from botocore.config import Config

        location = url if isinstance(url, StoreURL) else parse_store_url(url)
        if not location.is_s3:
            raise BadConfig(f"store URL {mask_url(str(url))!r} is not s3://BUCKET or s3://BUCKET/PREFIX")
        bucket, prefix = location.bucket, location.prefix
        if prefix:
            try:
                check_key(prefix)
            except BadConfig as e:
                raise BadConfig(f"store URL {mask_url(str(location))!r}: bad prefix: {e}") from None

        endpoint = settings.s3_endpoint_url if settings else None
        kwargs: dict[str, Any] = {}
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        if settings and settings.s3_region:
            kwargs["region_name"] = settings.s3_region
        if settings and settings.s3_access_key_id:
            kwargs["aws_access_key_id"] = settings.s3_access_key_id
            kwargs["aws_secret_access_key"] = settings.s3_secret_access_key
        session = boto3.session.Session()
        # Custom endpoints (SeaweedFS, MinIO, moto) need path-style; AWS picks its own.
        s3_cfg = {"addressing_style": "path"} if endpoint else {}
        client = session.client("s3", config=Config(
            retries={"max_attempts": S3_MAX_ATTEMPTS, "mode": "adaptive"},
            connect_timeout=S3_CONNECT_TIMEOUT_S, read_timeout=S3_READ_TIMEOUT_S,
            max_pool_connections=32, s3=s3_cfg,
        ), **kwargs)
        probe = session.client("s3", config=Config(
            retries={"max_attempts": PROBE_MAX_ATTEMPTS, "mode": "standard"},
            connect_timeout=PROBE_CONNECT_TIMEOUT_S, read_timeout=PROBE_READ_TIMEOUT_S, s3=s3_cfg,
        ), **kwargs)
        return cls(client, bucket, prefix, endpoint=client.meta.endpoint_url, probe_client=probe)

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as e:
            code, status = _error_code(e)
            if code in S3_FULL_CODES or status == 507:
                raise StoreFull(f"S3 {op} {self.url}/{key} at {self.endpoint} failed: the store has no room: "
                                f"HTTP {status} {code}: {e}") from e
            raise StoreError(
                f"S3 {op} {self.url}/{key} at {self.endpoint} failed: HTTP {status} {code}: {e}",
                transient=transient_s3_error(e),
            ) from e
        except (BotoCoreError, Boto3Error) as e:
            raise StoreError(f"S3 {op} {self.url}/{key} at {self.endpoint} failed: {e}",
                             transient=transient_s3_error(e)) from e
        except OSError as e:  # a socket error while streaming a body (botocore does not wrap those)
            raise StoreError(f"S3 {op} {self.url}/{key} at {self.endpoint} failed: {type(e).__name__}: {e}",
                             transient=True) from e
        except Exception as e:
            if transient_s3_error(e):  # urllib3 errors from a streamed body
                raise StoreError(f"S3 {op} {self.url}/{key} at {self.endpoint} failed: {type(e).__name__}: {e}",
                                 transient=True) from e
            raise

    def check(self, create: bool = True) -> None:
        """One ``head_bucket`` with short timeouts (3 s connect, 2 attempts); StoreError naming the
        URL, the endpoint, the error and the fix when the endpoint is unreachable, the bucket is
        missing or the credentials are refused."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        client = self._probe_client or self.client
        where = f"store {self.url} at endpoint {self.endpoint}"
        try:
            client.head_bucket(Bucket=self.bucket)
        except NoCredentialsError as e:
            raise StoreError(
                f"{where}: no S3 credentials found ({e}). Fix: set HSX_S3_ACCESS_KEY_ID and "
                "HSX_S3_SECRET_ACCESS_KEY (or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
            ) from e
        except ClientError as e:
            code, status = _error_code(e)
            # a HEAD answer has no body: its "code" is the status again
            http = f"HTTP {status}" if code in (None, "", str(status)) else f"HTTP {status} {code}"
            server = e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("server")
            if server:  # a 404 from something that is not an S3 server reads the same otherwise
                where += f" (server: {server})"
            if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
                raise StoreError(
                    f"{where}: bucket {self.bucket!r} does not exist ({http}). Fix: create "
                    f"it (aws s3 mb s3://{self.bucket} --endpoint-url {self.endpoint}) or correct "
                    "the store URL / HSX_S3_ENDPOINT_URL"
                ) from e
            if status in (401, 403) or code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
                raise StoreError(
                    f"{where}: credentials refused ({http}). Fix: check "
                    "HSX_S3_ACCESS_KEY_ID / HSX_S3_SECRET_ACCESS_KEY and the bucket's permissions"
                ) from e
            raise StoreError(f"{where}: head_bucket failed ({http}): {e}",
                             transient=transient_s3_error(e)) from e
        except BotoCoreError as e:
            raise StoreError(
                f"{where}: cannot reach the S3 endpoint ({type(e).__name__}: {e}). Fix: check "
                "HSX_S3_ENDPOINT_URL (or AWS_ENDPOINT_URL) and that the server is running and reachable",
                transient=transient_s3_error(e),
            ) from e

    def read(self, key: str) -> bytes:
        """The object's bytes; :class:`MissingKey` if absent."""
        from botocore.exceptions import ClientError

        full = self._key(key)
        with self._errors("read", key):
            try:
                return self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read()
            except ClientError as e:
                if _is_not_found(e):
                    raise MissingKey(f"{key!r} not found in {self.url}") from None
                raise

    def write(self, key: str, data: bytes) -> None:
        """PUT the bytes (overwrite; a PUT is atomic for readers)."""
        full = self._key(key)
        with self._errors("write", key):
            self.client.put_object(Bucket=self.bucket, Key=full, Body=data)

    def write_stream(self, key: str, pieces: Iterable[memoryview]) -> tuple[int, str]:
        """Upload ``pieces`` from host memory with checksums the server checks; return (bytes, sha256 hex).

        The pieces are cut into parts of ``multipart_bytes`` (each part one copy into a bytes
        object, as the HTTP body), uploaded ``MULTIPART_CONCURRENCY`` at a time, each with its
        own ``ChecksumSHA256`` that the server verifies on arrival (a mismatch is HTTP 400
        BadDigest); the whole object's sha256 is computed beside the upload over the same
        buffers. An object smaller than one part is one PUT with its full ``ChecksumSHA256``. The
        completed upload's composite checksum (when the server reports one) is compared with the
        one the parts give: FidelityError if they differ. Nothing is downloaded. A failed upload is
        aborted (no parts stay behind) and raises StoreError (``transient`` for what a retry may fix).
        """
        from concurrent.futures import FIRST_COMPLETED, wait

        full = self._key(key)
        part_bytes = self.multipart_bytes
        sha = Sha256Beside()
        upload_id = None
        pool = None
        with self._errors("write_stream", key):
            try:
                pending: list[memoryview] = []  # slices of the caller's buffers for the next part
                pending_len = 0
                futures: dict = {}
                parts: list[dict] = []

                def send(number: int, data: bytes) -> dict:
                    digest = _b64(hashlib.sha256(data).hexdigest())
                    resp = self.client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                                                   Body=data, ChecksumSHA256=digest)
                    return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": digest}

                def flush_part() -> None:
                    nonlocal upload_id, pool, pending, pending_len
                    if upload_id is None:
                        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=full,
                                                                        ChecksumAlgorithm="SHA256")["UploadId"]
                        pool = ThreadPoolExecutor(MULTIPART_CONCURRENCY, thread_name_prefix="s3-part")
                    while len(futures) >= MULTIPART_CONCURRENCY:  # bounded memory: parts in flight
                        done, _ = wait(futures, return_when=FIRST_COMPLETED)
                        for f in done:
                            parts.append(f.result())
                            del futures[f]
                    number = len(parts) + len(futures) + 1
                    futures[pool.submit(send, number, b"".join(pending))] = number  # the one copy: the part's body
                    pending, pending_len = [], 0

                for piece in pieces:
                    piece = memoryview(piece).cast("B")
                    sha.update(piece)
                    while len(piece):
                        take = min(len(piece), part_bytes - pending_len)
                        pending.append(piece[:take])
                        pending_len += take
                        piece = piece[take:]
                        if pending_len == part_bytes:
                            flush_part()
                if upload_id is None:  # small: one PUT with the whole object's checksum
                    digest = sha.hexdigest()
                    self.client.put_object(Bucket=self.bucket, Key=full, Body=b"".join(pending),
                                           ChecksumSHA256=_b64(digest))
                    return sha.nbytes, digest
                if pending_len:
                    flush_part()
                for f in list(futures):
                    parts.append(f.result())
                parts.sort(key=lambda p: p["PartNumber"])
                resp = self.client.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                                             MultipartUpload={"Parts": parts})
                joined = b"".join(base64.b64decode(p["ChecksumSHA256"]) for p in parts)
                composite = f"{base64.b64encode(hashlib.sha256(joined).digest()).decode()}-{len(parts)}"
                reported = resp.get("ChecksumSHA256")
                if reported and reported != composite:
                    raise FidelityError(f"{key!r} in {self.url}: the server's composite SHA-256 {reported} differs from "
                                        f"the parts' {composite}")
                upload_id = None  # completed: nothing to abort
                return sha.nbytes, sha.hexdigest()
            finally:
                sha.hexdigest()
                if pool is not None:
                    pool.shutdown(wait=True, cancel_futures=True)
                if upload_id is not None:
                    try:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
                    except Exception:  # the server may be the thing that failed; reconcile removes it later
                        pass

    def create(self, key: str, data: bytes) -> bool:
        """``put_object(IfNoneMatch="*")``: True if created, False on 412 PreconditionFailed.

        A 409 ConditionalRequestConflict (AWS: a racing conditional write is in flight) is retried
        ``CONFLICT_RETRIES`` times so the outcome settles (412 -> False, or 200 if the other writer
        failed). If it never settles, the outcome is unknown, not lost: StoreError with
        ``transient=True`` (the caller's retries, ``hsx/store/retry.py``, try again; a worker must not
        take it for another worker's marker and delete its own shard). If botocore had to retry our
        PUT and then got 412, the first attempt may have landed: the object is read back and True
        returned when it holds our bytes.
        """
        from botocore.exceptions import ClientError

        full = self._key(key)
        with self._errors("create", key):
            for attempt in range(CONFLICT_RETRIES + 1):
                try:
                    self.client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")
                    return True
                except ClientError as e:
                    code, status = _error_code(e)
                    if status == 412 or code == "PreconditionFailed":
                        retried = e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
                        if retried:
                            try:
                                return self.read(key) == data
                            except MissingKey:
                                return False
                        return False
                    if status == 409 or code == "ConditionalRequestConflict":
                        if attempt < CONFLICT_RETRIES:
                            time.sleep(CONFLICT_BACKOFF_S * (attempt + 1))
                            continue
                        raise StoreError(
                            f"S3 create {self.url}/{key} at {self.endpoint}: {CONFLICT_RETRIES + 1} answers of HTTP 409 "
                            f"{code or 'ConditionalRequestConflict'} (another conditional write to the key in flight) "
                            "and none settled whether the object exists; not created. Fix: none needed, try again "
                            "(transient)", transient=True) from e
                    raise
        raise AssertionError("unreachable")

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """One ranged GET (``Range: bytes=offset-end``); fewer bytes at the object's end, ``b""`` past it
        (HTTP 416) or for ``length`` 0; :class:`MissingKey` if absent."""
        from botocore.exceptions import ClientError

        full = self._key(key)
        if length <= 0:
            if self.size(key) is None:
                raise MissingKey(f"{key!r} not found in {self.url}")
            return b""
        with self._errors("read", key):
            try:
                return self.client.get_object(Bucket=self.bucket, Key=full,
                                              Range=f"bytes={offset}-{offset + length - 1}")["Body"].read()
            except ClientError as e:
                if _is_not_found(e):
                    raise MissingKey(f"{key!r} not found in {self.url}") from None
                code, status = _error_code(e)
                if status == 416 or code == "InvalidRange":
                    return b""
                raise

    def sha256(self, key: str) -> tuple[int, str]:
        """(bytes, sha256 hex) of the object's body, streamed in ``CHUNK_BYTES`` chunks; :class:`MissingKey`
        if absent; StoreError (``transient``) when the body cannot be read to its end."""
        from botocore.exceptions import ClientError

        full = self._key(key)
        h = hashlib.sha256()
        n = 0
        with self._errors("read", key):
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=full)["Body"]
            except ClientError as e:
                if _is_not_found(e):
                    raise MissingKey(f"{key!r} not found in {self.url}") from None
                raise
            for chunk in body.iter_chunks(CHUNK_BYTES):
                h.update(chunk)
                n += len(chunk)
        return n, h.hexdigest()

    def size(self, key: str) -> int | None:
        """``ContentLength`` from a HEAD, None if absent."""
        from botocore.exceptions import ClientError

        full = self._key(key)
        with self._errors("size", key):
            try:
                return int(self.client.head_object(Bucket=self.bucket, Key=full)["ContentLength"])
            except ClientError as e:
                if _is_not_found(e):
                    return None
                raise

    def list(self, prefix: str = "") -> list[str]:
        """Every key starting with ``prefix`` (recursive), sorted; paginated (1000 per page)."""
        check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        out: list[str] = []
        with self._errors("list", prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    k = obj["Key"]
                    if k.startswith(base) and not k.endswith("/"):  # "dir/" placeholders are not keys
                        out.append(k[len(base):])
        out.sort()
        return out

    def delete(self, key: str) -> None:
        """DELETE the object; absent is fine."""
        full = self._key(key)
        with self._errors("delete", key):
            self.client.delete_object(Bucket=self.bucket, Key=full)

    def local_path(self, key: str) -> Path | None:
        """None: S3 objects have no local path."""
        self._key(key)
        return None

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        """``{key: LastModified}`` (Unix seconds) of every key starting with ``prefix`` (one paginated listing)."""
        check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        out: dict[str, float] = {}
        with self._errors("list", prefix):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix):
                for obj in page.get("Contents", ()):
                    k = obj["Key"]
                    if k.startswith(base) and not k.endswith("/"):
                        out[k[len(base):]] = obj["LastModified"].timestamp()
        return out

    def remove_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> list[str]:
        """Abort multipart uploads under ``prefix`` started more than ``older_than_s`` seconds ago
        (a worker killed mid-upload leaves their parts, which cost storage but are invisible to
        listings); returns their keys."""
        check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        cutoff = time.time() - older_than_s
        removed = []
        with self._errors("clean", prefix):
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base + prefix):
                for up in page.get("Uploads", ()):
                    if up["Initiated"].timestamp() < cutoff:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                        removed.append(up["Key"][len(base):])
        return sorted(removed)

    def create_bucket(self) -> None:
        """Create this store's bucket if it does not exist (setup of a test or bench server).

        A run never creates buckets: ``open_store`` refuses a missing one with the command that
        makes it. This is for the SeaweedFS that tests and benches start, so that they make their
        bucket through the store rather than a client of their own. Raises StoreError."""
        from botocore.exceptions import ClientError

        with self._errors("create_bucket", ""):
            try:
                self.client.create_bucket(Bucket=self.bucket)
            except ClientError as e:
                if _error_code(e)[0] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def child(self, prefix: str) -> "S3Store":
        """A store rooted at ``prefix`` under this one, sharing the client."""
        return S3Store(self.client, self.bucket, self._key(prefix), endpoint=self.endpoint,
                       probe_client=self._probe_client)
