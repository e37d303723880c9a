"""TG_WORKERS=2: several processes on one port, one server to the outside (issue #17).

Each request below goes on a connection of its own, which whichever worker's loop accepts first
takes from the supervisor's one listening socket; the access log's ``worker`` field says which
one answered, and the tests check that both did before they trust a total.
"""

from __future__ import annotations

import array
import contextlib
import http.client
import json
import shutil
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import tritonclient.grpc as tgrpc
from prometheus_client.parser import text_string_to_metric_families

from tests.server import Server, copy_model

pytestmark = pytest.mark.integration
ADMIN = "admin-s3cret-token-123"
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""A client's connection preface and an empty SETTINGS frame (RFC 9113 §3.4)."""
DIGIT = {
    "inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}]
}


def start(root: Path, log: Path, **env: str) -> Server:
    environment = {"TG_WORKERS": "2", "TG_DRAIN_PRE_STOP_S": "0", **env}
    server = Server(root, env=environment, log_path=log)
    server.wait_until()
    return server


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("workers") / "models"
    copy_model("digits", root / "digits")
    server = start(
        root, root.parent / "server.log", TG_ADMIN_TOKEN=ADMIN, TG_MAX_CONNECTIONS_PER_CLIENT="32"
    )
    try:
        yield server
    finally:
        assert server.stop() == 0


def workers(server: Server) -> list[psutil.Process]:
    return psutil.Process(server.process.pid).children()


def fresh(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """One request on a connection of its own (so that any worker may take it)."""
    return httpx.request(method, url, timeout=30, **kwargs)


def access_lines(server: Server) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line["logger"] == "tensorgate.access"]


def every_worker_answers(server: Server, url: str, at_least: int = 16) -> list[int]:
    """The statuses of ``at_least`` inference requests to ``url``, each on a connection of its
    own, and more (up to 200) until the access log shows both workers answered: which worker
    takes a lone connection is the kernel's and the scheduler's choice, and on a loaded machine
    one worker's loop may win 16 in a row."""
    before = len(access_lines(server))
    codes: list[int] = []
    while len(codes) < 200:
        codes.append(fresh("POST", url, json=DIGIT).status_code)
        if len(codes) < at_least:
            continue
        server.wait_for(lambda: len(access_lines(server)) - before == len(codes))
        if {line["worker"] for line in access_lines(server)[before:]} == {0, 1}:
            return codes
    raise AssertionError(f"one worker answered all {len(codes)} requests")


def requests_total(text: str, model: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tensorgate_requests_total" and sample.labels["model"] == model
    )


def test_two_workers_answer_as_one_server_with_exact_totals(two: Server) -> None:
    assert len(workers(two)) == 2
    before = len(access_lines(two))
    count = 60
    with ThreadPoolExecutor(4) as pool:
        codes = list(
            pool.map(
                lambda _: (
                    fresh("POST", f"{two.url}/v2/models/digits/infer", json=DIGIT).status_code
                ),
                range(count),
            )
        )
    assert codes == [200] * count
    two.wait_for(lambda: len(access_lines(two)) - before == count)
    lines = access_lines(two)[before:]
    assert {line["worker"] for line in lines} == {0, 1}  # both served, one line per request
    # Whichever worker answers, the totals are the server's: ask on fresh connections.
    for _ in range(6):
        assert requests_total(fresh("GET", f"{two.url}/metrics").text, "digits") == count
        stats = fresh("GET", f"{two.url}/v2/models/digits/stats").json()["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == count
        assert (
            sum(b["compute_infer"]["count"] for b in stats["batch_stats"])
            == (stats["execution_count"])
        )
    with tgrpc.InferenceServerClient(two.grpc_url) as client:
        assert client.is_server_ready()
        grpc_stats = client.get_inference_statistics("digits", as_json=True)
        assert int(grpc_stats["model_stats"][0]["inference_stats"]["success"]["count"]) == count


def test_process_metrics_count_the_supervisor_with_its_workers(two: Server) -> None:
    """The supervisor's front buffers what gRPC clients send: its memory is the server's."""
    supervisor = psutil.Process(two.process.pid)
    processes = [supervisor, *workers(two)]
    text = fresh("GET", f"{two.url}/metrics").text
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("process_")
    }
    # the earliest start is the supervisor's, computed as prometheus_client does from /proc
    assert abs(samples["process_start_time_seconds"] - supervisor.create_time()) < 0.05
    assert min(w.create_time() for w in processes[1:]) - supervisor.create_time() > 0.05
    assert samples["process_open_fds"] >= sum(p.num_fds() for p in processes) * 0.8
    assert samples["process_resident_memory_bytes"] > sum(
        w.memory_info().rss for w in processes[1:]
    )


