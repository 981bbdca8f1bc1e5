#!/usr/bin/env bash
# evalsuite on a lent GPU machine: bench/gpu_check.py (its docstring says what each part runs and the
# tolerances of the CUDA-vs-CPU agreement), after installing the wheels the machine's image lacks.
#
# The lent machine reaches no network and takes at most 64 MiB with the tree: the packages its image lacks
# travel as wheels in .whl/ (git-ignored), fetched here first, for its Python 3.12:
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_17_x86_64 -d .whl transformers==5.24.0 compressed-tensors==0.20.1 \
#         pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
#         loguru==0.7.3 typer==0.29.2 typing-extensions==4.16.0
# then, through the device tool, carrying .whl:  bash bench/gpu_check.sh tiny-cuda [PART ...]
#
# Usage: bash bench/gpu_check.sh [--dry-run | --quick] [PART ...]   PART: tiny-cuda auto exl3 wide
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Only on a GPU machine (a rehearsal or a dry run uses this machine's own packages).
case " $* " in
    *" --dry-run "* | *" --quick "*) ;;
    *)
        if command -v nvidia-smi >/dev/null && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
            "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/evalsuite-site "$ROOT"/.whl/*.whl
            export PYTHONPATH="$ROOT:/tmp/evalsuite-site${PYTHONPATH#"$ROOT"}"
        fi
        ;;
esac
exec "$PYTHON" "$ROOT/bench/gpu_check.py" "$@"
