"""The S3 ceiling: a plain multipart upload with boto3 itself, outside our store.

A ceiling is the same bytes sent by the library users would otherwise call (boto3's
``upload_fileobj``, 64 MiB parts, 8 at a time), with none of our code on the path: no hashing of
ours, no per-part SHA-256 headers, no serialising. Measuring it through ``hsx.store`` would make
the ceiling move with the code it judges. This is therefore the one module outside ``hsx/store/``
that holds an S3 client (tests/test_store.py's boundary test names it), and only benches use it.
"""

from __future__ import annotations

import io
import time

#: boto3 ``TransferConfig`` of the ceiling: the part size and parallelism of ``S3Store.write_stream``.
PART_BYTES, CONCURRENCY = 64 << 20, 8


class PlainUploader:
    """boto3's ``upload_fileobj`` into ``bucket`` at ``endpoint`` (credentials as given)."""

    def __init__(self, endpoint: str, bucket: str, access_key: str, secret_key: str, region: str = "us-east-1"):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access_key,
                                   aws_secret_access_key=secret_key, region_name=region,
                                   config=Config(max_pool_connections=4 * CONCURRENCY))
        self.config = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                                     max_concurrency=CONCURRENCY)

    def upload(self, key: str, data: bytes) -> None:
        """One plain multipart upload of ``data`` (bytes) to ``key``."""
        self.client.upload_fileobj(io.BytesIO(data), self.bucket, key, Config=self.config)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def gb_s(self, data: bytes, key: str = "bandwidth-probe") -> float:
        """GB/s (1e9 bytes) of one plain upload of ``data``; the object is deleted after."""
        t0 = time.perf_counter()
        self.upload(key, data)
        seconds = time.perf_counter() - t0
        self.delete(key)
        return len(data) / seconds / 1e9
