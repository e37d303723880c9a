"""The locks are complete and install where the project says they do.

- requirements/gpu.txt resolves to itself: pip's resolver, asked for the lock alone from PyPI (no
  pip configuration, no local wheels or constraints) for the GPU image's CPython 3.11 on
  manylinux x86_64, adds no package and changes no version. Only metadata is read (HTTP range
  requests, pip's fast-deps); no wheel is downloaded.
- cpu.txt, dev.txt and deploy.txt install on the oldest Python that requires-python allows: every
  pinned release has a wheel for it and accepts it (its Requires-Python).
- The GPU image agrees with gpu.txt: its base image's CUDA and its TG_EXPECT_* pins.

The first two need PyPI: offline they are skipped, saying so (under CI=true they fail instead).
`make lock` writes gpu.txt with the same resolver settings (GPU_PLATFORMS in the Makefile).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements"
PYPI = "https://pypi.org/simple"
GPU_PYTHON = "3.11"  # the GPU image's interpreter (python3.11 from deadsnakes)
# The wheels a manylinux_2_35 x86_64 system (Ubuntu 22.04, the GPU image) takes. pip expands only
# the legacy manylinux2014 alias to older tags, so each manylinux_2_N is named.
PLATFORMS = ["manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 36))]
# pip settings that would change the answer on a developer's machine (local wheels, constraints,
# mirrors); network settings (certificates, proxy, timeouts) are kept.
PIP_KEEP = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES"}


def pins(lock: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in (REQUIREMENTS / lock).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, _, version = line.partition("==")
            assert version, f"{lock}: {line!r} is not pinned with =="
            found[canonicalize_name(name.split("[")[0])] = version.strip()
    return found


def oldest_python() -> str:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    lower = [s.version for s in SpecifierSet(spec) if s.operator == ">="]
    assert len(lower) == 1, f"requires-python {spec!r}: expected one >= bound"
    return lower[0]


@pytest.fixture(scope="module")
def pypi() -> None:
    try:
        request = urllib.request.Request(f"{PYPI}/pip/", method="HEAD")
        urllib.request.urlopen(request, timeout=15).close()
    except (urllib.error.URLError, OSError) as exc:
        message = f"PyPI ({PYPI}) is unreachable ({exc}): the lock checks need the network"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


class DryRun:
    """``pip install --dry-run`` of a lock, from PyPI alone, for CPython ``python`` on Linux,
    started at once: the four checks wait on the network (fast-deps reads each wheel's metadata
    by HTTP range requests), so they run side by side (one after another they took 4.8 minutes
    of the suite, dev.txt alone 1.8)."""

    def __init__(self, folder: Path, python: str, lock: Path, *extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in PIP_KEEP}
        env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        folder.mkdir(parents=True)
        self.lock, self.python, self.report = lock, python, folder / "report.json"
        self.command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--use-feature=fast-deps",
            "--index-url",
            PYPI,
            "--python-version",
            python,
            *(f"--platform={p}" for p in PLATFORMS),
            "--only-binary=:all:",
            "--target",
            str(folder / "target"),
            "--report",
            str(self.report),
            *extra,
            "-r",
            str(lock),
        ]
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )

    def installs(self) -> dict[str, str]:
        """What pip would install: each package's name and version."""
        try:
            _, stderr = self.process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            raise
        assert self.process.returncode == 0, (
            f"pip cannot install {self.lock.name} for Python {self.python}:\n{stderr[-4000:]}\n"
            f"command: {shlex.join(self.command)}"
        )
        installs = json.loads(self.report.read_text())["install"]
        return {
            canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs
        }


OLDEST_PYTHON_LOCKS = ["cpu.txt", "dev.txt", "deploy.txt"]


def start_dry_runs(folder: Path) -> dict[str, DryRun]:
    """Each lock's dry run, all started together: gpu.txt resolved for the GPU image's Python,
    the others each pin alone (``--no-deps``) for the oldest Python allowed."""
    runs = {"gpu.txt": DryRun(folder / "gpu", GPU_PYTHON, REQUIREMENTS / "gpu.txt")}
    for lock in OLDEST_PYTHON_LOCKS:
        # the CPU lock's torch comes from local wheels or PyTorch's CPU index
        plain = folder / lock
        plain.write_text(re.sub(r"\+cpu$", "", (REQUIREMENTS / lock).read_text(), flags=re.M))
        runs[lock] = DryRun(folder / lock.removesuffix(".txt"), oldest_python(), plain, "--no-deps")
    return runs


