#!/usr/bin/env bash
# The GPU check, as one prepared script (see bench/gpu_check.py for what it measures).
#   bench/gpu_check.sh [OUT_DIR]
# On a machine that reaches no package registry, make the wheels elsewhere with
# bench/gpu_wheels.sh DIR, bring DIR along and set WHEELS=DIR: they are installed with
# --no-index. With a .venv already set up (make venv), nothing is installed.
# Bounded: every step has a timeout; the whole run is well under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  if [ -n "${WHEELS:-}" ]; then  # made by bench/gpu_wheels.sh
    .venv/bin/pip install -q --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt"
  else
    .venv/bin/pip install -q -r <(bench/gpu_requirements.sh)
  fi
  .venv/bin/pip install -q --no-deps --no-build-isolation -e .
fi
if ! command -v wrk >/dev/null; then
  if [ -n "${WHEELS:-}" ] && compgen -G "$WHEELS/*.deb" >/dev/null; then
    dpkg -i "$WHEELS"/*.deb >/dev/null
  else
    apt-get install -y -qq wrk || { echo "wrk is needed: bring its .deb files (bench/gpu_wheels.sh)"; exit 1; }
  fi
fi
timeout 300 make -s models
nvidia-smi || echo "no nvidia-smi: running on the CPU"
timeout 420 .venv/bin/python -m bench.gpu_check --out "$out/gpu_check.md"
