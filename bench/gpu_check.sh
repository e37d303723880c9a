#!/usr/bin/env bash
# The GPU check, as one prepared script (see bench/gpu_check.py for what it measures).
#   bench/gpu_check.sh [OUT_DIR]
# On a machine that reaches no package registry, bring the wheels along and set WHEELS=dir:
# they are installed with --no-index. With a .venv already set up (make venv), nothing is
# installed. Bounded: every step has a timeout; the whole run is well under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  if [ -n "${WHEELS:-}" ]; then
    .venv/bin/pip install --no-index --find-links "$WHEELS" -r requirements/gpu.txt -r requirements/dev.txt
  else
    .venv/bin/pip install -r requirements/dev.txt
  fi
  .venv/bin/pip install --no-deps --no-build-isolation -e .
fi
command -v wrk >/dev/null || { apt-get install -y -qq wrk || { echo "wrk is needed: bring its .deb along"; exit 1; }; }
timeout 300 make -s models
nvidia-smi || echo "no nvidia-smi: running on the CPU"
timeout 420 .venv/bin/python -m bench.gpu_check --out "$out/gpu_check.md"
