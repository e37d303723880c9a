"""The child process a model.pt2 is first run in: it ends with the load that started it, and
its death is told by batch and signal."""

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from service.errors import LoadStopped
from service.runtimes.pt2_probe import Pt2Aborted, _died, _run


def test_the_child_is_killed_when_its_load_stops(tmp_path: Path) -> None:
    """It ran to its own end (up to 600 s) whatever the server did: SIGTERM, an unload."""
    said = tmp_path / "pid"
    sleeper = f"import os, time; open({str(said)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    started = time.monotonic()

    def check() -> None:
        if said.exists() and time.monotonic() - started > 0.3:
            raise LoadStopped("loading stopped: the server is shutting down")

    with pytest.raises(LoadStopped):
        _run([sys.executable, "-c", sleeper], 600, check, Path("model.pt2"), 1)
    pid = int(said.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped


def test_a_child_past_its_time_is_killed_and_said_so() -> None:
    with pytest.raises(Pt2Aborted, match=r"model.pt2 did not answer its 2 batches within 0.3 s"):
        _run([sys.executable, "-c", "import time; time.sleep(60)"], 0.3, None, Path("model.pt2"), 2)


def test_a_death_names_the_batch_and_the_signal_and_copes_with_silence() -> None:
    batches = [{"ids": np.zeros((4, 12), np.int64)}, {"ids": np.zeros((1, 12), np.int64)}]
    stderr = (
        "pt2_probe: batch 0\npt2_probe: batch 1\nterminate called after throwing 'c10::Error'\n"
    )
    said = _died(Path("model.pt2"), batches, -signal.SIGABRT, stderr)
    assert said.startswith(
        "model.pt2 aborted the process that ran it at a batch of 1 (ids [1, 12]) (signal "
        "SIGABRT: terminate called after throwing 'c10::Error'); "
    )
    assert _died(Path("model.pt2"), batches, -9, "").startswith(
        "model.pt2 aborted the process that ran it (signal SIGKILL); "
    )
    assert _died(Path("model.pt2"), batches, 1, "") == (
        "model.pt2 failed in a child process (exit status 1)"
    )