def test_no_other_process_can_bind_the_ports_beside_the_workers(two: Server) -> None:
    """The workers accept HTTP from the supervisor's one listening socket, and gRPC through the
    supervisor's (service/cluster/front.py), both bound without SO_REUSEPORT: a second server
    of the same user cannot take a share of the connections, IPv4 or dual-stack IPv6 (issue
    #28, finding 12: a stranger's IPv4 socket took every new gRPC channel)."""
    for port in (two.port, two.grpc_port):
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::")):
            with socket.socket(family) as stranger:
                stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                with pytest.raises(OSError, match="in use"):
                    stranger.bind((host, port))
    assert fresh("GET", f"{two.url}/v2/health/ready").status_code == 200
    for _ in range(6):  # fresh channels, each forwarded to a worker
        with tgrpc.InferenceServerClient(two.grpc_url) as client:
            assert client.is_server_ready()


def test_one_client_gets_at_most_its_share_of_the_grpc_connections(two: Server) -> None:
    """grpcio has no per-address cap; the supervisor's front applies
    TG_MAX_CONNECTIONS_PER_CLIENT (32 here) to gRPC as each worker does to HTTP (issue #28,
    finding 16: one client's silent connections locked every other client out)."""
    silent = [socket.create_connection(("127.0.0.1", two.grpc_port), 10) for _ in range(32)]
    try:
        with socket.create_connection(("127.0.0.1", two.grpc_port), 10) as extra:
            try:  # a forwarded connection would get grpcio's SETTINGS back
                extra.sendall(HTTP2_PREFACE)
                answer = extra.recv(1)
            except ConnectionError:
                answer = b""
            assert answer == b"", "the 33rd connection from one address was served"
        assert fresh("GET", f"{two.url}/v2/health/ready").status_code == 200  # HTTP's own cap
    finally:
        for sock in silent:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # the front sees the closes, and the client may open channels again
        try:
            with tgrpc.InferenceServerClient(two.grpc_url) as client:
                assert client.is_server_ready()
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", two.grpc_port), 10) as again:
        again.sendall(HTTP2_PREFACE)
        assert again.recv(1) != b"", "a forwarded connection gets grpcio's SETTINGS"


def test_a_single_server_s_grpc_port_is_its_own(repository: Path, tmp_path: Path) -> None:
    """One process: its gRPC port is bound without SO_REUSEPORT (grpcio's default), so no
    other process can bind beside it and take calls (issue #28, finding 12)."""
    server = Server(repository, log_path=tmp_path / "server.log")
    try:
        server.wait_until()
        for port in (server.port, server.grpc_port):
            with socket.socket() as stranger:
                stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                with pytest.raises(OSError, match="in use"):
                    stranger.bind(("127.0.0.1", port))
    finally:
        assert server.stop() == 0


def test_a_second_server_on_the_workers_grpc_port_does_not_start(
    two: Server, tmp_path: Path
) -> None:
    """Its workers would have joined the first server's SO_REUSEPORT group and taken a share of
    its calls: its supervisor cannot bind the port, and stops."""
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    env = {"TG_WORKERS": "2", "TG_GRPC_PORT": str(two.grpc_port)}
    second = Server(root, env=env, log_path=tmp_path / "server.log")
    assert second.process.wait(60) == 1
    assert f"cannot listen on the gRPC port 127.0.0.1:{two.grpc_port}" in second.log()
    second.stop()
    assert fresh("GET", f"{two.url}/v2/health/ready").status_code == 200


def test_load_and_unload_reach_every_worker(two: Server) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    url = f"{two.url}/v2/repository/models/digits"
    assert fresh("POST", f"{url}/unload", headers=admin).status_code == 200
    assert 200 not in every_worker_answers(two, f"{two.url}/v2/models/digits/infer")
    assert fresh("POST", f"{url}/load", headers=admin).status_code == 200
    codes = [
        fresh("POST", f"{two.url}/v2/models/digits/infer", json=DIGIT).status_code
        for _ in range(16)
    ]
    assert codes == [200] * 16


