#!/usr/bin/env bash
# Load every hsx export with the released code of the trainer that reads it, to one training batch.
#
#   scripts/compat.sh [RUN_DIR]
#
# Each consumer is installed from PyPI in its own venv under .compat/ (ignored by git: the script
# writes .compat/.gitignore), because their pins conflict with ours and with each other:
#   specforge 0.2.0        pins torch==2.11.0, transformers==5.8.1 and sglang==0.5.14; installed with
#                          --no-deps plus what its reader, normaliser and collator modules import
#                          (transformers 5.8.1, datasets), so no sglang and no GPU stack
#   speculators 0.9.0      with its own dependencies (transformers <= 5.19, hs-connectors 0.9.0)
#   nvidia-modelopt 0.47.0 with its own dependencies, plus transformers and requests (its eagle and
#                          dataset utils import them without declaring them)
#   eagle-llm 1.2.1        (EAGLE-1/2, the ge_data layout) --no-deps: its pins (torch 2.0.1, gradio,
#                          fschat) are for its demo apps; its training data code needs torch only
# Every venv gets the same torch ($COMPAT_TORCH, default torch==2.13.0; set
# COMPAT_TORCH_INDEX=https://download.pytorch.org/whl/cpu for a CPU-only wheel).
#
# Without RUN_DIR it first makes a small run with the project's own venv ($HSX_PYTHON, default
# .venv/bin/python): 24 real ShareGPT records through tiny-qwen3.5, EAGLE-3 layers, both final
# states, which every format can be exported from. Then it exports the run in every format, runs
# scripts/compat_<consumer>.py in each consumer's venv on the exports, and writes the versions and
# results to .compat/report.md (also printed). Exit status 1 if any consumer failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
COMPAT=${HSX_COMPAT_DIR:-$ROOT/.compat}
PY=${HSX_PYTHON:-$ROOT/.venv/bin/python}
BASE_PYTHON=${COMPAT_BASE_PYTHON:-python3}
TORCH=${COMPAT_TORCH:-torch==2.13.0}
TORCH_INDEX=${COMPAT_TORCH_INDEX:-}
mkdir -p "$COMPAT"
echo '*' > "$COMPAT/.gitignore"

# --- consumer venvs ------------------------------------------------------------------------------
# name | pip install arguments after torch, groups separated by " ;; " ("uninstall X": pip uninstall -y X).
# speculators requires torchvision and torchaudio but imports neither; their PyPI wheels are built for
# PyPI's CUDA torch and fail to load beside a CPU torch, and transformers imports torchvision whenever
# it is installed, so they are removed again.
CONSUMERS=(
  "specforge|--no-deps specforge==0.2.0 ;; transformers==5.8.1 datasets numpy"
  "speculators|speculators==0.9.0 ;; uninstall torchvision torchaudio"
  "modelopt|nvidia-modelopt==0.47.0 transformers requests"
  "eagle|--no-deps eagle-llm==1.2.1 ;; numpy"
)

install_venv() {  # name, pip specs (groups separated by " ;; ", each one pip install or uninstall)
  local name=$1 specs=$2 venv=$COMPAT/venv-$1
  local stamp="$TORCH $TORCH_INDEX | $specs"
  if [[ -f $venv/.hsx-stamp && $(cat "$venv/.hsx-stamp") == "$stamp" ]]; then
    return 0
  fi
  echo "== installing $name into $venv"
  rm -rf "$venv"
  "$BASE_PYTHON" -m venv "$venv"
  local pip=("$venv/bin/pip" install -q)
  if [[ -n $TORCH_INDEX ]]; then
    "${pip[@]}" --index-url "$TORCH_INDEX" "$TORCH"
  else
    "${pip[@]}" "$TORCH"
  fi
  # Keep the torch just installed: a consumer's own torch pin would replace it with another build.
  "$venv/bin/python" -c "import torch; print('torch==' + torch.__version__)" > "$venv/torch-constraint.txt"
  local group
  while IFS= read -r group; do
    # shellcheck disable=SC2086
    if [[ $group == uninstall\ * ]]; then
      "$venv/bin/pip" uninstall -q -y ${group#uninstall }
    elif [[ -n ${group// } ]]; then
      "${pip[@]}" -c "$venv/torch-constraint.txt" $group
    fi
  done < <(echo "$specs" | sed 's/ ;; /\n/g')
  echo "$stamp" > "$venv/.hsx-stamp"
}

for entry in "${CONSUMERS[@]}"; do
  install_venv "${entry%%|*}" "${entry#*|}"
done
[[ ${COMPAT_INSTALL_ONLY:-} == 1 ]] && exit 0

# --- the run and its exports ---------------------------------------------------------------------
export HSX_CACHE_DIR=${HSX_CACHE_DIR:-$COMPAT/cache} HSX_STATE_DIR=${HSX_STATE_DIR:-$COMPAT/state}
if [[ $# -ge 1 ]]; then
  RUN=$1
else
  RUN_ID=$("$PY" -m producer run sharegpt --model tiny-qwen3.5 --limit 24 --max-length 512 --batch-tokens 2048 \
             --final both --output "$COMPAT/out" --json | "$PY" -c "import json, sys; print(json.load(sys.stdin)['run_id'])")
  RUN=$COMPAT/out/$RUN_ID
fi
EXPORTS=$COMPAT/exports
rm -rf "$EXPORTS"
mkdir -p "$EXPORTS"
FORMATS=(specforge-eagle3 specforge-dflash specforge-dspark speculators eagle-ge-data modelopt)
for fmt in "${FORMATS[@]}"; do
  "$PY" -m producer export "$RUN" --format "$fmt" "$EXPORTS/$fmt" --group-size 8 > "$EXPORTS/$fmt.log"
done

# --- each consumer on its exports ----------------------------------------------------------------
REPORT=$COMPAT/report.md
{
  echo "compatibility check, $(date -u +%Y-%m-%dT%H:%MZ), hsx $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+dirty')"
  echo "run: $RUN"
  echo
} > "$REPORT"
status=0
check() {  # consumer, formats...
  local name=$1; shift
  local venv=$COMPAT/venv-$name
  local versions
  versions=$("$venv/bin/python" -m pip list --format=freeze 2>/dev/null \
    | grep -i -E '^(specforge|speculators|hs-connectors|nvidia-modelopt|eagle-llm|torch|transformers|datasets)==' | tr '\n' ' ')
  echo "## $name: $versions" >> "$REPORT"
  local fmt
  for fmt in "$@"; do
    if out=$("$venv/bin/python" "scripts/compat_$name.py" "$fmt" "$EXPORTS/$fmt" 2>"$COMPAT/$name-$fmt.err"); then
      echo "$out" >> "$REPORT"
    else
      status=1
      echo "FAIL $fmt: $(tail -n 3 "$COMPAT/$name-$fmt.err" | tr '\n' ' ')" >> "$REPORT"
    fi
  done
  echo >> "$REPORT"
}
check specforge specforge-eagle3 specforge-dflash specforge-dspark
check speculators speculators
check modelopt modelopt
check eagle eagle-ge-data
cat "$REPORT"
exit $status
