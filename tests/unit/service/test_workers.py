"""Several workers as one server: the sizing of workers and threads, and the sums a worker
makes of the others' statistics and metrics (the processes themselves: tests/integration)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.cluster.control import PROBE_ASK_S
from service.cluster.merge import merge_metrics, merge_statistics
from service.cluster.supervisor import Worker, listening_socket
from service.cluster.view import Cluster
from service.limits.balance import ConnectionBalance, create_balance_file
from service.resources import cuda_visible, memory_limit_bytes, repository_model_bytes
from service.settings import Settings, worker_sizing


@pytest.mark.parametrize(
    ("cpus", "workers", "expected"),
    [
        (1, 0, (1, 1)),
        (2, 0, (2, 2)),
        (3, 0, (3, 3)),
        (16, 0, (16, 16)),
        (2, 1, (1, 2)),
        (8, 2, (2, 8)),
    ],
)
def test_a_worker_per_cpu_each_with_every_cpu_s_threads(
    cpus: int, workers: int, expected: tuple[int, int], tmp_path: Path
) -> None:
    """Small models (an empty repository) on a machine without a GPU: workers fit in memory."""
    settings = Settings(cpus=cpus, workers=workers, model_repository=tmp_path)
    if cuda_visible():  # a GPU machine: one worker by default (its own test below)
        pytest.skip("this machine has a GPU")
    assert (settings.workers, settings.intra_op_threads) == expected
    share = max(1, cpus // settings.workers)  # the pool: the worker's share; beside: too
    assert settings.preprocess_threads == settings.shared_threads == share
    assert settings.sizing_warning is None


def test_threads_set_by_hand_are_kept() -> None:
    settings = Settings(cpus=8, workers=2, intra_op_threads=3, preprocess_threads=1)
    assert (settings.intra_op_threads, settings.preprocess_threads) == (3, 1)
    assert settings.shared_threads == 3  # set by hand: always


def _repository(root: Path, megabytes: int) -> Path:
    """One model whose newest version's largest artifact is ``megabytes`` (sparse files)."""
    for version, size in (("1", 1), ("2", megabytes)):
        folder = root / "big" / version
        folder.mkdir(parents=True)
        with (folder / "model.onnx").open("wb") as artifact:
            artifact.truncate(size << 20)
    (root / "big" / "config.yaml").write_text("backend: onnx\n")
    return root


def test_with_a_gpu_one_worker_owns_it(tmp_path: Path) -> None:
    settings = Settings(cpus=16, model_repository=tmp_path)
    assert worker_sizing(settings.model_copy(update={"workers": 0}), gpu=True)[0] == 1
    assert worker_sizing(settings.model_copy(update={"workers": 0}), gpu=False)[0] == 16
    # asked for several on a GPU: as asked (each its own CUDA context; docs/deploy.md)
    assert worker_sizing(settings.model_copy(update={"workers": 4}), gpu=True)[0] == 4
    dev = tmp_path / "dev"
    dev.mkdir()
    assert not cuda_visible({}, dev)
    (dev / "nvidia0").touch()
    assert cuda_visible({}, dev)
    assert not cuda_visible({"CUDA_VISIBLE_DEVICES": ""}, dev)
    assert not cuda_visible({"CUDA_VISIBLE_DEVICES": "-1"}, dev)
    assert cuda_visible({"CUDA_VISIBLE_DEVICES": "0"}, dev)


