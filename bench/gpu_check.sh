#!/usr/bin/env bash
# evalsuite on a lent GPU machine, in parts of at most 8 minutes each: every task on the hf and intref backends
# on CUDA against the same run on that machine's CPU, the EXL3 pack through exllamav3, `--device auto` over the
# GPU and the CPU, and the real-shape wide fixture loaded on the GPU. For each part it prints the exit codes, the
# wall time, the peak GPU memory (nvidia-smi, sampled) beside the memory plan's figure, and the agreement of
# every metric with the CPU run of the same pair, within the tolerances stated below.
#
# The lent machine reaches no network and takes at most 64 MiB with the tree, for 15 minutes of device time
# in all: fixtures are built there (the tiny pair in seconds, the wide real-shape pair in a few minutes on its
# cores), and the packages its image lacks travel as wheels in .whl/ (git-ignored), fetched here first:
#     pip download --no-deps -d .whl transformers==5.24.0 compressed-tensors==0.20.1 typer pydantic \
#         gguf==0.19.0 exllamav3==1.6.5
# then, through the device tool, carrying .whl:  bash bench/gpu_check.sh PART   (one part per call)
#
# Usage: bash bench/gpu_check.sh [--dry-run] [PART ...]     PART: tiny-cuda exl3 auto wide (default: all)
# The EXL3 decoder's bit-exactness against exllamav3's kernels is bench/exl3_gpu_check.sh's (golden vectors).
# --dry-run (any machine, no GPU): lists what each part would run and the memory plan of its fixtures.
#
# Tolerances of the CUDA-vs-CPU agreement: the two devices' kernels round differently, so metrics are equal
# within 2% relative or 1e-4 absolute for PPL-like and rate metrics and 25% relative or 1e-5 absolute for
# KLD-like metrics (a KLD between two executions of one model is itself rounding noise); strings, booleans
# and counts equal exactly.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
FIXTURES="${EVALSUITE_TEST_FIXTURES:-$HOME/.cache/evalsuite/test-fixtures}"
OUT="${OUT:-/tmp/evalsuite-gpu-check}"
PART_LIMIT=480  # seconds: each part ends well inside one 10-minute device call

DRY=0
PARTS=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        tiny-cuda | exl3 | auto | wide) PARTS+=("$arg") ;;
        *) echo "gpu_check: unknown part $arg (tiny-cuda exl3 auto wide, or --dry-run)" >&2; exit 2 ;;
    esac
done
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tiny-cuda exl3 auto wide)

TINY="tiny-minicpmv47-bf16 tiny-minicpmv47-w4a8"
TASKS="ppl,smoke,vision,tensors,intref,moe,layers"

declare -A FIXTURES_OF=(
    [tiny-cuda]="$TINY"
    [exl3]="tiny-minicpmv47-bf16 tiny-minicpmv47-exl3"
    [auto]="$TINY"
    [wide]="minicpmv47-35b-a3b-wide minicpmv47-35b-a3b-wide-w4a8"
)
declare -A COMMANDS_OF=(
    [tiny-cuda]="run --tasks $TASKS --device cuda; the same with --device cpu; metrics compared"
    [exl3]="run --tasks ppl --backend exl3 --device cuda on the EXL3 pack (exllamav3); the same on cpu (decoded)"
    [auto]="run --tasks ppl,moe,layers --device auto (accelerate's device_map; moe and layers streamed on cuda:0); the same on cpu"
    [wide]="run --tasks ppl --device cuda on the wide real-shape pair (loaded); peak GPU memory against the plan"
)

plan_memory() {
    # The memory plan's figure for each fixture of a part: what a whole load fills (evalsuite.backends.memory).
    python - "$FIXTURES" "$@" <<'PY'
import sys
from pathlib import Path

from evalsuite.backends.memory import format_bytes, loaded_bytes
from evalsuite.backends.options import BackendOptions
from evalsuite.checkpoint import Checkpoint

root = Path(sys.argv[1])
for name in sys.argv[2:]:
    folder = root / name
    if not (folder / "config.json").is_file():
        print(f"    {name}: not built on this machine (built on the device by the part)")
        continue
    checkpoint = Checkpoint.open(folder)
    options = BackendOptions().for_format(checkpoint.format)
    print(f"    {name}: {checkpoint.format}, plan {format_bytes(loaded_bytes(checkpoint, options))} loaded")
PY
}

