"""One settings object for the producer, the workers and the CLI.

Every value comes from an environment variable with the prefix ``HSX_`` (for example
``HSX_BROKER_URL``) or from a ``.env`` file in the working directory; command-line options
override them. No other module reads ``os.environ``: pass a :class:`Settings` around instead.
Bad values are refused at load time, and the error names the field.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hsx"


class Settings(BaseSettings):
    """Configuration shared by ``python -m producer``, ``python -m workers`` and the Celery app."""

    model_config = SettingsConfigDict(env_prefix="HSX_", env_file=".env", extra="ignore")

    # --- broker -------------------------------------------------------------------------
    broker_url: str | None = None
    """Celery broker URL (``redis://``, ``rediss://`` or ``redis+socket://``). Unset: ``producer run``
    starts the embedded valkey-server on a unix socket under ``state_dir``; ``enqueue`` and
    workers refuse to start without one."""
    result_backend: str | None = None
    """Celery result backend URL; unset means the broker URL."""
    visibility_timeout_s: int = Field(default=6 * 3600, ge=1)
    """Seconds a claimed, unacknowledged task stays invisible before Redis delivers it again.
    Must be several times the longest task (FIELD-NOTES 5); the same value on every app. Values
    under 60 exist for the redelivery tests only: they make every longer task run twice."""
    queue: str = "gpu"
    """Celery queue that carries extraction tasks."""

    # --- store --------------------------------------------------------------------------
    store_url: str = "./out"
    """Where runs are written: a local directory or ``s3://bucket/prefix``."""
    s3_endpoint_url: str | None = None
    """S3 endpoint (SeaweedFS, MinIO, moto...). Unset: boto3's default (AWS or ``AWS_ENDPOINT_URL``)."""
    s3_region: str | None = None
    """S3 region; unset: boto3's default chain."""
    s3_access_key_id: str | None = None
    """S3 access key; unset: boto3's default credential chain (``AWS_*`` variables, profiles)."""
    s3_secret_access_key: str | None = None
    """S3 secret key; never printed or stored."""
    spool_dir: Path | None = None
    """Local directory of the overflow: where a worker puts a shard the store did not take at once
    (a shard normally goes straight from host memory into the store); unset: ``/dev/shm/hsx-spool``
    when /dev/shm has at least ``workers.spool.SHM_MIN_FREE_BYTES`` free, else ``<tmp>/hsx-spool``."""
    spool_max_fraction: float = Field(default=0.8, gt=0, le=1)
    """A shard goes to the spool only while its filesystem would not be fuller than this fraction with
    the shard in it; the spool never fills the disk."""
    max_pending_uploads: int = Field(default=2, ge=1)
    """Shards of a worker process that may wait in the spool (the overflow) for a store that did not
    take them at once; beyond that they wait in their host buffers, and once every buffer holds one,
    extraction pauses."""
    store_retry_s: float = Field(default=900.0, ge=0)
    """Seconds a worker keeps retrying a store call that fails for a transient reason (connection
    refused or reset, timeouts, throttling, HTTP 5xx), with exponential backoff and jitter, on top
    of botocore's own retries; the batch fails after that. 0: no retry beyond botocore's."""
    heartbeat_s: float = Field(default=5.0, gt=0)
    """Seconds between a worker's status records (``<run>/workers/<host>-<pid>.json``)."""
    faults: str | None = None
    """Fault injection, for the recovery tests only; never set it in production. Comma-separated:
    ``pause_<point>=S`` sleeps S seconds at that point of every batch (``forward``, ``upload``,
    ``store``, ``marker``), ``store_down=N`` / ``store_full=N`` / ``spool_full=N`` fail the first N
    store or spool writes of the process (``workers/faults.py`` has the table)."""

    # --- planning -----------------------------------------------------------------------
    max_length: int = Field(default=4096, ge=8)
    """Tokens per sample; longer samples are truncated (mask truncated the same way)."""
    batch_tokens: int = Field(default=32768, ge=8)
    """Token budget of one batch, counted as rows x longest row (padding included)."""
    max_batch_samples: int = Field(default=256, ge=1)
    """Upper bound on samples (rows) in one batch."""

    # --- workers ------------------------------------------------------------------------
    model: str | None = None
    """Target model a worker loads at start (hub id, local checkpoint or ``tiny-qwen3.5``).
    Unset: the worker loads the model named by the first run it serves."""
    worker_concurrency: int = Field(default=3, ge=1)
    """Batches in flight per worker process (one GPU each): its pinned host buffers, each holding one
    batch's states from the device-to-host copy until its shard is in the store. They share one GPU
    lock: one batch runs its forward while the others write their shards straight into the store,
    so the GPU does not wait on I/O. The process runs ``worker_concurrency + max_pending_uploads``
    task threads (:attr:`task_threads`): the extra ones wait for a slow store with their shard in
    the spool, not in a host buffer."""
    gdn_rows_as_sequences: bool = True
    """On CUDA with fla, run a batch's rows through the Gated DeltaNet kernel as one variable-length
    row (``workers.target.RowsAsSequences``): the same values, and one compiled kernel variant for
    every batch size instead of one per row count (a cold start of seconds, not minutes)."""
    workers_per_node: int | None = Field(default=None, ge=1)
    """Worker processes ``python -m workers`` starts; unset: one per visible GPU (one on CPU)."""
    device: str | None = None
    """Torch device of a worker; unset: ``cuda`` when available, else ``cpu``."""
    max_forward_tokens: int | None = Field(default=None, ge=1)
    """Most padded tokens (rows x longest row) one forward may hold; a planned batch above it runs
    as several forwards into the same shard. Unset: measured on CUDA at worker start from the free
    GPU memory (activation bytes per token of two probe forwards), no limit on the CPU."""
    allow_slow_kernels: bool = False
    """On CUDA, let a worker run a Gated DeltaNet model without the fla kernels (the torch reference
    path is correct but many times slower). Off: such a worker refuses to start."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint (off: only code that ships with transformers runs)."""
    allow_pickle_checkpoints: bool = False
    """Load ``.bin`` / ``.pt`` (pickle) checkpoints. Off: only safetensors weights are read, since
    unpickling a checkpoint runs whatever code it holds."""

    # --- local state --------------------------------------------------------------------
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    """Built-in models are generated here on first use."""
    state_dir: Path | None = None
    """Embedded broker's socket and AOF; unset: ``cache_dir/broker``."""

    # --- monitoring ---------------------------------------------------------------------
    flower_basic_auth: str | None = None
    """``USER:PASSWORD`` (comma-separated for several) that ``python -m producer flower`` requires;
    needed when Flower is bound to anything but loopback. Never printed (checked by the command, so
    that a malformed value is not echoed in a validation error)."""
    inspect_timeout_s: float = Field(default=1.0, gt=0, le=30)
    """Seconds ``producer status`` waits for the workers' ``gpu_stats`` replies over the broker."""

    @field_validator("broker_url", "result_backend")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        if not v.startswith(("redis://", "rediss://", "redis+socket://", "unix://")):
            raise ValueError(f"{v!r} is not a Redis URL: use redis://HOST:PORT/DB or redis+socket:///PATH")
        return v

    @property
    def task_threads(self) -> int:
        """Celery task threads per worker process: a host buffer's worth of batches in flight
        (``worker_concurrency``) plus the overflow's (``max_pending_uploads``)."""
        return self.worker_concurrency + self.max_pending_uploads

    @property
    def broker_state_dir(self) -> Path:
        return self.state_dir or (self.cache_dir / "broker")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