def test_workers_that_do_not_fit_the_memory_limit_are_lowered_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4 GiB cgroup (fake files), 16 CPUs, a model of 200 MiB: each worker is estimated at
    512 + 256 + 3 × 200 MiB, so 2 fit (2 × 1368 + 128 < 0.9 × 4096 < 3 × 1368 + 128) where 16
    were asked."""
    proc = tmp_path / "cgroup"
    proc.write_text("0::/pod\n")
    (tmp_path / "fs" / "pod").mkdir(parents=True)
    (tmp_path / "fs" / "pod" / "memory.max").write_text(str(4 << 30))
    monkeypatch.setattr(
        "service.settings.memory_limit_bytes", lambda: memory_limit_bytes(tmp_path / "fs", proc)
    )
    monkeypatch.setattr("service.settings.cuda_visible", lambda: False)
    repository = _repository(tmp_path / "models", 200)
    assert repository_model_bytes(repository) == (256 + 3 * 200) << 20  # the newest version's
    settings = Settings(cpus=16, model_repository=repository)
    assert settings.workers == 2
    warning = settings.sizing_warning
    assert warning is not None
    assert "starting 2 workers, not 16 (the default)" in warning
    assert "estimated 1368 MiB a worker" in warning and "4096 MiB" in warning
    asked = Settings(cpus=16, workers=8, model_repository=repository)
    assert asked.workers == 2
    assert asked.sizing_warning is not None and "(TG_WORKERS=8)" in asked.sizing_warning
    # never below one, whatever the estimate
    assert Settings(cpus=16, model_repository=_repository(tmp_path / "huge", 4096)).workers == 1
    # the budget for bodies in flight is shared among the workers that start
    assert settings.max_inflight_bytes == max(
        settings.max_body_bytes, min(1 << 30, (4 << 30) // 16 // 2)
    )


def test_the_in_flight_budget_is_shared_among_workers() -> None:
    four = Settings(workers=4)
    share = min(1 << 30, memory_limit_bytes() // 16 // 4)
    assert four.max_inflight_bytes == max(four.max_body_bytes, share)


def test_a_worker_reads_its_place_back(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker(1, 3, 42, Path("/tmp/a/b c"), replacement=True)
    monkeypatch.setenv("TENSORGATE_WORKER", worker.encode())
    assert Worker.from_environment() == worker
    assert worker.others == [0, 2]


def _stats(success: int, batches: dict[int, int], last: int) -> dict[str, object]:
    return {
        "name": "m",
        "version": "1",
        "last_inference": last,
        "inference_count": success,
        "execution_count": sum(batches.values()),
        "inference_stats": {
            "success": {"count": success, "ns": success * 10},
            "fail": {"count": 0, "ns": 0},
        },
        "batch_stats": [
            {"batch_size": size, "compute_infer": {"count": n, "ns": n * 5}}
            for size, n in batches.items()
        ],
    }


def test_statistics_add_up_by_model_and_batch_size() -> None:
    other = {**_stats(1, {1: 1}, 5), "name": "n"}
    merged = merge_statistics(
        [
            {"model_stats": [_stats(10, {1: 2, 4: 2}, 100)]},
            {"model_stats": [_stats(6, {2: 1, 4: 1}, 300), other]},
        ]
    )["model_stats"]
    assert [(m["name"], m["version"]) for m in merged] == [("m", "1"), ("n", "1")]
    m = merged[0]
    assert m["inference_count"] == 16 and m["execution_count"] == 6
    assert m["last_inference"] == 300
    assert m["inference_stats"]["success"] == {"count": 16, "ns": 160}
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in m["batch_stats"]] == [
        (1, 2),
        (2, 1),
        (4, 3),
    ]
    assert merged[1] == other


def _worker_text(requests: int, rss: float, started: float, state: float) -> str:
    registry = CollectorRegistry()
    Counter("tg_requests", "r", ["model"], registry=registry).labels("m").inc(requests)
    histogram = Histogram("tg_seconds", "s", buckets=(1.0,), registry=registry)
    histogram.observe(0.5)
    Gauge("process_resident_memory_bytes", "rss", registry=registry).set(rss)
    Gauge("process_start_time_seconds", "t", registry=registry).set(started)
    Gauge("tensorgate_model_state", "s", ["state"], registry=registry).labels("READY").set(state)
    return generate_latest(registry).decode()


def test_metrics_add_up_and_gauges_merge_by_meaning() -> None:
    text = merge_metrics([_worker_text(3, 100, 50, 1), _worker_text(4, 200, 40, 0)]).decode()
    found = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert found[("tg_requests_total", (("model", "m"),))] == 7
    assert found[("tg_seconds_count", ())] == 2
    assert found[("tg_seconds_bucket", (("le", "1.0"),))] == 2
    assert found[("process_resident_memory_bytes", ())] == 300  # what the server holds
    assert found[("process_start_time_seconds", ())] == 40  # when it started
    assert found[("tensorgate_model_state", (("state", "READY"),))] == 1
    assert "# TYPE tg_requests_total counter" in text


async def test_a_sibling_s_metrics_of_any_size_reach_the_worker_asking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's answer was read as one asyncio line, which stops at 64 KiB: with a few models
    served for a while, the other worker's metrics text passed it and /metrics was 500."""
    from service.cluster import supervisor
    from service.cluster.control import ControlServer, Siblings

    read, write = os.pipe()
    os.write(write, b"control-key-for-the-test")
    os.close(write)
    monkeypatch.setenv(supervisor.KEY_FD_ENV, str(read))
    supervisor.control_key.cache_clear()
    registry = CollectorRegistry()
    counter = Counter("tg_requests", "r", ["model"], registry=registry)
    for n in range(4000):  # about 190 KiB of text
        counter.labels(f"model-{n:05d}").inc(n)
    dataplane = SimpleNamespace(
        settings=SimpleNamespace(admin_token=None),
        observer=SimpleNamespace(
            metrics=SimpleNamespace(exposition=lambda: generate_latest(registry))
        ),
    )
    answering = ControlServer(dataplane, Worker(1, 2, os.getpid(), tmp_path))  # type: ignore[arg-type]  # a stand-in DataPlane with only what _metrics reads
    await answering.start()
    try:
        (text,) = await Siblings(Worker(0, 2, os.getpid(), tmp_path)).ask("metrics")
    finally:
        await answering.close()
        supervisor.control_key.cache_clear()
    assert isinstance(text, str) and len(text) > 128 << 10
    assert text == generate_latest(registry).decode()