def test_the_control_socket_answers_no_process_without_the_servers_key(two: Server) -> None:
    """#28 finding 19: any process of this user could connect to a worker's control socket
    and unload its models (one worker unloaded, the other serving: split state)."""
    place = workers(two)[0].environ()["TENSORGATE_WORKER"]
    index, folder = place.split("/")[0], place.split("/", 4)[4]
    for question in (
        {"op": "unload", "args": ["digits"]},
        {"op": "unload", "args": ["digits"], "key": "0" * 64},
    ):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect(f"{folder}/worker-{index}.sock")
            sock.sendall(json.dumps(question).encode() + b"\n")
            answer = json.loads(sock.makefile().readline())
        assert answer == {"error": "this server's control key is needed", "status": 401}
    codes = [
        fresh("POST", f"{two.url}/v2/models/digits/infer", json=DIGIT).status_code
        for _ in range(16)
    ]
    assert codes == [200] * 16  # every worker still serves
    two.wait_log("control socket: a question without this server's key, refused")


def test_a_dead_worker_is_replaced_while_the_other_serves(two: Server) -> None:
    victim, survivor = workers(two)
    victim.kill()
    victim.wait(10)
    # The survivor serves every new connection while the replacement starts; readiness is
    # false until the replacement is ready too.
    saw_not_ready = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready = fresh("GET", f"{two.url}/v2/health/ready")
        if ready.status_code == 503:
            saw_not_ready = True
            assert "worker" in ready.json()["reason"]
        assert fresh("POST", f"{two.url}/v2/models/digits/infer", json=DIGIT).status_code == 200
        if saw_not_ready and ready.status_code == 200:
            break
    else:
        raise AssertionError(f"the server was never ready again:\n{two.log(3000)}")
    assert saw_not_ready
    pids = {p.pid for p in workers(two)}
    assert survivor.pid in pids and victim.pid not in pids and len(pids) == 2
    assert "worker" in two.log() and "exited with status -9" in two.log()


def test_a_replacement_serves_only_what_its_siblings_serve_and_binds_grpc_when_ready(
    two: Server,
) -> None:
    """#28 findings 18 and 10: a replacement loaded the whole repository again (after an
    unload, 11 of 20 requests were served by it while the index said unloaded), and bound its
    gRPC port while its models loaded (calls it took were UNAVAILABLE ... LOADING)."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    url = f"{two.url}/v2/repository/models/digits"
    assert fresh("POST", f"{url}/unload", headers=admin).status_code == 200
    # a folder that appeared after the start, which nobody loaded: the replacement loaded it
    # from the folder and served it alone (the index said UNLOADED; a third of requests 200)
    copy_model("digits", two.repository / "late")
    try:
        victim = workers(two)[0]
        index = int(victim.environ()["TENSORGATE_WORKER"].split("/")[0])
        logged = len(two.log().splitlines())
        victim.kill()
        victim.wait(10)

        def replacement_lines() -> list[str]:
            tail = two.log().splitlines()[logged:]
            lines = [json.loads(text) for text in tail if text.startswith("{")]
            return [line["msg"] for line in lines if line.get("worker") == index]

        two.wait_for(lambda: any("gRPC listening" in m for m in replacement_lines()), timeout=120)
        messages = replacement_lines()
        ready = messages.index("model digits version 1 is ready")
        followed = messages.index(
            "model digits is unloaded in the other workers: unloading it here too"
        )
        bound = next(i for i, m in enumerate(messages) if "gRPC listening" in m)
        assert ready < followed < bound
        dropped = "model late was never loaded by the other workers: unloading it here too"
        assert dropped in messages[:bound]
        for model in ("digits", "late"):
            codes = [
                fresh("POST", f"{two.url}/v2/models/{model}/infer", json=DIGIT).status_code
                for _ in range(20)
            ]
            assert 200 not in codes, model  # neither worker serves it
    finally:
        shutil.rmtree(two.repository / "late")
        assert fresh("POST", f"{url}/load", headers=admin).status_code == 200
    two.wait_for(lambda: fresh("GET", f"{two.url}/v2/health/ready").status_code == 200)


def test_a_refused_load_is_alike_in_every_worker_and_a_replacement_stays_ready(
    two: Server,
) -> None:
    """A refused load reached only the worker that took it: the other did not know of the
    new folder (404, or UNLOADED in the index), and answers flipped with the worker a request
    reached. And a replacement started later loaded that folder at its start, met the same
    refusal, and counted it against its readiness: the server stayed unready for good."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    broken = two.repository / "broken"
    copy_model("digits", broken)
    for artifact in (broken / "1").glob("model.*"):
        artifact.write_bytes(b"not a model")
    try:
        refused = fresh("POST", f"{two.url}/v2/repository/models/broken/load", headers=admin)
        assert refused.status_code == 400, refused.text
        states = {
            fresh("GET", f"{two.url}/v2/models/broken").json().get("state") for _ in range(40)
        }
        assert states == {"UNAVAILABLE"}
        assert "broken" in two.log()
        victim = workers(two)[0]
        victim.kill()
        victim.wait(10)
        two.wait_for(
            lambda: len(workers(two)) == 2 and victim.pid not in {p.pid for p in workers(two)}
        )
        two.wait_for(
            lambda: fresh("GET", f"{two.url}/v2/health/ready").status_code == 200, timeout=120
        )
        two.wait_log("model broken was refused in the other workers, and here: shown refused")
        states = {
            fresh("GET", f"{two.url}/v2/models/broken").json().get("state") for _ in range(40)
        }
        assert states == {"UNAVAILABLE"}
    finally:
        fresh("POST", f"{two.url}/v2/repository/models/broken/unload", headers=admin)
        shutil.rmtree(broken)
    two.wait_for(lambda: fresh("GET", f"{two.url}/v2/health/ready").status_code == 200)


