#!/usr/bin/env bash
# What the GPU check installs, as one requirements file on stdout: the dev lock (server, tests,
# export tools) with its CPU torch and onnxruntime swapped for the GPU image's CUDA builds, plus
# whatever else the GPU lock has (nvidia-ml-py). The dev lock's pins win where both name a package.
set -euo pipefail
cd "$(dirname "$0")/.."
name() { sed -E 's/[=<>~!].*//' | tr 'A-Z_.' 'a-z--'; }
grep -E '^--' requirements/gpu.txt
grep -v -E '^(torch|onnxruntime)==' requirements/dev.txt
dev_names=$(grep -E '^[A-Za-z]' requirements/dev.txt | grep -v -E '^(torch|onnxruntime)==' | name)
grep -E '^[A-Za-z]' requirements/gpu.txt | while read -r line; do
  grep -q -x -F "$(echo "$line" | name)" <<<"$dev_names" || echo "$line"
done