async def test_a_probe_names_the_worker_that_is_not_ready() -> None:
    """Asked of one worker, readiness is the whole server's: a sibling that is still loading
    (a replacement, say) makes it false, and the reason says which worker."""

    waited: list[float] = []

    async def ask(kind: str, timeout: float) -> list[Any]:
        waited.append(timeout)
        return [(True, ""), (False, "models are loading")]

    siblings = SimpleNamespace(worker=SimpleNamespace(others=[0, 2]), ask=ask)
    dataplane = SimpleNamespace(ready=lambda: (True, ""))
    cluster = Cluster(dataplane, siblings)  # type: ignore[arg-type]  # stand-ins with what probe reads
    assert await cluster.probe("ready") == (False, "worker 2: models are loading")
    # a stuck sibling is waited for less than the CLI's probe (2 s) and the kubelet's (3 s)
    # wait for an answer: with 5 s every probe timed out, and the kubelet restarted the pod
    assert waited == [PROBE_ASK_S] and PROBE_ASK_S < 2


def test_a_worker_lets_a_connection_go_only_past_its_share_and_not_too_often(
    tmp_path: Path,
) -> None:
    """The even share is the workers' total over their count, rounded up; a worker over it
    lets one connection go per CLOSE_EVERY_S (service.limits.balance)."""
    from service.limits.balance import (
        CLOSE_EVERY_S,
        ConnectionBalance,
        create_balance_file,
        not_accepting,
    )

    path = create_balance_file(tmp_path / "connections", 2)
    now = [0.0]
    crowded, other = ConnectionBalance(lambda: now[0]), ConnectionBalance(lambda: now[0])
    crowded.attach(path, 0)
    other.attach(path, 1)
    crowded.count(12)
    assert path.read_bytes() == bytes([0xFF] * 4)  # neither accepts yet (not listening)
    assert not crowded.over_share()
    crowded.accepting(True)
    other.accepting(True)
    assert path.read_bytes() == bytes([12, 0, 0, 0])  # one uint16 a worker
    assert not ConnectionBalance().over_share()  # one worker alone: nothing to even out
    assert not other.over_share()
    assert crowded.over_share()
    assert not crowded.over_share()  # once per interval
    now[0] += CLOSE_EVERY_S
    assert crowded.over_share()
    for mine, theirs, over in ((7, 6, False), (8, 6, True), (7, 7, False), (6, 7, False)):
        crowded.count(mine)
        other.count(theirs)
        now[0] += CLOSE_EVERY_S
        assert crowded.over_share() is over, (mine, theirs)
    assert crowded.closed == 3
    not_accepting(path, 1)  # it died holding 7 (the supervisor's): not counted in the share
    assert path.read_bytes()[2:] == bytes([0xFF, 0xFF])
    now[0] += CLOSE_EVERY_S
    assert not crowded.over_share() and not crowded.holds_more()
    replacement = ConnectionBalance()
    replacement.attach(path, 1)  # in its place: counted once it accepts
    replacement.accepting(True)
    assert path.read_bytes()[2:] == bytes(2)
    assert crowded.holds_more()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_worker_holding_more_lets_a_new_connection_wait_for_another_then_takes_it(
    tmp_path: Path, loop: str
) -> None:
    """TakeTurns (service.limits.balance): one connection a wake-up; holding more than the
    other worker, it lets the connection wait DEFER_S (its reader off, so it does not spin),
    then takes it anyway, and after UNHEEDED_IN_A_ROW waits the other did not use, while its
    count did not move, lets none wait for UNHEEDED_S (a stopped worker's count must not slow
    every accept); a worker not accepting is waited for by nobody; stopped, it takes none."""

    async def take_turns() -> None:
        import asyncio
        import socket
        import time

        from service.limits.balance import TakeTurns

        path, mine, other = _two_workers(tmp_path)
        made: list[float] = []
        Made = _noting(made)
        running = asyncio.get_running_loop()
        with socket.create_server(("127.0.0.1", 0)) as listener:
            address = listener.getsockname()
            turns = TakeTurns(running, listener, Made, mine)
            turns.UNHEEDED_IN_A_ROW = 2  # 16 in a row in the server; two show the rule here
            turns.UNHEEDED_OVER_S, turns.UNHEEDED_WITHIN_S, turns.UNHEEDED_S = 0.0, 10, 60
            clients = []
            try:
                clients.append(socket.create_connection(address))
                await _until(lambda: len(made) == 1)
                assert (turns.accepted, turns.deferred, mine.mine) == (1, 0, 1)  # counted at once

                other.count(0)  # the other worker holds fewer: this one lets the next wait
                started = time.monotonic()
                clients.append(socket.create_connection(address))
                await _until(lambda: len(made) == 2)
                assert (turns.accepted, turns.deferred) == (2, 1)
                assert made[1] - started >= TakeTurns.DEFER_S * 0.9  # nobody else took it

                other.count(5)  # now it holds fewer: no waiting
                clients.append(socket.create_connection(address))
                await _until(lambda: len(made) == 3)
                assert turns.deferred == 1

                other.count(1)  # fewer again, and its count moved: it runs, it is waited for
                clients.append(socket.create_connection(address))
                await _until(lambda: len(made) == 4)
                assert turns.deferred == 2

                # it took neither of two in a row, its count still: stopped, say; none waits
                clients.append(socket.create_connection(address))
                await _until(lambda: len(made) == 5)
                assert turns.deferred == 3
                clients.append(socket.create_connection(address))
                await _until(lambda: len(made) == 6)
                assert turns.deferred == 3

                other.accepting(False)  # its slot says so: nobody waits, before or after
                turns._unheeded_until = float("-inf")
                clients.append(socket.create_connection(address))
                await _until(lambda: len(made) == 7)
                assert turns.deferred == 3

                turns.stop()
                assert path.read_bytes()[:2] == bytes([0xFF, 0xFF])
                clients.append(socket.create_connection(address))  # the kernel completes it
                await asyncio.sleep(0.05)
                assert len(made) == 7
            finally:
                turns.stop()
                for client in clients:
                    client.close()

    if loop == "uvloop":
        import uvloop

        uvloop.run(take_turns())
    else:
        import asyncio

        asyncio.run(take_turns())


