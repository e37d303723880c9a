#!/usr/bin/env bash
# Everything bench/gpu_check.sh installs, as files, for a GPU machine that reaches no registry.
#   bench/gpu_wheels.sh DIR [PYTHON_VERSION]     (default 3.11, the image's Python)
# Run it where PyPI and the PyTorch CUDA index are reachable; copy DIR over; then, there:
#   WHEELS=DIR bench/gpu_check.sh
# DIR gets the wheels of requirements/gpu.txt plus the test and export tools the check uses
# (requirements/dev.txt without its CPU torch and onnxruntime), and wrk's .deb files.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: bench/gpu_wheels.sh DIR [PYTHON_VERSION]}"
python_version="${2:-3.11}"
mkdir -p "$dir"
bench/gpu_requirements.sh > "$dir/requirements.txt"
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download --only-binary=:all: --implementation cp \
  --python-version "$python_version" "${platforms[@]}" \
  -d "$dir" -r "$dir/requirements.txt"
(cd "$dir" && apt-get download wrk libluajit-5.1-2 libluajit-5.1-common) \
  || echo "apt-get download failed: bring wrk's .deb files along by hand"
echo "wheels for Python $python_version in $dir: $(ls "$dir"/*.whl | wc -l) files, $(du -sh "$dir" | cut -f1)"