def test_a_load_and_an_unload_sent_together_leave_every_worker_alike(two: Server) -> None:
    """Sent at once on two connections (so to either worker), they crossed: one worker served
    the model and the other said it was unloaded, for good, and both calls answered 200.
    Whichever comes last now wins in every worker. (The crossing needs a load to finish
    between the two: with this fast model it did not happen here before the fix either; it
    did with a model whose load replays its code's answers.)"""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    url = f"{two.url}/v2/repository/models/digits"
    try:
        for _ in range(6):
            assert fresh("POST", f"{url}/load", headers=admin).status_code == 200
            with ThreadPoolExecutor(2) as clients:
                calls = [
                    clients.submit(fresh, "POST", f"{url}/{op}", headers=admin)
                    for op in ("unload", "load")
                ]
                codes = sorted(call.result().status_code for call in calls)
            assert codes in ([200, 200], [200, 409]), codes  # a load an unload stopped: 409
            ready = {
                fresh("GET", f"{two.url}/v2/models/digits/ready").status_code for _ in range(12)
            }
            assert len(ready) == 1, ready  # every worker alike, served or not
    finally:
        assert fresh("POST", f"{url}/load", headers=admin).status_code == 200
    two.wait_for(lambda: fresh("GET", f"{two.url}/v2/health/ready").status_code == 200)


def test_connections_one_worker_took_are_spread_over_both(two: Server) -> None:
    """#27: 12 keep-alive connections all taken by one worker (the other stopped while they
    opened, as a burst taken by one loop) stay there, each of its requests waiting behind the
    others' while the other worker idles. The crowded worker lets connections go after their
    responses (``Connection: close``) until each holds its share; the clients reconnect."""
    host, port = "127.0.0.1", two.port
    two.client.close()  # its keep-alive connection would count in one worker's share
    two.client = httpx.Client(base_url=two.url, timeout=60)  # opens none until used
    other = workers(two)[1]
    other.suspend()
    try:
        clients = [http.client.HTTPConnection(host, port, timeout=30) for _ in range(12)]
        first = [_infer(client) for client in clients]  # all taken by the one running worker
    finally:
        other.resume()
    last, closes, quiet = list(first), 0, 0
    for _ in range(200):  # rounds of a request on each connection, until 3 in a row let none go
        before = closes
        for i, client in enumerate(clients):
            last[i] = _infer(client)
            if last[i][1]:
                closes += 1
                client.close()
                clients[i] = http.client.HTTPConnection(host, port, timeout=30)
        quiet = quiet + 1 if closes == before else 0
        if quiet == 3:  # longer than CLOSE_EVERY_S: neither worker holds more than its share
            break
    assert connection_counts(two) == [6, 6]  # as the workers share them
    for client in clients:
        client.close()
    answered_by = _workers_of(two, [rid for rid, _ in first + last])
    assert len({answered_by[rid] for rid, _ in first}) == 1  # one worker took all 12
    spread = Counter(answered_by[rid] for rid, _ in last)
    assert sorted(spread.values()) == [6, 6], (spread, closes)
    assert closes <= 60  # reconnections bounded: one per 10 ms a worker at most