def test_a_connection_another_worker_takes_starts_the_run_of_waits_for_nothing_anew(
    tmp_path: Path,
) -> None:
    """A connection that waited and went to another worker (its count grew) ends the run of
    waits for nothing, its length and its start alike, and the next wake-up is a new
    connection's, which waits in turn: it was taken at once as the retry of the one gone and
    counted as a wait for nothing (with the run's start kept, two such right after one taken,
    long after the run began, stopped the waiting)."""

    async def take_turns() -> None:
        import asyncio
        import socket

        from service.limits.balance import TakeTurns

        _, mine, other = _two_workers(tmp_path)
        made: list[float] = []
        Made = _noting(made)
        with socket.create_server(("127.0.0.1", 0)) as listener:
            address = listener.getsockname()
            turns = TakeTurns(asyncio.get_running_loop(), listener, Made, mine)
            turns.DEFER_S = 0.05  # time for this test to take one as another worker would
            turns.UNHEEDED_IN_A_ROW, turns.UNHEEDED_OVER_S, turns.UNHEEDED_WITHIN_S = 2, 1.0, 10
            clients, taken = [], []

            async def connect(made_count: int) -> None:
                clients.append(socket.create_connection(address))
                await _until(lambda: len(made) == made_count)

            try:
                await connect(1)  # holding none: taken at once
                await connect(2)  # waited for nothing: a run begins
                assert turns.deferred == 1
                await asyncio.sleep(1.05)  # past UNHEEDED_OVER_S from the run's start
                clients.append(socket.create_connection(address))
                await _until(lambda: turns.deferred == 2)
                taken.append(listener.accept()[0])  # another worker took it, and counts it
                other.count(1)
                await asyncio.sleep(0.1)
                await connect(3)  # waited for nothing: a new run
                await connect(4)  # the second in a row, but not over 1 s: still waited
                await connect(5)
                assert turns.deferred == 5
            finally:
                turns.stop()
                for sock in clients + taken:
                    sock.close()

    import asyncio

    asyncio.run(take_turns())


