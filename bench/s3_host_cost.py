"""Host cost of the S3 write path per GB, against a loopback SeaweedFS, here (no GPU).

The GPU machine cannot carry an S3 server beside the worker's wheels (64 MiB a call), so the S3 half
of the throughput target is measured where one runs: on this machine, the same bytes of a shard
(bf16 states of a 32,768-token, 5-layer batch of a width-``--hidden`` model, serialised by
``hsx.shard.serialize_shard``) go to the store three ways, each timed (wall) and charged
(this process's user + system CPU seconds, ``resource.getrusage``; the server's are its own):

- **ours**: ``S3Store.write_stream`` from host memory (what a worker does), the server checking
  each part's SHA-256, the whole object's sha256 computed beside the upload;
- **plain**: boto3's ``upload_fileobj`` of one bytes object of the same size, 64 MiB parts, 8 at a
  time (bench/plain_upload.py: the ceiling for the same bytes, no code of ours on its path);
- **spool hop**: what an overflowed shard does (write the spool file hashing it, then
  ``hsx.store.write_file`` from it, which checks the stored sha256 against the spool's), for the
  difference.

The server shares this machine's cores, so the GB/s are this machine's, not a network's: the
figure that carries over is CPU seconds per GB on our side.

    python bench/s3_host_cost.py --json bench/results/s3-host-cost-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from e2e_throughput import S3Server  # noqa: E402
from plain_upload import PlainUploader  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn) -> tuple[float, float]:
    c0, t0 = _cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, _cpu() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from hsx.shard import serialize_shard
    from hsx.store import write_file
    from workers.spool import write_shard

    g = torch.Generator().manual_seed(0)
    tensors = {"hidden_states": torch.randn(args.tokens, args.layers, args.hidden, generator=g).to(torch.bfloat16),
               "input_ids": torch.randint(0, 150_000, (args.tokens,), generator=g, dtype=torch.int32),
               "loss_mask": torch.ones(args.tokens, dtype=torch.uint8)}
    pieces = serialize_shard(tensors, {"batch": "bench"})
    nbytes = sum(len(p) for p in pieces)
    blob = b"".join(pieces)
    work = Path(tempfile.mkdtemp(prefix="hsx-s3cost-"))
    server = S3Server(work / "weed").start()
    store = server.store()
    spool = work / "spool"
    spool.mkdir()
    rows: dict[str, list] = {"ours": [], "plain": [], "spool_hop": []}
    plain = PlainUploader(server.endpoint, "bench", "bench", "bench-secret")
    try:
        for i in range(args.repeats):
            rows["plain"].append(timed(lambda: plain.upload(f"plain-{i}", blob)))
            rows["ours"].append(timed(lambda: store.write_stream(f"ours-{i}", pieces)))

            def hop():
                path = spool / f"s-{i}"
                _, sha = write_shard(path, pieces)
                write_file(store, f"hop-{i}", path, sha)
                path.unlink()

            rows["spool_hop"].append(timed(hop))
            plain.delete(f"plain-{i}")
            for k in (f"ours-{i}", f"hop-{i}"):
                store.delete(k)
    finally:
        server.stop()
    out = {"machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_avg": os.getloadavg()},
           "shard_bytes": nbytes, "server": "SeaweedFS weed mini on loopback, data on " + str(work),
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    for name, samples in rows.items():
        best = min(samples)
        out[name] = {"gb_s_best": round(nbytes / best[0] / 1e9, 3),
                     "gb_s_median": round(nbytes / sorted(s[0] for s in samples)[len(samples) // 2] / 1e9, 3),
                     "cpu_s_per_gb": round(sorted(s[1] for s in samples)[len(samples) // 2] / (nbytes / 1e9), 3),
                     "samples_wall_cpu_s": [[round(a, 3), round(b, 3)] for a, b in samples]}
    out["ours_over_plain"] = round(out["ours"]["gb_s_median"] / out["plain"]["gb_s_median"], 3)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    print(f"shard {nbytes / 1e9:.2f} GB")
    for name in rows:
        print(f"{name:>10}: {out[name]['gb_s_median']:.3f} GB/s median, {out[name]['cpu_s_per_gb']:.2f} CPU s/GB (ours side)")
    print(f"ours / plain: {out['ours_over_plain']}")


if __name__ == "__main__":
    main()
