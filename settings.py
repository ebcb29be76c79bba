"""One settings object for the producer, the workers and the CLI.

Every value comes from an environment variable with the prefix ``HSX_`` (for example
``HSX_BROKER_URL``) or from a ``.env`` file in the working directory; command-line options
override them. No other module reads ``os.environ``: pass a :class:`Settings` around instead.
Bad values are refused at load time: :func:`get_settings` raises :class:`hsx.errors.BadSettings`,
one line per bad value with the variable, the value (secrets hidden, URL passwords masked), the
rule and the fix, never pydantic's raw report.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hsx.errors import BadSettings

ENV_PREFIX = "HSX_"
#: fields whose value is never echoed in an error (a malformed secret is still a secret).
SECRET_FIELDS = frozenset({"s3_access_key_id", "s3_secret_access_key", "flower_basic_auth"})
#: fields that hold URLs: echoed with any password masked (``hsx.store.mask_url``).
URL_FIELDS = frozenset({"broker_url", "store_url", "s3_endpoint_url"})


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "hsx"


class Settings(BaseSettings):
    """Configuration shared by ``python -m producer``, ``python -m workers`` and the Celery app.

    Every field is one a user sets; the comment above it says who needs it. What only the launcher
    sets is no setting: it tells its children where to list their runs through
    ``HSX_WORKER_RUNS_DIR`` (:data:`NOT_SETTINGS`)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=".env", extra="ignore")

    # --- broker -------------------------------------------------------------------------
    # who needs it: the cluster's broker (unset: the embedded one of ``producer run``)
    broker_url: str | None = None
    """Celery broker URL (``redis://``, ``rediss://`` or ``redis+socket://``). Unset: ``producer run``
    starts the embedded valkey-server on a unix socket under ``state_dir``; ``enqueue`` and
    workers refuse to start without one."""
    # who needs it: a deployment whose batches run longer than ~1.5 h must raise it
    visibility_timeout_s: int = Field(default=6 * 3600, ge=1)
    """Seconds a claimed, unacknowledged task stays invisible before Redis delivers it again.
    Must be several times the longest task (docs/FACTS.md section 5); the same value on every app. Values
    under 60 exist for the redelivery tests only: they make every longer task run twice."""
    # who needs it: one queue per model lets several fleets share one broker
    queue: str = "gpu"
    """Celery queue that carries extraction tasks."""

    # --- store --------------------------------------------------------------------------
    # who needs it: where runs go, and the root a worker serves
    store_url: str = "./out"
    """Where runs are written: a local directory or ``s3://bucket/prefix``."""
    # who needs it: a worker that serves runs of several store roots
    allowed_stores: str | None = None
    """Store roots a worker serves besides ``store_url``: comma-separated local paths or
    ``s3://bucket/prefix`` URLs. A task whose run lies under none of them (compared by whole path
    segments after resolving links, ``hsx/access.py``) is refused before the worker touches it."""
    # who needs it: a self-hosted S3 (SeaweedFS, MinIO) instead of AWS
    s3_endpoint_url: str | None = None
    """S3 endpoint (SeaweedFS, MinIO, moto...). Unset: boto3's default (AWS or ``AWS_ENDPOINT_URL``)."""
    # who needs it: S3 access without an AWS profile
    s3_region: str | None = None
    """S3 region; unset: boto3's default chain."""
    # who needs it: S3 access without an AWS profile
    s3_access_key_id: str | None = None
    """S3 access key; unset: boto3's default credential chain (``AWS_*`` variables, profiles)."""
    # who needs it: S3 access without an AWS profile
    s3_secret_access_key: str | None = None
    """S3 secret key; never printed or stored."""
    # who needs it: puts the overflow on a fast local disk (the compose worker does)
    spool_dir: Path | None = None
    """Local directory of the overflow: where a worker puts a shard the store did not take at once
    (a shard normally goes straight from host memory into the store); unset: ``/dev/shm/hsx-spool``
    when /dev/shm has at least ``workers.spool.SHM_MIN_FREE_BYTES`` free, else ``<tmp>/hsx-spool``."""
    # who needs it: how much of a shared spool disk the overflow may take
    spool_max_fraction: float = Field(default=0.8, gt=0, le=1)
    """A shard goes to the spool only while its filesystem would not be fuller than this fraction with
    the shard in it; the spool never fills the disk."""
    # who needs it: sizes the overflow to ride out a store outage (README, "What to size")
    max_pending_uploads: int = Field(default=2, ge=1)
    """Shards of a worker process that may wait in the spool (the overflow) for a store that did not
    take them at once; beyond that they wait in their host buffers, and once every buffer holds one,
    extraction pauses."""
    # who needs it: how long a store outage may last before batches fail
    store_retry_s: float = Field(default=900.0, ge=0)
    """Seconds a worker keeps retrying a store call that fails for a transient reason (connection
    refused or reset, timeouts, throttling, HTTP 5xx), with exponential backoff and jitter, on top
    of botocore's own retries; the batch fails after that. 0: no retry beyond botocore's."""
    # who needs it: trades status freshness for store writes (one per run and interval)
    heartbeat_s: float = Field(default=5.0, gt=0)
    """Seconds between a worker's status records (``<run>/workers/<host>-<pid>.json``)."""
    # who needs it: how long a dead node's batches wait; must outlast the store's longest stall
    lease_s: float = Field(default=120.0, gt=0)
    """Seconds a claimed batch stays held without a heartbeat of its worker (``workers/lease.py``):
    after that, any live worker puts it back at the head of the queue (a SIGKILLed worker, a lost node). Keep it several
    times ``HSX_HEARTBEAT_S``; a lease that expires under a live worker only causes a duplicate run,
    which the marker settles."""
    # who needs it: bounds a stranded batch's wait (the tests shorten it)
    reclaim_interval_s: float = Field(default=15.0, gt=0)
    """Seconds between two looks of a worker for batches whose lease expired (one ``HGETALL`` of the
    broker's claims; 15 s keeps a stranded batch's wait, lease + look + one batch, under 3 minutes)."""
    # who needs it: the backoff of transient retries (the tests shorten it)
    task_retry_base_s: float = Field(default=5.0, gt=0)
    """First wait (seconds) before a task that failed for a transient reason is delivered again; it
    doubles with each retry of that task, up to ``HSX_TASK_RETRY_MAX_S``."""
    # who needs it: the backoff of transient retries (the tests shorten it)
    task_retry_max_s: float = Field(default=300.0, gt=0)
    """Longest wait between two retries of a task (seconds)."""

    # --- planning -----------------------------------------------------------------------
    # who needs it: the default of ``--max-length``
    max_length: int = Field(default=4096, ge=8)
    """Tokens per sample; longer samples are truncated (mask truncated the same way)."""
    # who needs it: the default of ``--batch-tokens``
    batch_tokens: int = Field(default=32768, ge=8)
    """Token budget of one batch, counted as rows x longest row (padding included)."""
    # who needs it: bounds rows per batch, and so the warm-up's compiles
    max_batch_samples: int = Field(default=256, ge=1)
    """Upper bound on samples (rows) in one batch (of a regenerate run too: answers per generate call)."""
    # who needs it: the default of ``--regen-batch-tokens``: a GPU's room for a regenerate batch's KV cache
    regen_batch_tokens: int = Field(default=262144, ge=8)
    """Token budget of one regenerate batch, counted as rows x (longest prompt + ``--max-new-tokens``):
    what one generate call holds in its KV cache and activations (``producer/planner.py``
    :class:`RegenPlanJob`). 262,144 tokens is 256 answers of 512 tokens to prompts of 512, about
    36 GiB of Qwen3-8B's bf16 KV cache; lower it for a target with a larger cache per token."""
    # who needs it: the default of ``--num-proc`` on a machine shared with other jobs
    plan_num_proc: int | None = Field(default=None, ge=1)
    """Processes that tokenise the dataset (``--num-proc``); None: the machine's cores (one for a plan
    of under 2,000 records). The plan is the same whatever it is."""

    # --- workers ------------------------------------------------------------------------
    # who needs it: the checkpoint a worker loads before its first task
    model: str | None = None
    """Target model a worker loads at start (hub id, local checkpoint or ``tiny-qwen3.5``); the worker
    then serves only runs planned for this checkpoint (same identity as ``run.json``'s ``model``)
    and refuses the others without loading anything. Unset: the worker loads the model named by
    the run it serves."""
    # who needs it: batches in flight per GPU: sized against the store's bandwidth
    worker_concurrency: int = Field(default=4, ge=1)
    """Batches in flight per worker process (one GPU each): its pinned host buffers, each holding one
    batch's states from the device-to-host copy until its shard is in the store. They share one GPU
    lock: one batch runs its forward while the others write their shards straight into the store,
    so the GPU does not wait on I/O. A buffer is taken before the GPU lock and held through the
    copy and the write (hashed beside it), so a fast target needs about 2 + (copy + write) / forward
    of them; with 3, an MoE target's forward steps waited for a buffer half their time and its GPU
    idled between batches (BENCHMARKS.md, "Where an MoE worker's GPU waits", 2026-12-06): 4. The process runs ``worker_concurrency + max_pending_uploads``
    task threads (:attr:`task_threads`): the extra ones wait for a slow store with their shard in
    the spool, not in a host buffer."""
    # who needs it: load speed against the host's CPUs
    load_threads: int = Field(default=16, ge=1)
    """Threads that copy the checkpoint's tensors to the device while a worker loads its target
    (transformers' loading pool, ``core_model_loading.GLOBAL_WORKERS``, 4 by default upstream), at
    most the host's CPUs. ``bench/load.py`` measures the load's GB/s with each."""
    # who needs it: load time against imports (0 turns the read-ahead off, for a comparison)
    load_prefetch_threads: int = Field(default=4, ge=0)
    """Threads that start reading the checkpoint's tensors to the GPU before the model's code is
    imported (``workers.loading.StreamedCheckpoint.prefetch``): the import's seconds (transformers'
    model module, fla, Triton) are then spent reading too. Only with ``fast_load``."""
    # who needs it: a checkpoint our loader cannot read (it then loads as transformers does it)
    fast_load: bool = True
    """On CUDA, read the checkpoint's safetensors files with ``os.preadv`` into pinned host buffers
    and copy them to the GPU asynchronously (``workers/loading.py``), handing the tensors to
    transformers' ``from_pretrained`` as a ``state_dict``; off: transformers' own loader (a memory
    map per file, a copy per tensor from pageable memory; 2-3x slower on the H200, BENCHMARKS.md
    "Loading a target"). Remote-code models and non-safetensors checkpoints always load as
    transformers does it."""
    # who needs it: off where the store must hold no compiled code
    compile_cache: bool = True
    """Share Triton's compile cache (``TRITON_CACHE_DIR``) through the store: the first CUDA worker
    that warms up without it stores its cache at ``compile-cache/triton/<GPU arch + torch, triton,
    fla versions>.tar.gz`` under ``HSX_STORE_URL``; later workers (a new node's) unpack it before
    their warm-up and compile nothing (``workers/compile_cache.py``)."""
    compile_cache_top_up_s: float = Field(default=60.0, ge=0)
    """Seconds between a CUDA worker's looks for kernels it compiled after its warm-up (a run's
    larger ``--batch-tokens``, a shape the warm-up did not meet); new ones are stored beside the
    compile cache (``compile-cache/triton/<key>/extra/``) and unpacked by later workers before their
    warm-up. 0: off."""
    # who needs it: targets larger than one GPU
    gpus_per_worker: int = Field(default=1, ge=1)
    """GPUs of one worker process: ``python -m workers`` splits the visible GPUs into consecutive
    groups of this many (their count must be a multiple of it) and starts one worker per group, its
    CUDA_VISIBLE_DEVICES set to the group; the worker leads K ranks (ranks 1..K-1 its child
    processes) and its target is split across them by tensor parallelism (``workers/group.py``,
    ``workers/parallel.py``; K must divide the model's KV heads). With ``HSX_DEVICE=cpu`` set
    explicitly: K gloo ranks on the CPU (tests). 1: one GPU per worker."""
    # who needs it: fewer workers than GPUs (a node shared with other jobs)
    workers_per_node: int | None = Field(default=None, ge=1)
    """Worker processes ``python -m workers`` starts; unset: one per visible GPU (one on CPU)."""
    # who needs it: the launcher's restart policy, for docker / systemd supervision
    worker_restart_delay_s: float = Field(default=1.0, gt=0)
    """Seconds ``python -m workers`` waits before restarting a worker process that died (killed, or
    exited non-zero without being asked to stop); the wait doubles with each restart of that process
    within ``worker_restart_window_s``, up to ``worker_restart_max_delay_s``."""
    # who needs it: the launcher's restart policy, for docker / systemd supervision
    worker_restart_max_delay_s: float = Field(default=60.0, gt=0)
    """Longest wait before a restart (seconds)."""
    # who needs it: the launcher's restart policy, for docker / systemd supervision
    worker_restart_limit: int = Field(default=5, ge=0)
    """Restarts of one worker process allowed within ``worker_restart_window_s``; one more death and
    ``python -m workers`` stops the other workers (warm shutdown) and exits 1. 0: never restart."""
    # who needs it: the launcher's restart policy, for docker / systemd supervision
    worker_restart_window_s: float = Field(default=600.0, gt=0)
    """Seconds over which restarts are counted (for the limit and the doubling wait)."""
    # who needs it: a broker that starts slower than the workers (compose)
    broker_check_timeout_s: float = Field(default=5.0, gt=0, le=300)
    """Seconds ``python -m workers`` keeps trying to reach the broker (PING) before it starts any
    worker process; it refuses to start when the broker does not answer in that time."""
    # who needs it: a CPU worker on a machine with a GPU
    device: str | None = None
    """Torch device of a worker; unset: ``cuda`` when available, else ``cpu``."""
    # who needs it: a GPU shared with another process, where the measurement would be wrong
    max_forward_tokens: int | None = Field(default=None, ge=1)
    """Most padded tokens (rows x longest row) one forward may hold; a planned batch above it runs
    as several forwards into the same shard. Unset: measured on CUDA at worker start from the free
    GPU memory (activation bytes per token of two probe forwards), no limit on the CPU."""
    # who needs it: an explicit opt-in to a slow path
    allow_slow_kernels: bool = False
    """On CUDA, let a worker run a Gated DeltaNet model without the fla kernels (the torch reference
    path is correct but many times slower). Off: such a worker refuses to start."""
    # who needs it: an explicit opt-in to run checkpoint code
    trust_remote_code: bool = False
    """Allow model code from the checkpoint (off: only code that ships with transformers runs)."""
    # who needs it: an explicit opt-in to unpickling
    allow_pickle_checkpoints: bool = False
    """Load ``.bin`` / ``.pt`` (pickle) checkpoints. Off: only safetensors weights are read, since
    unpickling a checkpoint runs whatever code it holds."""

    # --- local state --------------------------------------------------------------------
    # who needs it: local state off the home directory
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    """Built-in models are generated here on first use."""
    # who needs it: a second concurrent ``producer run`` on one machine needs its own
    state_dir: Path | None = None
    """Embedded broker's socket and AOF; unset: ``cache_dir/broker``."""

    # --- monitoring ---------------------------------------------------------------------
    # who needs it: Flower bound anywhere but loopback
    flower_basic_auth: str | None = None
    """``USER:PASSWORD`` (comma-separated for several) that ``python -m producer flower`` requires;
    needed when Flower is bound to anything but loopback. Never printed (checked by the command, so
    that a malformed value is not echoed in a validation error)."""
    # who needs it: workers that answer slower than 1 s (a distant or busy broker)
    inspect_timeout_s: float = Field(default=1.0, gt=0, le=30)
    """Seconds ``producer status`` waits for the workers' ``gpu_stats`` replies over the broker."""

    @field_validator("broker_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        if not v.startswith(("redis://", "rediss://", "redis+socket://", "unix://")):
            # The value itself is shown (masked) by settings_error; the rule here must not echo a password.
            raise ValueError("should be a Redis URL: redis://[:PASSWORD@]HOST:PORT/DB, rediss://... or redis+socket:///PATH")
        return v

    @field_validator("device")
    @classmethod
    def _torch_device(cls, v: str | None) -> str | None:
        # Checked at start, not 60 s later by torch inside the first batch (issue 22): the device
        # types a worker can run a forward on, with an optional index (torch.device's own syntax).
        if v is None or v.strip() == "":
            return None
        v = v.strip()
        if not re.fullmatch(r"(cpu|cuda|xpu|mps|npu|hpu)(:\d+)?", v):
            raise ValueError(f"{v!r} is not a torch device a worker can run on: use cpu, cuda or cuda:N (also xpu, mps, "
                             "npu, hpu), or leave HSX_DEVICE unset for cuda when available, else cpu")
        return v

    @property
    def task_threads(self) -> int:
        """Celery task threads per worker process: a host buffer's worth of batches in flight
        (``worker_concurrency``) plus the overflow's (``max_pending_uploads``)."""
        return self.worker_concurrency + self.max_pending_uploads

    @property
    def broker_state_dir(self) -> Path:
        return self.state_dir or (self.cache_dir / "broker")


def _shown(field: str, value) -> str:
    """``value`` as an error may print it: secrets hidden, URL passwords masked."""
    if field in SECRET_FIELDS:
        return "***"
    if field in URL_FIELDS and isinstance(value, str):
        from hsx.storeurl import mask_url

        return repr(mask_url(value))
    return repr(value)


def _rule(error: dict) -> str:
    """pydantic's message as a rule: "Input should be ..." -> "should be ...", no "Value error, "."""
    msg = str(error.get("msg", "invalid"))
    for prefix, repl in (("Value error, ", ""), ("Input should", "should")):
        if msg.startswith(prefix):
            msg = repl + msg[len(prefix):]
    if error.get("type") == "bool_parsing":
        msg += " (true/false, 1/0, yes/no, on/off)"
    return msg


def _fix(field: str) -> str:
    var = f"{ENV_PREFIX}{field.upper()}"
    info = Settings.model_fields.get(field)
    if info is None:
        return "set a valid value"
    if info.default_factory is not None:
        return f"set a valid value, or unset {var} for its default"
    if info.default is None:
        return f"set a valid value, or unset {var}"
    default = str(info.default).lower() if isinstance(info.default, bool) else info.default
    return f"set a valid value, or unset {var} for the default {default}"


def settings_error(exc: ValidationError, environ: dict[str, str] | None = None) -> BadSettings:
    """A :class:`BadSettings` for pydantic's ``exc``: one line per bad value, as
    ``HSX_MAX_LENGTH='4' (environment): should be greater than or equal to 8; fix: set a valid
    value, or unset HSX_MAX_LENGTH for the default 4096``.

    ``environ`` (default ``os.environ``) tells whether a value came from the environment or from
    the ``.env`` file. Secret fields (:data:`SECRET_FIELDS`) are never echoed; URL fields are
    masked.
    """
    environ = os.environ if environ is None else environ
    env_keys = {k.upper() for k in environ}
    problems = []
    lines = []
    for err in exc.errors(include_url=False):
        loc = err.get("loc") or ()
        field = str(loc[0]) if loc else "?"
        var = f"{ENV_PREFIX}{field.upper()}"
        source = "environment" if var in env_keys else ".env file or argument"
        value = err.get("input")
        rule = _rule(err)
        problems.append({"field": field, "variable": var, "value": _shown(field, value), "rule": rule, "source": source})
        lines.append(f"{var}={_shown(field, value)} ({source}): {rule}; fix: {_fix(field)}")
    if len(lines) == 1:
        message = f"bad setting {lines[0]}"
    else:
        message = f"{len(lines)} bad settings:\n" + "\n".join(f"  {line}" for line in lines)
    return BadSettings(message, problems)


#: ``HSX_*`` variables that are not settings: read by scripts/compat.sh, scripts/test.sh and
#: docker-compose.yml, and ``HSX_WORKER_RUNS_DIR``, which ``python -m workers`` sets for its children
#: (``workers.heartbeat.RUNS_DIR_ENV``: no user sets it).
#: ``HSX_FAULTS`` is the recovery tests' fault injection (``workers.faults.ENV``, read there: no user sets it).
NOT_SETTINGS = frozenset({"HSX_COMPAT_DIR", "HSX_FAULTS", "HSX_IMAGE", "HSX_PYTHON", "HSX_TEST_PROCESSES",
                          "HSX_WORKER_RUNS_DIR"})


def unknown_variables(environ=None) -> list[str]:
    """``HSX_*`` names in ``environ`` (default ``os.environ``) that are no setting, each with the
    closest setting's name when one is close (a misspelling would otherwise be ignored)."""
    import difflib

    environ = os.environ if environ is None else environ
    known = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    out = []
    for var in sorted(k.upper() for k in environ):
        if var.startswith(ENV_PREFIX) and var not in known and var not in NOT_SETTINGS:
            close = difflib.get_close_matches(var, sorted(known), n=1, cutoff=0.8)
            out.append(f"{var} (did you mean {close[0]}?)" if close else var)
    return out


def load_settings(**overrides) -> Settings:
    """:class:`Settings` from the environment (and ``overrides``), with readable errors.

    Raises:
        BadSettings: a value breaks its field's rule (see :func:`settings_error`), or an ``HSX_*``
            variable names no setting (a misspelled one would be ignored for a whole run).
    """
    unknown = unknown_variables()
    if unknown:
        raise BadSettings(
            f"{', '.join(unknown)}: not {'a setting' if len(unknown) == 1 else 'settings'} of hsx (settings.py lists "
            "them; README 'Settings'); fix: correct the name, or unset it",
            [{"field": None, "variable": u.split(" ", 1)[0], "value": None, "rule": "no such setting",
              "source": "environment"} for u in unknown])
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise settings_error(exc) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment.

    Raises:
        BadSettings: a value breaks its field's rule (not cached: the next call reads again).
    """
    return load_settings()