def test_a_burst_of_connections_is_taken_in_turns(two: Server) -> None:
    """#27: 16 connections opened at once (a client pool) went mostly to the first worker's
    loop to wake, which accepted every one waiting (4/12 in 4 of 10 bursts here; 8/8 once),
    and its requests waited half as long again until the balance let some go. A worker now
    accepts one a wake-up and lets a connection wait 2 ms for a worker that holds fewer. A
    loaded machine may not run the other worker within those 2 ms a few times in a row (CI:
    5/11 and 7/9), so each burst is held to a quarter at least and the three to 20 of 48."""
    host, port = "127.0.0.1", two.port
    two.client.close()  # its keep-alive connection would count in one worker's share
    two.client = httpx.Client(base_url=two.url, timeout=60)
    splits = []
    for _ in range(3):
        # both accepting, the last burst's connections closed in both counts
        two.wait_for(lambda: connection_counts(two) == [0, 0], timeout=60)
        clients = [http.client.HTTPConnection(host, port, timeout=30) for _ in range(16)]
        for client in clients:
            client.connect()
        answered = [_infer(client) for client in clients]
        for client in clients:
            client.close()
        answered_by = _workers_of(two, [rid for rid, _ in answered])
        splits.append(sorted(Counter(answered_by[rid] for rid, _ in answered).values()))
    assert all(len(split) == 2 and split[0] >= 4 for split in splits), splits
    assert sum(split[0] for split in splits) >= 20, splits


def connection_counts(server: Server) -> list[int]:
    """The workers' counts of HTTP connections, as they share them (service.limits.balance;
    65535 for a worker not accepting)."""
    place = workers(server)[0].environ()["TENSORGATE_WORKER"]
    shared = Path(place.split("/", 4)[4]) / "connections"
    return list(array.array("H", shared.read_bytes()))


def _infer(client: http.client.HTTPConnection) -> tuple[str, bool]:
    """One v2 request on ``client``: its request id, and whether the server closes after it."""
    client.request(
        "POST",
        "/v2/models/digits/infer",
        body=json.dumps(DIGIT),
        headers={"Content-Type": "application/json"},
    )
    response = client.getresponse()
    response.read()
    assert response.status == 200
    closing = (response.getheader("connection") or "").lower() == "close"
    return response.getheader("x-request-id") or "", closing


def _workers_of(server: Server, request_ids: list[str]) -> dict[str, int]:
    """Which worker answered each request (the access log's ``worker`` field)."""
    wanted = set(request_ids)
    server.wait_for(lambda: wanted <= set(_logged(server)), timeout=10)
    logged = _logged(server)
    return {request_id: logged[request_id] for request_id in wanted}


def _logged(server: Server) -> dict[str, int]:
    rows = (json.loads(line) for line in server.log().splitlines() if '"request_id"' in line)
    return {r["request_id"]: r["worker"] for r in rows if "worker" in r and "request_id" in r}


def test_a_wedged_worker_is_killed_and_replaced(tmp_path: Path) -> None:
    """#28 finding 11: a SIGSTOPped worker was noticed by no one: the connections it took
    hung and the supervisor did nothing."""
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    server = start(root, tmp_path / "server.log", TG_STUCK_INSTANCE_S="3")
    victim = workers(server)[0]
    try:
        victim.suspend()
        server.wait_for(lambda: victim.pid not in {p.pid for p in workers(server)}, timeout=60)
        server.wait_log("s (TG_STUCK_INSTANCE_S): killing it to start another")
        server.wait_for(lambda: len(workers(server)) == 2, timeout=60)
        server.wait_for(
            lambda: fresh("GET", f"{server.url}/v2/health/ready").status_code == 200, timeout=120
        )
        codes = [
            fresh("POST", f"{server.url}/v2/models/digits/infer", json=DIGIT).status_code
            for _ in range(16)
        ]
        assert codes == [200] * 16
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):  # a test that failed: none left stopped
            victim.kill()
        assert server.stop() == 0


def test_no_worker_outlives_its_supervisor_however_it_ends(tmp_path: Path) -> None:
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    server = start(root, tmp_path / "server.log")
    children = workers(server)
    assert len(children) == 2
    server.process.kill()  # no chance to forward anything: the kernel tells the workers
    server.process.wait()
    _gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [p.pid for p in alive]
    server.stop()


