#!/usr/bin/env bash
# On the lent H200 (device tool): bench/e2e_throughput.py for each SPEC, results under $OUT.
#   bench/device_e2e.sh NAME:SHAPE:NUM_LAYERS:LIMIT:TIMEOUT_S ...     (NUM_LAYERS empty: all)
# Carry .whl (../shared/gpu/fetch-wheels.sh .whl) and .benchdata/e2e-sharegpt.parquet
# (python bench/e2e_throughput.py --make-dataset .benchdata/e2e-sharegpt.parquet). The checkpoint goes
# to /dev/shm (128 GB), the store to /root on the 64 GB disk, TRITON_CACHE_DIR to /tmp/hsx-triton
# (kept while the machine stays warm, so a later call measures the warm start).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/hsx-triton}
{ df -h / /root /tmp /dev/shm; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv;
  python3 -c "import torch, transformers, fla; print(torch.__version__, transformers.__version__, fla.__version__)"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
for spec in "$@"; do
  IFS=: read -r name shape layers limit tmo <<< "$spec"
  extra=()
  [ -n "$layers" ] && extra=(--num-layers "$layers")
  timeout $((tmo + 200)) python3 bench/e2e_throughput.py --shape "$shape" "${extra[@]}" --dataset .benchdata/e2e-sharegpt.parquet \
    --limit "$limit" --stores disk:/root/hsx-store --checkpoint-dir "/dev/shm/hsx-ckpt-$name" --workdir "/tmp/hsx-e2e-$name" \
    --timeout-s "$tmo" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"; tail -4 "$OUT/$name.log"
  cp /tmp/hsx-e2e-$name/cache-disk/logs/workers-*.log "$OUT/$name-workers.log" 2>/dev/null
  rm -rf "/dev/shm/hsx-ckpt-$name" /root/hsx-store
done