def stop_dry_runs(runs: dict[str, DryRun]) -> None:
    for run in runs.values():
        if run.process.poll() is None:
            run.process.kill()
            run.process.communicate()


STARTED: dict[str, DryRun] = {}
"""The dry runs tests/conftest.py starts with the session when these tests are selected: they
wait on PyPI for a minute or two beside the tests that run before these."""


@pytest.fixture(scope="module")
def dry_runs(pypi: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DryRun]]:
    """The locks' dry runs: those started with the session, else started now."""
    runs = dict(STARTED) or start_dry_runs(tmp_path_factory.mktemp("locks"))
    STARTED.clear()
    try:
        yield runs
    finally:
        stop_dry_runs(runs)


def test_gpu_lock_resolves_to_itself(dry_runs: dict[str, DryRun]) -> None:
    locked = pins("gpu.txt")
    resolved = dry_runs["gpu.txt"].installs()
    added = {name: version for name, version in resolved.items() if name not in locked}
    changed = {
        name: f"{locked[name]} → {version}"
        for name, version in resolved.items()
        if name in locked and version != locked[name]
    }
    assert not added and not changed, (
        f"requirements/gpu.txt is incomplete: pip adds {added or 'nothing'} and changes "
        f"{changed or 'nothing'} (regenerate it with `make lock-gpu`)"
    )


@pytest.mark.parametrize("lock", OLDEST_PYTHON_LOCKS)
def test_lock_installs_on_the_oldest_python_allowed(dry_runs: dict[str, DryRun], lock: str) -> None:
    """Each pinned release has a wheel for, and accepts, the oldest Python requires-python allows
    (e.g. Debian 12's 3.11.2). pip names the first release that does not."""
    dry_runs[lock].installs()


def test_gpu_lock_is_the_cpu_lock_with_cuda_builds() -> None:
    cpu, gpu = pins("cpu.txt"), pins("gpu.txt")
    assert set(cpu) - set(gpu) == {"onnxruntime"}, set(cpu) - set(gpu)
    assert "onnxruntime-gpu" in gpu
    differ = {n: (cpu[n], gpu[n]) for n in cpu.keys() & gpu.keys() if cpu[n] != gpu[n]}
    assert not differ, f"cpu.txt and gpu.txt pin different versions: {differ}"
    cuda_wheels = {n for n in gpu if n.startswith("nvidia-") and n != "nvidia-ml-py"}
    for needed in ("nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cudnn-cu13"):
        assert needed in cuda_wheels, f"gpu.txt lacks {needed}"


def gpu_stage() -> tuple[str, dict[str, str]]:
    """The gpu stage's FROM image and its ENV (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stage = text[text.index(" AS gpu") :]
    image = re.findall(r"^FROM (\S+) AS gpu$", text, flags=re.M)
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.*)$", stage, flags=re.M):
        env |= dict(token.partition("=")[::2] for token in shlex.split(line))
    return image[0], env


def test_gpu_image_agrees_with_the_gpu_lock() -> None:
    """One CUDA: the base image's (driver compatibility only), the nvidia-* wheels' (the
    libraries), and TG_EXPECT_*, which the server checks at start."""
    gpu = pins("gpu.txt")
    cuda = ".".join(gpu["nvidia-cuda-runtime"].split(".")[:2])
    image, env = gpu_stage()
    tag = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)\.\d+-base-ubuntu\d+\.\d+", image)
    assert tag, f"gpu stage FROM {image}: expected a pinned nvidia/cuda:X.Y.Z-base-ubuntu image"
    assert tag[1] == cuda, f"base image CUDA {tag[1]}, the lock's CUDA wheels {cuda}"
    expected = {
        "TG_EXPECT_CUDA": cuda,
        "TG_EXPECT_TORCH": gpu["torch"],
        "TG_EXPECT_ONNXRUNTIME": gpu["onnxruntime-gpu"],
    }
    wrong = {k: f"{env.get(k)} (gpu.txt: {v})" for k, v in expected.items() if env.get(k) != v}
    assert not wrong, f"the gpu stage's ENV disagrees with requirements/gpu.txt: {wrong}"
