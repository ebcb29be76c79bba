"""One small real run, made once per test session (the ``small_run`` fixture in conftest.py) and
shared by the verify, reader and export tests: ``producer run`` on 12 real ShareGPT records with
the tiny-qwen3.5 target, EAGLE-3 layers, both final states, bf16 storage, a few batches. Tests that alter a run work on a
copy (:func:`copy_run`); the original stays as the job wrote it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

SMALL_JOB = ["sharegpt", "--model", "tiny-qwen3.5", "--limit", "12", "--max-length", "256", "--batch-tokens", "1024",
             "--final", "both"]
"""The shared small job; the ``small_run`` fixture (conftest.py) runs it once per session."""


def copy_run(small_run: dict, dest: Path) -> Path:
    """A copy of the shared run under ``dest`` (same run id); returns its directory.

    The shared worker still writes its presence into the run while the session lasts; its
    in-flight temporary files (renamed into place a moment later) are left out of the copy."""
    target = dest / small_run["report"]["run_id"]
    shutil.copytree(small_run["dir"], target, ignore=shutil.ignore_patterns(".hsx-tmp-*"))
    return target


def upload_run(run_dir: Path, store) -> None:
    """Copy every file of a local run into ``store`` (an S3 run store), keys relative to the run."""
    from hsx.store import write_file

    for path in sorted(run_dir.rglob("*")):
        if path.is_file():
            write_file(store, path.relative_to(run_dir).as_posix(), path)


def quarantine_first_sample(run_dir: Path, batch: str) -> int:
    """Rewrite ``batch`` of a local run as a worker does when it quarantines a sample: the shard
    without its first sample, the marker naming the new shard with that sample under
    ``quarantined``. Returns the quarantined sample's index."""
    import hashlib
    import json

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    marker_path = run_dir / "markers" / f"{batch}.json"
    marker = json.loads(marker_path.read_text())
    old = run_dir / marker["shard"]["key"]
    with safe_open(str(old), framework="pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    cu_N1 = t["cu_seqlens"]
    sample = int(t["sample_index"][0])
    keep_T = torch.ones(int(cu_N1[-1]), dtype=torch.bool)
    keep_T[: int(cu_N1[1])] = False
    new = {k: v[keep_T].contiguous() for k, v in t.items() if k not in ("cu_seqlens", "sample_index")}
    new["sample_index"] = t["sample_index"][1:].contiguous()
    new["cu_seqlens"] = (cu_N1[1:] - cu_N1[1]).contiguous()
    key = f"shards/{batch}-requarantined.safetensors"
    save_file(new, str(run_dir / key), metadata=meta)
    old.unlink()
    data = (run_dir / key).read_bytes()
    marker.update({
        "shard": {"key": key, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
        "planned_samples": marker["num_samples"], "planned_tokens": marker["num_tokens"],
        "num_samples": marker["num_samples"] - 1, "num_tokens": int(keep_T.sum()),
        "supervised_tokens": int(new["loss_mask"].sum()),
        "quarantined": [{"sample_index": sample, "reason": "nonfinite hidden states (layers 1) [test]"}],
        "num_quarantined": 1,
    })
    marker_path.write_text(json.dumps(marker, indent=1, sort_keys=True))
    return sample