def test_sigterm_stops_every_worker_and_exits_0(tmp_path: Path) -> None:
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    server = start(root, tmp_path / "server.log")
    children = workers(server)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0
    _gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive
    assert server.log().count("drained: every accepted request was answered") == 2
    server.stop()


def test_a_server_whose_workers_cannot_start_exits_with_an_error(tmp_path: Path) -> None:
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    with socket.socket() as taken:  # a port another program listens on, without SO_REUSEPORT
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = Server(
            root,
            env={"TG_WORKERS": "2"},
            log_path=tmp_path / "server.log",
            port=taken.getsockname()[1],
        )
        code = server.process.wait(60)
        assert code != 0, server.log()
        port = taken.getsockname()[1]
        said = f"cannot listen on the HTTP port 127.0.0.1:{port} (Address already in use)"
        assert said in server.log()
        assert "Traceback" not in server.log()  # one line (it was a traceback)
        server.stop()


@pytest.mark.parametrize("kind", ["HTTP", "gRPC"])
def test_one_worker_whose_port_is_taken_says_so_in_one_line_before_loading(
    tmp_path: Path, kind: str
) -> None:
    """With one worker, a taken HTTP port was found by uvicorn once every model had loaded,
    and a taken gRPC port was grpcio's line and a startup traceback."""
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"TG_GRPC_PORT": str(port)} if kind == "gRPC" else {}
        server = Server(
            root,
            env=env,
            log_path=tmp_path / "server.log",
            port=port if kind == "HTTP" else None,
        )
        assert server.process.wait(60) == 1, server.log()
        server.stop()
    log = server.log()
    assert f"cannot listen on the {kind} port 127.0.0.1:{port} (Address already in use)" in log
    assert "Traceback" not in log and "model digits" not in log  # before any model loaded


@pytest.mark.parametrize("workers", ["1", "2"])
def test_host_any_ipv6_serves_ipv4_too_with_one_worker_or_several(
    tmp_path: Path, workers: str
) -> None:
    """TG_HOST=:: served IPv4 with several workers (the supervisor's dual-stack socket) and
    gRPC (grpcio's), but HTTP with one worker only on IPv6: asyncio binds ``::`` IPv6 only,
    so on a one-CPU pod a kubelet's IPv4 probe found nothing listening."""
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    server = Server(root, env={"TG_HOST": "::", "TG_WORKERS": workers})
    try:
        server.wait_until()  # over IPv4: the server's url is 127.0.0.1's
        assert fresh("GET", f"http://[::1]:{server.port}/v2/health/ready").status_code == 200
        for target in (server.grpc_url, f"[::1]:{server.grpc_port}"):
            with tgrpc.InferenceServerClient(target) as client:
                assert client.is_server_ready()
    finally:
        assert server.stop() == 0


def test_workers_run_tensorgate_not_a_service_package_of_the_current_folder(
    tmp_path: Path,
) -> None:
    """`tensorgate serve` run in a user's project that has a `service` package of its own (a
    common name): the workers, started as `python -m service`, imported the project's package
    from the current folder, and the server could not start."""
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    project = tmp_path / "project"
    (project / "service").mkdir(parents=True)
    (project / "service" / "__init__.py").write_text(
        "raise SystemExit('the project\\'s own service package was imported')\n"
    )
    script = Path(sys.executable).parent / "tensorgate"  # the console script, as a user runs it
    server = Server(
        root,
        env={"TG_WORKERS": "2", "TG_MODEL_REPOSITORY": str(root)},
        log_path=tmp_path / "server.log",
        command=(str(script), "serve"),
        cwd=project,
    )
    try:
        server.wait_until()
        answered = {server.client.get("/v2/health/ready").status_code for _ in range(8)}
        assert answered == {200}
        assert "own service package" not in server.log()
    finally:
        assert server.stop() == 0, server.log()


def test_a_new_version_found_by_poll_reaches_every_worker(tmp_path: Path) -> None:
    root = tmp_path / "models"
    copy_model("digits", root / "digits")
    server = start(root, tmp_path / "server.log", TG_POLL_INTERVAL_S="0.5")
    try:
        shutil.copytree(root / "digits" / "1", root / "digits" / "2")
        url = f"{server.url}/v2/models/digits/versions/2"
        server.wait_for(
            lambda: all(fresh("GET", f"{url}/ready").status_code == 200 for _ in range(8)),
            timeout=120,
        )
        assert set(every_worker_answers(server, f"{url}/infer")) == {200}
    finally:
        assert server.stop() == 0