if [ "$DRY" -eq 1 ]; then
    echo "gpu_check --dry-run: parts ${PARTS[*]} (each at most ${PART_LIMIT} s)"
    for part in "${PARTS[@]}"; do
        echo "part $part: ${COMMANDS_OF[$part]}"
        # shellcheck disable=SC2086
        plan_memory ${FIXTURES_OF[$part]}
    done
    exit 0
fi

python -c "import torch; assert torch.cuda.is_available(), 'this check needs a CUDA device'"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-deps --no-index .whl/*.whl
fi
mkdir -p "$OUT"

peak_gpu() {
    # Sample the GPU's used memory while "$@" runs; print "rc seconds peak_MiB".
    local log="$OUT/smi.$$" start rc
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$log" 2>/dev/null &
    local smi=$!
    start=$(date +%s.%N)
    set +e
    timeout "$PART_LIMIT" "$@" >"$OUT/last.out" 2>"$OUT/last.err"
    rc=$?
    set -e
    kill "$smi" 2>/dev/null || true
    echo "$rc $(echo "$(date +%s.%N) - $start" | bc) $(sort -n "$log" | tail -1)"
}

agreement() {
    # Every metric of two results.json, within the tolerances of the header.
    python - "$1" "$2" <<'PY'
import json
import math
import sys

a, b = (json.load(open(p)) for p in sys.argv[1:3])
worst = []
for task, entry in a["tasks"].items():
    other = b["tasks"].get(task, {}).get("metrics", {})
    for name, x in entry.get("metrics", {}).items():
        y = other.get(name)
        if isinstance(x, bool) or isinstance(x, str) or x is None or y is None:
            ok = x == y or "execution" in name or name.endswith("_convention")
        elif "kld" in name:
            ok = math.isclose(x, y, rel_tol=0.25, abs_tol=1e-5)
        else:
            ok = math.isclose(x, y, rel_tol=0.02, abs_tol=1e-4)
        if not ok:
            worst.append(f"{task}.{name}: {x!r} vs {y!r}")
print(f"  agreement: {'all metrics within tolerance' if not worst else f'{len(worst)} outside: ' + '; '.join(worst[:8])}")
PY
}

build() {
    # shellcheck disable=SC2086
    for name in $1; do python -m evalsuite.cli fixtures --out "$FIXTURES" --only "$name" >/dev/null; done
}

for part in "${PARTS[@]}"; do
    echo "part $part: ${COMMANDS_OF[$part]}"
    build "${FIXTURES_OF[$part]}"
    # shellcheck disable=SC2086
    plan_memory ${FIXTURES_OF[$part]}
    read -r ref ckpt <<<"${FIXTURES_OF[$part]}"
    pair=(--ckpt "$FIXTURES/$ckpt" --ref "$FIXTURES/$ref" --corpus python-docs --quiet)
    case "$part" in
        tiny-cuda) gpu=(--tasks "$TASKS" --device cuda); cpu=(--tasks "$TASKS" --device cpu) ;;
        exl3) gpu=(--tasks ppl --backend exl3 --device cuda); cpu=(--tasks ppl --backend exl3 --device cpu) ;;
        auto) gpu=(--tasks ppl,moe,layers --device auto); cpu=(--tasks ppl,moe,layers --device cpu) ;;
        wide) gpu=(--tasks ppl --device cuda); cpu=() ;;
    esac
    echo "  cuda: rc seconds peak_MiB = $(peak_gpu python -m evalsuite.cli run "${pair[@]}" "${gpu[@]}" --out "$OUT/$part-gpu")"
    tail -n 2 "$OUT/last.err" | sed 's/^/    /'
    if [ ${#cpu[@]} -gt 0 ]; then
        echo "  cpu:  rc seconds peak_MiB = $(peak_gpu python -m evalsuite.cli run "${pair[@]}" "${cpu[@]}" --out "$OUT/$part-cpu")"
        if [ -f "$OUT/$part-gpu/results.json" ] && [ -f "$OUT/$part-cpu/results.json" ]; then
            agreement "$OUT/$part-gpu/results.json" "$OUT/$part-cpu/results.json"
        fi
    fi
done