def test_a_stopped_worker_is_waited_for_no_longer_whatever_the_other_workers_do(
    tmp_path: Path,
) -> None:
    """Three workers, one stopped (its count never moves) and one serving (its count moving,
    holding more): the waits for the stopped one run on to UNHEEDED_IN_A_ROW (the serving
    one's moves ended the run, so none ever did: every new connection waited 2 ms until the
    supervisor killed the stopped one), and after UNHEEDED_S the first wait for it, unmoved,
    lets none wait again at once."""

    async def take_turns() -> None:
        import asyncio
        import socket

        from service.limits.balance import TakeTurns

        path = create_balance_file(tmp_path / "connections", 3)
        mine, serving, stopped = ConnectionBalance(), ConnectionBalance(), ConnectionBalance()
        for index, balance in enumerate((mine, serving, stopped)):
            balance.attach(path, index)
        serving.accepting(True)
        stopped.accepting(True)  # holding none, taking none
        made: list[float] = []
        running = asyncio.get_running_loop()
        with socket.create_server(("127.0.0.1", 0)) as listener:
            address = listener.getsockname()
            turns = TakeTurns(running, listener, _noting(made), mine)
            turns.UNHEEDED_IN_A_ROW, turns.UNHEEDED_OVER_S, turns.UNHEEDED_WITHIN_S = 3, 0.0, 10
            turns.UNHEEDED_S = 60
            clients = []
            try:
                for count in range(1, 6):
                    serving.count(50 + count)  # it serves on: its count moves
                    clients.append(socket.create_connection(address))
                    await _until(lambda: len(made) == len(clients))
                # the first taken at once, three waited for nothing; the fifth not waited
                assert turns.deferred == 3
                turns._unheeded_until = running.time()  # the time none waits is over
                for _ in range(2):
                    clients.append(socket.create_connection(address))
                    await _until(lambda: len(made) == len(clients))
                assert turns.deferred == 4  # one wait, then none again
            finally:
                turns.stop()
                for client in clients:
                    client.close()

    import asyncio

    asyncio.run(take_turns())


def _two_workers(tmp_path: Path) -> tuple[Path, ConnectionBalance, ConnectionBalance]:
    """The shared file, this worker's ConnectionBalance and another's, the other accepting."""
    path = create_balance_file(tmp_path / "connections", 2)
    mine, other = ConnectionBalance(), ConnectionBalance()
    mine.attach(path, 0)
    other.attach(path, 1)
    other.accepting(True)
    return path, mine, other


def _noting(made: list[float]) -> Any:
    """A protocol class that notes in ``made`` when each of its connections is made."""
    import asyncio
    import time

    class Made(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            made.append(time.monotonic())

    return Made


async def _until(done: Any, timeout_s: float = 5.0) -> None:
    import asyncio

    for _ in range(int(timeout_s / 0.005)):
        if done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("not within the time")


@pytest.mark.parametrize(
    ("host", "bound"),
    [("", "0.0.0.0"), ("0.0.0.0", "0.0.0.0"), ("::", "::"), ("localhost", "127.0.0.1")],
)
def test_a_listening_socket_binds_the_address_a_host_means(host: str, bound: str) -> None:
    """Through getaddrinfo, "" (every IPv4 address, as bind takes it) failed: it names no
    host; a name binds its IPv4 address first, as the probes and clients of 127.0.0.1 expect."""
    with listening_socket(host, 0, inheritable=False) as sock:
        assert sock.getsockname()[0] == bound
