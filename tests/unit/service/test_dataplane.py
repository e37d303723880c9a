"""The core in process, on a tiny real ONNX model written by the test (no built model): the
DataPlane, the loader and repository behind it, and the one inference route function."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from service.core.dataplane import answer_bytes
from service.errors import (
    InvalidInput,
    ModelExecutionError,
    ModelLoadError,
    ModelNotFound,
    ServerBusy,
    UnsupportedMediaType,
)
from service.http.answer import Route, answer_inference
from service.inference import (
    InferenceRequest,
    InferenceResult,
    InputTensor,
    OutputTensor,
    RequestedOutput,
)
from service.model_config import load_model_config
from service.repository.loader import LoadBound, LoadedVersion, load_version
from service.settings import Settings
from service.telemetry.counters import REFUSED
from tests.asgi import InProcess
from tests.identity import write_identity_model

TOKEN = "unit-test-api-token-1"


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcess]:
    root = tmp_path_factory.mktemp("core") / "models"
    write_identity_model(root / "identity", max_batch_size=8)
    settings = Settings(
        model_repository=root,
        api_token=TOKEN,
        intra_op_threads=1,
        preprocess_threads=1,
        access_log=False,
        max_body_bytes=10_000,
    )
    running = InProcess(settings)
    try:
        yield running
    finally:
        running.close()


def fp32(rows: int) -> InputTensor:
    data = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    return InputTensor("in_FP32", "FP32", data.shape, data)


def all_inputs(rows: int) -> list[InputTensor]:
    """Every input of the identity model (it takes one of each datatype)."""
    from service.datatypes import TO_NUMPY
    from tests.identity import ONNX_TYPES

    tensors = []
    for datatype in ONNX_TYPES:
        dtype = TO_NUMPY[datatype]
        data = np.full((rows, 3), b"x" if datatype == "BYTES" else 1, dtype=dtype)
        tensors.append(InputTensor(f"in_{datatype}", datatype, data.shape, data))
    return tensors


def infer(core: InProcess, request: InferenceRequest) -> InferenceResult:
    async def run() -> InferenceResult:
        with core.dataplane.call("test", request.model, request.version) as call:
            return await call.infer(request)

    return core.run(run())


def test_infer_answers_the_outputs_asked_for_in_order(core: InProcess) -> None:
    inputs = all_inputs(2)
    wanted = [RequestedOutput("out_INT8"), RequestedOutput("out_FP32", {"binary_data": True})]
    result = infer(core, InferenceRequest("identity", inputs=inputs, outputs=wanted, id="r-1"))
    assert [o.name for o in result.outputs] == ["out_INT8", "out_FP32"]
    assert result.outputs[1].parameters == {"binary_data": True}  # echoed for the protocol
    np.testing.assert_array_equal(result.outputs[1].data, inputs[10].data)
    assert (result.model, result.version, result.id, result.batched) == (
        "identity",
        "1",
        "r-1",
        True,
    )
    assert set(result.raw) == {f"out_{t.datatype}" for t in inputs}


def test_an_unknown_output_is_refused_before_the_model_runs(core: InProcess) -> None:
    served = core.dataplane.repository.served_versions()[0][1]
    before = served.stats.execution_count
    with pytest.raises(InvalidInput, match="requested output 'nope' is not an output"):
        infer(
            core,
            InferenceRequest("identity", inputs=all_inputs(1), outputs=[RequestedOutput("nope")]),
        )
    assert served.stats.execution_count == before


def test_rows_are_read_against_the_model_inputs(core: InProcess) -> None:
    with pytest.raises(InvalidInput, match="send each instance as an object naming them"):
        infer(core, InferenceRequest("identity", rows=[[1.0, 2.0, 3.0]]))


def test_row_objects_name_every_input_and_no_other(core: InProcess) -> None:
    """An object lacking an input read as null ("null is not a number"), and a misspelt name
    was dropped without a word."""
    served = next(
        s.loaded.signature.inputs
        for v, s in core.dataplane.repository.served_versions()
        if v.name == "identity"
    )
    row = {t.name: [0] * t.shape[0] for t in served}
    first = served[0].name
    lacking = {k: v for k, v in row.items() if k != first}
    with pytest.raises(InvalidInput, match=rf"instances\[1\] lacks input\(s\) \['{first}'\]"):
        infer(core, InferenceRequest("identity", rows=[row, lacking]))
    with pytest.raises(InvalidInput, match=r"instances\[0\] names no input \['typo'\]"):
        infer(core, InferenceRequest("identity", rows=[{**row, "typo": [1]}]))


def test_raw_items_need_a_pipeline(core: InProcess) -> None:
    with pytest.raises(UnsupportedMediaType, match="'identity' has no preprocessing"):
        infer(core, InferenceRequest("identity", raw=[b"\x89PNG"]))


def test_an_unknown_model_is_404(core: InProcess) -> None:
    with pytest.raises(ModelNotFound, match="unknown model 'ghost'"):
        infer(core, InferenceRequest("ghost", inputs=[fp32(1)]))


def test_health_states(core: InProcess) -> None:
    dataplane = core.dataplane
    assert dataplane.live() == (True, "")
    assert dataplane.started() == (True, "")
    assert dataplane.ready() == (True, "")
    dataplane.drain.draining = True
    try:
        assert dataplane.ready() == (False, "draining: the server is shutting down")
    finally:
        dataplane.drain.draining = False


def test_a_draining_server_refuses_new_requests(core: InProcess) -> None:
    core.dataplane.drain.refusing = True
    try:
        with pytest.raises(ServerBusy, match="shutting down"):
            infer(core, InferenceRequest("identity", inputs=all_inputs(1)))
    finally:
        core.dataplane.drain.refusing = False


def test_the_grace_periods_end_is_answered_and_any_other_cancellation_goes_on() -> None:
    """:meth:`Drain.answer_for`, the one place REST, gRPC calls and gRPC streams turn the
    grace period's end into a 503: its task is uncancelled (answered, not dropped); a
    cancellation before the end (a client that left) is raised again, untouched."""
    from service.telemetry.observation import GRACE_OVER, Drain

    async def waiting(drain: Drain) -> object:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            busy = drain.answer_for(exc)
            task = asyncio.current_task()
            assert task is not None
            return busy, task.cancelling()
        raise AssertionError("unreachable")

    async def main() -> None:
        drain = Drain()
        left = asyncio.create_task(waiting(drain))
        await asyncio.sleep(0)
        left.cancel("the client left")
        with pytest.raises(asyncio.CancelledError, match="the client left"):
            await left
        drain.tasks.add(over := asyncio.create_task(waiting(drain)))
        await asyncio.sleep(0)
        drain.expire()
        busy, cancelling = await over
        assert isinstance(busy, ServerBusy) and str(busy) == GRACE_OVER
        assert cancelling == 0 and not over.cancelled()

    asyncio.run(main())


class Body:
    """An ASGI ``receive`` that gives a body, then waits (the client stays)."""

    def __init__(self, body: bytes) -> None:
        self.messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def __call__(self) -> dict[str, object]:
        import asyncio

        if self.messages:
            return self.messages.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("headers", "body", "status", "message"),
    [
        ({}, b"{}", 401, "needs 'Authorization: Bearer <api token>'"),
        ({"authorization": f"Bearer {TOKEN}"}, b"x" * 20_000, 413, "the limit is 10000"),
        ({"authorization": f"Bearer {TOKEN}"}, b'{"inputs": [', 400, "not valid JSON"),
        (
            {"authorization": f"Bearer {TOKEN}", "x-request-timeout": "soon"},
            b"{}",
            400,
            "X-Request-Timeout",
        ),
    ],
)
def test_the_route_function_maps_each_error_once(
    core: InProcess, headers: dict[str, str], body: bytes, status: int, message: str
) -> None:
    headers = {**headers, "content-length": str(len(body))}
    answer = core.run(
        answer_inference(core.dataplane, Route("infer", "identity"), headers, Body(body))
    )
    assert answer.status == status
    assert message in orjson.loads(answer.body)["error"]
    assert answer.headers["content-type"] == "application/json"


def test_a_bad_header_or_encoding_is_counted_where_an_operator_looks(core: InProcess) -> None:
    """Refused before a model is looked up, so no request metric sees it: counted as
    ``bad_request``; a bad body for the model is the model's 400, counted there instead."""
    token = {"authorization": f"Bearer {TOKEN}"}
    cases = [
        ({"x-request-timeout": "soon"}, b"{}"),
        ({"inference-header-content-length": "-3"}, b"{}"),
        ({"content-encoding": "br"}, b"{}"),
        ({"content-encoding": "gzip"}, b"not gzip"),
    ]
    before = REFUSED["bad_request"]
    for extra, body in cases:
        headers = {**token, **extra, "content-length": str(len(body))}
        answer = core.run(
            answer_inference(core.dataplane, Route("infer", "identity"), headers, Body(body))
        )
        assert answer.status in (400, 415), (extra, answer.body)
    assert REFUSED["bad_request"] == before + len(cases)
    headers = {**token, "content-length": "12"}
    answer = core.run(
        answer_inference(core.dataplane, Route("infer", "identity"), headers, Body(b'{"inputs": ['))
    )
    assert answer.status == 400 and REFUSED["bad_request"] == before + len(cases)


def test_the_route_function_answers_a_v2_request(core: InProcess) -> None:
    data = [1.0, 2.0, 3.0]
    inputs = [
        {
            "name": f"in_{t.datatype}",
            "datatype": t.datatype,
            "shape": [1, 3],
            "data": ["x"] * 3
            if t.datatype == "BYTES"
            else ([True] * 3 if t.datatype == "BOOL" else data),
        }
        for t in all_inputs(1)
    ]
    body = orjson.dumps({"inputs": inputs, "outputs": [{"name": "out_FP64"}]})
    headers = {"authorization": f"Bearer {TOKEN}", "content-length": str(len(body))}
    answer = core.run(
        answer_inference(core.dataplane, Route("infer", "identity", "1"), headers, Body(body))
    )
    assert answer.status == 200, answer.body
    assert orjson.loads(answer.body)["outputs"] == [
        {"name": "out_FP64", "datatype": "FP64", "shape": [1, 3], "data": data}
    ]


def test_a_loaded_version_is_frozen_and_knows_its_warm_shapes(tmp_path: Path) -> None:
    write_identity_model(tmp_path / "identity", max_batch_size=4, warmup="{batch_sizes: [1, 4]}")
    config = load_model_config(tmp_path / "identity" / "config.yaml")
    loaded = load_version(
        "identity", tmp_path / "identity" / "1", config, Settings(model_repository=tmp_path)
    )
    try:
        assert isinstance(loaded, LoadedVersion)
        with pytest.raises(dataclasses.FrozenInstanceError):
            loaded.name = "other"  # type: ignore[misc]  # the point: it cannot change
        rows = {dict(shape)["in_FP32"][0] for shape in loaded.warmed}
        assert rows == {1, 4}
        assert not loaded.verified and loaded.warnings  # no manifest: gates skipped, each named
    finally:
        loaded.close()


def test_padding_without_exports_facts_is_a_warning_of_its_own(tmp_path: Path) -> None:
    """Without a manifest, a dynamic dim pads up to its bucket on trust and its outputs are not
    cropped back: the metadata's warnings said only that the gates were skipped."""
    write_identity_model(tmp_path / "identity", datatypes=("FP32",), width="w", buckets="[2, 4]")
    config = load_model_config(tmp_path / "identity" / "config.yaml")
    settings = Settings(model_repository=tmp_path)
    loaded = load_version("identity", tmp_path / "identity" / "1", config, settings)
    try:
        (said,) = [w for w in loaded.warnings if "padded up to their buckets unverified" in w]
        assert "outputs not cropped back" in said
    finally:
        loaded.close()


def test_a_config_naming_only_inputs_is_refused_when_read(tmp_path: Path) -> None:
    from service.errors import ModelLoadError

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.yaml").write_text(
        "backend: onnx\ninputs: [{name: x, datatype: FP32, shape: [3]}]\n"
    )
    with pytest.raises(ModelLoadError, match="name both 'inputs' and 'outputs', or neither"):
        load_model_config(folder / "config.yaml")


def test_parameters_timeout_is_checked_and_the_sooner_deadline_wins(core: InProcess) -> None:
    """Issue #28, finding 22: with a gRPC deadline (or X-Request-Timeout), an OIP
    ``parameters.timeout`` went unchecked; now it is checked, and the sooner one applies."""
    dataplane = core.dataplane
    with pytest.raises(InvalidInput, match="timeout"):
        dataplane.deadline(30.0, {"timeout": "soon"})
    with pytest.raises(InvalidInput, match="timeout"):
        dataplane.deadline(30.0, {"timeout": -5})
    now = time.monotonic()
    assert dataplane.deadline(30.0, {"timeout": 1_000_000}) - now < 2  # 1 s, not 30 s
    assert 29 < dataplane.deadline(30.0, {"timeout": 60_000_000}) - now < 31
    assert 0.4 < dataplane.deadline(None, {"timeout": 500_000}) - now < 1.5


def test_a_load_stops_at_its_next_warmup_batch_once_the_server_stops(tmp_path: Path) -> None:
    """#28 finding 13: a load in warmup held SIGTERM for the rest of its warmup."""
    write_identity_model(tmp_path / "identity", max_batch_size=4, warmup="{batch_sizes: all}")
    config = load_model_config(tmp_path / "identity" / "config.yaml")
    stop = threading.Event()
    stop.set()
    with pytest.raises(ModelLoadError, match="loading stopped: the server is shutting down"):
        load_version(
            "identity",
            tmp_path / "identity" / "1",
            config,
            Settings(model_repository=tmp_path),
            bound=LoadBound(stop, 600),
        )


def test_a_load_stops_once_its_time_is_up_or_it_is_cancelled(tmp_path: Path) -> None:
    """#28 finding 13: a load ran for as long as its warmup took, with no bound."""
    write_identity_model(tmp_path / "identity", max_batch_size=4, warmup="{batch_sizes: all}")
    config = load_model_config(tmp_path / "identity" / "config.yaml")
    settings = Settings(model_repository=tmp_path)
    path = tmp_path / "identity" / "1"
    late = LoadBound(threading.Event(), 1e-9)
    with pytest.raises(ModelLoadError, match=r"longer than TG_LOAD_TIMEOUT_S \(1e-09 s\)"):
        load_version("identity", path, config, settings, bound=late)
    cancelled = LoadBound(threading.Event(), 600)
    cancelled.cancel("model 'identity' was unloaded meanwhile")
    with pytest.raises(ModelLoadError, match="stopped: model 'identity' was unloaded meanwhile"):
        load_version("identity", path, config, settings, bound=cancelled)
    assert load_version("identity", path, config, settings, bound=LoadBound(threading.Event(), 600))


def test_a_models_code_that_hangs_in_its_load_is_left_at_the_loads_bound() -> None:
    """A pipeline's warm() that slept 40 s held a load past a 5 s TG_LOAD_TIMEOUT_S, and an
    unload of the model waited for all of it."""
    release = threading.Event()
    try:
        late = LoadBound(threading.Event(), 0.3)
        with pytest.raises(ModelLoadError, match=r"TG_LOAD_TIMEOUT_S .*stopped in warm\(\)"):
            late.run(release.wait, "warm()")
        cancelled = LoadBound(threading.Event(), 600)
        threading.Timer(0.2, cancelled.cancel, ["model 'm' was unloaded meanwhile"]).start()
        with pytest.raises(ModelLoadError, match="'m' was unloaded meanwhile"):
            cancelled.run(release.wait, "warm()")
    finally:
        release.set()
    assert LoadBound(threading.Event(), 600).run(lambda: 7, "warm()") == 7
    with pytest.raises(SystemExit):  # what the code raises is the load's, as in place
        LoadBound(threading.Event(), 600).run(lambda: sys.exit(3), "warm()")


def test_a_stopped_server_exits_past_threads_its_models_code_hangs_in(tmp_path: Path) -> None:
    """Python joins every pool thread at exit: a postprocess sleeping 45 s kept a drained
    server alive 40 s past its grace."""
    import subprocess

    script = (
        "import threading, time\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from service.cli import _leave_hung_code\n"
        "pool = ThreadPoolExecutor(1, thread_name_prefix='m-code')\n"
        "pool.submit(time.sleep, 60)\n"
        "pool.shutdown(wait=False)\n"
        "_leave_hung_code(0.2)\n"
        "print('not reached')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0 and "not reached" not in done.stdout, done
    assert "exiting while 1 threads still run a model's own code (m-code_0)" in done.stderr


@pytest.mark.parametrize(
    ("values", "pooled", "on_the_loop"),
    [(1 << 20, True, False), (16, True, True), (1 << 20, False, True)],
)
def test_a_large_answer_asked_to_be_pooled_is_encoded_off_the_event_loop(
    core: InProcess, values: int, pooled: bool, on_the_loop: bool
) -> None:
    """gRPC's answers of 60 MiB, built and serialized on the event loop, held every other
    request for tens of milliseconds each (#28): a pooled encode of a large result runs on the
    pool; a small one, or one not pooled (REST's), stays on the loop."""
    from service.inference import OutputTensor

    data = np.zeros(values, np.float32)
    result = InferenceResult(
        "identity", "1", None, [OutputTensor("o", "FP32", data)], {}, {}, None, True
    )

    async def run() -> tuple[int, int]:
        with core.dataplane.call("test", "identity", None) as call:
            encoded = await call.encode(
                lambda r, tag: (threading.get_ident(), tag), result, 7, pooled=pooled
            )
            assert encoded[1] == 7  # the encoder's own arguments passed on
            return encoded[0], threading.get_ident()

    encoder, loop = core.run(run())
    assert (encoder == loop) is on_the_loop


def test_a_hold_asked_for_after_its_request_ended_takes_nothing(
    core: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1 rows of their own lengths are read and padded in the pool, which takes the padding
    from the budget there. A client gone meanwhile ends the request (its holds released) while
    the pool still runs: its hold after that was never released, and each such disconnect
    lost budget for good, until every request was a 503."""
    from service.core.dataplane import RequestEnded
    from service.limits.admission import BytesBudget

    budget = BytesBudget(limit=1 << 20)
    monkeypatch.setattr(core.dataplane, "budget", budget)
    held = [0]
    core.dataplane._hold(held, 1000, already=0)
    assert budget.held == 1000
    core.dataplane.release(held)
    assert budget.held == 0
    with pytest.raises(RequestEnded):
        core.dataplane._hold(held, 1000, already=0)  # the pool's, after the request's end
    assert budget.held == 0
    core.dataplane.release(held)  # a second release gives back nothing
    assert budget.held == 0


@pytest.mark.parametrize(("pooled", "counted"), [(False, 1), (True, 4)])
def test_an_answer_is_counted_in_the_budget_before_it_is_made(
    core: InProcess, monkeypatch: pytest.MonkeyPatch, pooled: bool, counted: int
) -> None:
    """Made first and counted after, each REST answer of 61 MiB was held beside its outputs
    and body uncounted while it was made (3 × the body, 2 × counted). It is counted from before:
    its outputs' size for a binary answer, four times that for JSON text."""
    from service.inference import OutputTensor
    from service.limits.admission import BytesBudget
    from service.telemetry.counters import REQUEST_HELD

    budget = BytesBudget(limit=1 << 30)
    monkeypatch.setattr(core.dataplane, "budget", budget)
    data = np.zeros(1 << 20, np.float32)  # 4 MiB
    result = InferenceResult(
        "identity", "1", None, [OutputTensor("o", "FP32", data)], {}, {}, None, True
    )
    seen: list[int] = []

    async def run() -> list[int]:
        held = [0, 0]
        REQUEST_HELD.set(held)  # as BodyBudget sets it for a REST request
        with core.dataplane.call("test", "identity", None) as call:
            await call.encode(lambda r: seen.append(budget.made), result, pooled=pooled)
        return held

    held = core.run(run())
    assert seen == [counted * data.nbytes] and held == [0, counted * data.nbytes]
    budget.release(held[0], held[1])


def test_a_large_answer_waiting_its_turn_is_not_counted_until_it_starts(
    core: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large answers are made one at a time: counted while they wait, 16 JSON answers of
    61 MiB would count 3.9 GiB as made, refusing even small requests (past twice the budget)."""
    from service.core.dataplane import BULK_BYTES
    from service.inference import OutputTensor
    from service.limits.admission import BytesBudget
    from service.telemetry.counters import REQUEST_HELD

    budget = BytesBudget(limit=1 << 30)
    monkeypatch.setattr(core.dataplane, "budget", budget)
    data = np.zeros(BULK_BYTES // 4, np.float32)
    result = InferenceResult(
        "identity", "1", None, [OutputTensor("o", "FP32", data)], {}, {}, None, True
    )

    async def run() -> tuple[int, int]:
        REQUEST_HELD.set([0, 0])
        async with core.dataplane._bulk:  # another large answer is being made
            with core.dataplane.call("test", "identity", None) as call:
                encoding = asyncio.ensure_future(call.encode(lambda r: None, result, pooled=True))
                await asyncio.sleep(0.05)
                waiting = budget.made
        await encoding
        return waiting, budget.made

    waiting, made = core.run(run())
    assert waiting == 0 and made == 4 * data.nbytes
    budget.release(0, made)


def test_raw_items_are_stacked_into_their_batch_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,024 one-pixel PNGs stack into 616 MB of efficientnet rows: stacked on the event loop,
    the copy held it 2.2 s (py-spy), and every other request and model with it (#28: a normal
    client's worst request 1.6–1.9 s under that attack, 57 ms once stacked in the pool). Each
    row is now copied into its place where it was made, in the pool."""
    from preprocessing.pipeline import Rows

    threads: list[int] = []
    real_put = Rows.put

    def put(self: Rows, index: int, row: dict[str, np.ndarray]) -> None:
        threads.append(threading.get_ident())
        real_put(self, index, row)

    monkeypatch.setattr(Rows, "put", put)
    running = _serve_digits(tmp_path)
    try:
        loop = running.run(_loop_thread())
        _predict_pngs(running, 1, 4)
    finally:
        running.close()
    assert len(threads) == 4 and loop not in threads


@pytest.mark.parametrize(("rows", "on_the_loop"), [(256, False), (1, True)])
def test_v1_rows_of_numbers_are_read_into_tensors_off_the_event_loop_when_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int, on_the_loop: bool
) -> None:
    """v1 rows were read into arrays, checked and padded on the event loop: a body of 64 MiB of
    numbers (one row of 32 M zeros, refused only once read) held it for seconds, every other
    request and model with it. A large body's rows are read in the pool; one row stays on the
    loop, where the hop would cost more than the reading."""
    from service.core import dataplane

    threads: list[int] = []
    real = dataplane.instance_tensors

    def recorded(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(dataplane, "instance_tensors", recorded)
    running = _serve_digits(tmp_path)
    try:
        loop = running.run(_loop_thread())
        body = orjson.dumps({"instances": [[[[0.0] * 8] * 8]] * rows})  # [1, 8, 8] a row
        reply = running.request(running.serving, "POST", "/v1/models/digits:predict", body)
    finally:
        running.close()
    assert reply.status == 200, reply.body[:300]
    assert len(orjson.loads(reply.body)["predictions"]) == rows
    assert len(threads) == 1 and (threads[0] == loop) is on_the_loop


def test_a_v1_predict_classifies_each_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1 answers from the model's own outputs; the core also made the output tensors other
    protocols answer with, so a classifier's top-k ran twice a row on the event loop (once
    into Triton's classification strings that nothing read). The answer is the same."""
    from service.pipelines.classification import Classifier

    rows: list[int] = []
    real_call = Classifier.__call__

    def counted(self: Classifier, row: Any, top_k: int | None = None) -> Any:
        rows.append(1)
        return real_call(self, row, top_k)

    monkeypatch.setattr(Classifier, "__call__", counted)
    running = _serve_digits(tmp_path)
    try:
        predictions = _predict_pngs(running, 8, 3)
    finally:
        running.close()
    assert all(len(p) == 3 for p in predictions)  # top_k: 3
    assert {"index", "label", "probability"} <= set(predictions[0][0])
    assert len(rows) == 3


def test_a_request_is_counted_and_logged_once_its_answer_is_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On the inference routes the answer goes first: its statistics, metrics and access-log
    line come after (the line's record, queued before the answer, cost a lone image 90–150 µs of
    its way out), and the drain counts the request until then."""
    from tests.server import copy_model

    copy_model("digits", tmp_path / "digits")
    running = InProcess(Settings(model_repository=tmp_path, intra_op_threads=1, access_log=True))
    plane = running.dataplane
    seen: list[tuple[int, int, int]] = []

    def state() -> tuple[int, int, int]:
        stats = plane.repository.ready_model("digits", None)[1].stats
        access = [r for r in caplog.records if r.name == "tensorgate.access"]
        return plane.drain.in_flight, stats.inference_count, len(access)

    def on_send(message: Any) -> None:
        if message["type"] == "http.response.body":
            seen.append(state())

    try:
        with caplog.at_level(logging.INFO, logger="tensorgate.access"):
            before = state()
            _predict_pngs(running, 8, 1, on_send)
            after = state()
    finally:
        running.close()
    assert seen == [(1, before[1], before[2])]  # in flight, not yet counted nor logged
    assert after == (0, before[1] + 1, before[2] + 1)


def test_a_failure_to_count_an_answered_request_is_logged_and_serving_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counting runs after the answer is sent: an error there (a bug of ours) has nobody to be
    answered to, and is logged with its traceback; the next request is served."""
    from service.telemetry.observation import Observer

    def broken(*args: object) -> None:
        raise RuntimeError("counting broke")

    running = _serve_digits(tmp_path)
    monkeypatch.setattr(Observer, "_count", broken)
    try:
        with caplog.at_level(logging.ERROR, logger="tensorgate.app"):
            _predict_pngs(running, 8, 1)
            _predict_pngs(running, 8, 1)
    finally:
        running.close()
    failed = [r for r in caplog.records if "after its answer failed" in r.getMessage()]
    assert len(failed) == 2
    assert failed[0].exc_info is not None and "counting broke" in str(failed[0].exc_info[1])


def _serve_digits(tmp_path: Path) -> InProcess:
    from tests.server import copy_model

    copy_model("digits", tmp_path / "digits")
    return InProcess(Settings(model_repository=tmp_path, intra_op_threads=1, access_log=False))


def _predict_pngs(running: InProcess, side: int, count: int, on_send: Any = None) -> list[Any]:
    """v1 predict of ``count`` grey PNGs of ``side`` × ``side`` pixels to digits: its
    predictions, one a PNG (``on_send``: told each message of the answer as it is sent)."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (side, side), 200).save(buffer, format="PNG")
    item = {"b64": base64.b64encode(buffer.getvalue()).decode()}
    body = orjson.dumps({"instances": [item] * count})
    reply = running.request(
        running.serving, "POST", "/v1/models/digits:predict", body, on_send=on_send
    )
    assert reply.status == 200, reply.body[:300]
    predictions: list[Any] = orjson.loads(reply.body)["predictions"]
    assert len(predictions) == count
    return predictions


async def _loop_thread() -> int:
    return threading.get_ident()


def test_offloaded_work_through_many_bytes_runs_one_at_a_time(tmp_path: Path) -> None:
    """Copies of tens of MiB hold the GIL for their whole length; two at once on the pool took
    it in turns, and every other request's steps on the event loop waited behind both (#28: a
    small REST request under 32 concurrent 60 MiB gRPC calls, up to 1.8 s). Work under
    BULK_BYTES still runs side by side."""
    import asyncio

    from service.core.dataplane import BULK_BYTES, OFFLOAD_BYTES

    write_identity_model(tmp_path / "identity", max_batch_size=8)
    settings = Settings(model_repository=tmp_path, preprocess_threads=2, access_log=False)
    running = InProcess(settings)
    lock = threading.Lock()
    now = [0]
    most = [0]
    both_in = threading.Barrier(2, timeout=30)

    def bulk() -> None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.2)  # long enough for a second one to start beside it, if it may
        with lock:
            now[0] -= 1

    async def run() -> None:
        plane = running.dataplane
        await asyncio.gather(*(plane.offload(BULK_BYTES, bulk) for _ in range(3)))
        # both smaller ones inside at once, or the barrier breaks
        await asyncio.gather(*(plane.offload(OFFLOAD_BYTES, both_in.wait) for _ in range(2)))

    try:
        running.run(run())
    finally:
        running.close()
    assert most[0] == 1


def test_the_loop_bound_reaches_each_scheduler_and_strings_never_run_on_the_loop(
    core: InProcess,
) -> None:
    """TG_INLINE_BATCH_US (200 µs by default) reaches each model's scheduler. The identity
    model takes a BYTES input, whose cost is its strings' and not its shape's: its batches
    are never timed for the loop (every one runs on the instance's thread)."""
    request = InferenceRequest("identity", None, all_inputs(2))
    for _ in range(3):
        infer(core, request)
    [(_, served)] = [
        (v, s) for v, s in core.dataplane.repository.served_versions() if v.name == "identity"
    ]
    scheduler = served.scheduler
    assert scheduler is not None and scheduler.config.inline_run_ns == 200_000
    assert Settings().inline_batch_us == 200
    assert not scheduler._run_times._runs


def write_named_model(folder: Path) -> None:
    """An ONNX model whose outputs are called ``answer`` and ``classification``: names the
    server gives its code's answers and top-k strings, here the model's own."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], [name]) for name in ("answer", "classification")],
        "named",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
        [
            helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 2])
            for name in ("answer", "classification")
        ],
    )
    (folder / "1").mkdir(parents=True)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "1" / "model.onnx")
    (folder / "config.yaml").write_text("backend: onnx\nmax_batch_size: 4\n")


def test_outputs_named_as_the_servers_own_are_the_models_where_it_has_no_code(
    tmp_path: Path,
) -> None:
    """A plain model's output called ``answer`` came back empty by default (and was a 400
    when asked for); one called ``classification`` was a 400 on every request."""
    write_named_model(tmp_path / "named")
    running = InProcess(Settings(model_repository=tmp_path, intra_op_threads=1))
    try:
        data = np.array([[1.0, 2.0]], dtype=np.float32)
        request = InferenceRequest("named", inputs=[InputTensor("x", "FP32", data.shape, data)])
        result = infer(running, request)
        assert [o.name for o in result.outputs] == ["answer", "classification"]
        for output in result.outputs:
            np.testing.assert_array_equal(output.data, data)
        asked = dataclasses.replace(request, outputs=[RequestedOutput("answer")])
        (answer,) = infer(running, asked).outputs
        assert answer.datatype == "FP32"
    finally:
        running.close()


def test_v1_rows_for_a_bytes_input_are_strings_or_b64() -> None:
    """A BYTES input's numbers were a 500 (KeyError: 'BYTES'), its strings a 400."""
    from service.core.validation import instance_tensors
    from service.model_config import TensorConfig

    specs = (
        TensorConfig(name="s", datatype="BYTES", shape=(2,)),
        TensorConfig(name="x", datatype="FP32", shape=(2,)),
    )
    rows = [{"s": ["a", {"b64": "/w=="}], "x": [1, 2]}, {"s": ["é", ""], "x": [3, 4]}]
    strings, numbers = instance_tensors(rows, specs)
    assert strings.data.tolist() == [[b"a", b"\xff"], ["é".encode(), b""]]
    assert numbers.data.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    for bad, says in (
        ([1, 2], "a number is not a string"),
        (["a", {"b64": "!"}], "not valid base64"),
    ):
        with pytest.raises(InvalidInput, match=f"input 's' are not BYTES rows .*{says}"):
            instance_tensors([{"s": bad, "x": [1, 2]}], specs)


def test_v1_takes_one_instance_whole_for_a_model_without_a_batch_dim() -> None:
    """max_batch_size 0 with two inputs could not be called over v1 at all (each object's
    values gained a batch dim the model does not have)."""
    from service.core.validation import instance_tensors
    from service.model_config import TensorConfig

    two = (
        TensorConfig(name="a", datatype="FP32", shape=(3,)),
        TensorConfig(name="b", datatype="FP32", shape=(3,)),
    )
    a, b = instance_tensors([{"a": [1, 2, 3], "b": [1, 1, 1]}], two, batched=False)
    assert (a.shape, b.shape) == ((3,), (3,))
    (one,) = (TensorConfig(name="a", datatype="FP32", shape=(3,)),)
    for rows in ([[1, 2, 3]], [1, 2, 3], [{"a": [1, 2, 3]}]):  # as an instance, or the tensor
        (tensor,) = instance_tensors(rows, (one,), batched=False)
        assert tensor.data.tolist() == [1.0, 2.0, 3.0], rows


@pytest.mark.parametrize("made", [0, 1, 3, 2001])
def test_a_batch_made_by_the_models_code_has_a_row_an_item(made: int) -> None:
    """Fewer rows than items was a 500 from an IndexError at postprocess; 2,001 rows for two
    items ran as some 500 batches, past max_request_rows."""
    from types import SimpleNamespace

    from preprocessing.pipeline import Item, Pipeline
    from service.core.dataplane import _preprocess

    class Batches(Pipeline):
        def __init__(self, rows: int) -> None:
            self.rows = rows

        def preprocess_batch(self, items: Any, contexts: Any) -> dict[str, np.ndarray]:
            return {"x": np.zeros((self.rows, 3), np.float32)}

    stand_in = SimpleNamespace(name="pb", batched=True)  # what _preprocess reads of a model
    model: Any = stand_in
    items = [Item(b"{}"), Item(b"{}")]
    with pytest.raises(ModelExecutionError, match=f"made {{'x': {made}}} rows for 2 items"):
        _preprocess(Batches(made), items, [{}, {}], model)
    assert _preprocess(Batches(2), items, [{}, {}], model)["x"].shape == (2, 3)


def test_a_step_asked_for_a_version_by_number_looks_that_version_up() -> None:
    """``self.models.infer("m", x, version=1)`` was a 500 ('int' object has no attribute
    'isascii')."""
    import asyncio
    from types import SimpleNamespace

    from service.core.steps import Steps

    asked: list[object] = []

    def ready_model(model: str, version: object, whole: bool = True) -> None:
        asked.append(version)
        raise ModelNotFound(f"model '{model}' has no version '{version}'")

    loop = asyncio.new_event_loop()
    try:
        repository: Any = SimpleNamespace(  # all Steps asks of one
            ready_model=ready_model, settings=SimpleNamespace(models=None)
        )
        steps = Steps(repository, loop, 5.0)
        with pytest.raises(  # the code asked for it: its 500, not the client's 404
            ModelExecutionError, match="pipeline step 'm': model 'm' has no version '1'"
        ):
            steps.infer("m", {"x": np.zeros((1, 2), np.float32)}, version=1)  # type: ignore[arg-type]  # an int, as pipeline code may pass
    finally:
        loop.close()
    assert asked == ["1"]


def test_a_step_that_tg_models_leaves_out_says_so(tmp_path: Path) -> None:
    """The pipeline was UNAVAILABLE with "unknown model 'boxer'" while boxer's folder was in
    the repository: TG_MODELS had left it out."""
    import asyncio
    from types import SimpleNamespace

    from service.core.steps import Steps

    def ready_model(model: str, version: object, whole: bool = True) -> None:
        raise ModelNotFound(f"unknown model '{model}'")

    loop = asyncio.new_event_loop()
    try:
        repository: Any = SimpleNamespace(
            ready_model=ready_model,
            settings=SimpleNamespace(models=["inspect"]),
            on_disk=lambda: {"boxer": tmp_path, "inspect": tmp_path},
        )
        steps = Steps(repository, loop, 5.0)
        said = "pipeline step 'boxer': unknown model 'boxer' (it is in the repository, but "
        with pytest.raises(ModelExecutionError, match=re.escape(said) + "TG_MODELS leaves it out"):
            steps.infer("boxer", {"x": np.zeros((1, 2), np.float32)})
        with pytest.raises(ModelExecutionError, match=r"unknown model 'ghost'$"):
            steps.infer("ghost", {"x": np.zeros((1, 2), np.float32)})
    finally:
        loop.close()


@pytest.mark.parametrize("cast", [False, True])
def test_a_steps_dtype_is_the_codes_500_unless_the_step_model_casts(cast: bool) -> None:
    """A step model with cast_inputs takes numpy's default float64 for its FP32 input, as a
    request's tensors are cast; without it, the dtype is the code's mistake (a 500)."""
    from types import SimpleNamespace

    from service.core.steps import _check_names_and_dtypes
    from service.model_config import ModelConfig, TensorConfig
    from service.runtimes.base import Signature

    x = TensorConfig(name="x", datatype="FP32", shape=(2,))
    config = ModelConfig.model_validate({"backend": "onnx", "cast_inputs": cast})
    loaded: Any = SimpleNamespace(name="m", signature=Signature((x,), (x,)), config=config)
    sent = {"x": np.zeros((1, 2))}  # float64
    if cast:
        _check_names_and_dtypes(sent, loaded)
    else:
        with pytest.raises(ModelExecutionError, match="the code sent input 'x' as float64"):
            _check_names_and_dtypes(sent, loaded)
    with pytest.raises(ModelExecutionError, match=r"the code sent inputs \['y'\]"):
        _check_names_and_dtypes({"y": np.zeros((1, 2), np.float32)}, loaded)


def test_a_large_json_answer_is_written_off_the_event_loop_a_binary_one_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """REST's JSON answers were written on the loop whatever their size: 20 M values held
    every other request for 0.64 s."""
    from service.protocol import v2

    write_identity_model(tmp_path / "wide", max_batch_size=2, datatypes=("FP32",), width=16384)
    running = InProcess(Settings(model_repository=tmp_path, intra_op_threads=1))
    threads: list[int] = []
    encode = v2.encode_result

    def recording(*args: Any) -> Any:
        threads.append(threading.get_ident())
        return encode(*args)

    monkeypatch.setattr(v2, "encode_result", recording)
    try:
        loop = running.run(asyncio_ident())
        for binary in (False, True):
            tensor = {"name": "in_FP32", "datatype": "FP32", "shape": [1, 16384]}
            body = orjson.dumps(
                {
                    "inputs": [{**tensor, "data": [0.5] * 16384}],
                    "parameters": {"binary_data_output": binary},
                }
            )
            headers = {"content-length": str(len(body))}
            route = Route("infer", "wide")
            answer = running.run(answer_inference(running.dataplane, route, headers, Body(body)))
            assert answer.status == 200, answer.body[:200]
    finally:
        running.close()
    assert [thread == loop for thread in threads] == [False, True]


async def asyncio_ident() -> int:
    return threading.get_ident()


@pytest.mark.parametrize("answer", [{1, 2}, b"raw", 2**70, (i for i in range(2))])
def test_an_answer_json_cannot_hold_is_the_codes_500_naming_postprocess(answer: Any) -> None:
    """It was logged as the server's own internal error, naming nothing of the model."""
    from types import SimpleNamespace

    from service.core.dataplane import _answer_tensor

    model = SimpleNamespace(name="m")
    with pytest.raises(ModelExecutionError, match=r"model 'm': its pipeline's postprocess\(\)"):
        _answer_tensor(model, [answer])  # type: ignore[arg-type]  # a stand-in: only its name is read


def test_a_step_that_met_an_unwarmed_shape_marks_its_callers_request() -> None:
    """The caller's access-log line said nothing of a step's cold shape (the faces pyramid)."""
    import asyncio
    import contextlib
    from types import SimpleNamespace

    from service.batching.stats import RequestTiming
    from service.core.steps import _run

    async def execute(batch: Any, timing: RequestTiming, deadline: float) -> dict[str, Any]:
        timing.unwarmed = True  # as the scheduler marks a request of an unwarmed batch
        return {"y": batch["x"]}

    served = SimpleNamespace(
        use=contextlib.nullcontext,
        closing=False,
        execute=execute,
        stats=SimpleNamespace(record_success=lambda *_: None, record_failure=lambda *_: None),
        loaded=SimpleNamespace(name="step", batched=True),
    )
    caller = RequestTiming()
    batch = {"x": np.zeros((1, 2), np.float32)}
    outputs = asyncio.run(_run(served, batch, time.monotonic() + 5, caller))  # type: ignore[arg-type]  # a stand-in ServedVersion
    assert outputs is not None and caller.unwarmed


def test_the_access_log_says_which_requests_met_an_unwarmed_shape(
    core: InProcess, caplog: pytest.LogCaptureFixture
) -> None:
    observer = core.dataplane.observer
    observer.access_log = True
    try:
        with caplog.at_level("INFO", logger="tensorgate.access"):
            for unwarmed in (True, False):
                with observer.observe("test", "identity", None) as observation:
                    observation.timing.unwarmed = unwarmed
    finally:
        observer.access_log = False
    marked = [getattr(r, "unwarmed_shape", None) for r in caplog.records]
    assert marked == [True, None]


def test_an_id_a_pipeline_made_out_of_its_inputs_range_is_a_400_before_the_batch() -> None:
    """A model's own code made ids unchecked: an item whose id the model has no row for got
    ONNX Runtime's row counted from the end (-1: item 999's answer, 200), where the same id
    sent as a tensor is a 400, and an AOTInductor kernel reads out of bounds."""
    from service.core.validation import check_made
    from service.model_config import TensorConfig
    from service.runtimes.base import Signature

    spec = TensorConfig(name="item_id", datatype="INT64", shape=(), range=(0, 999))
    signature = Signature(inputs=(spec,), outputs=())
    check_made({"item_id": np.array([0, 999])}, signature, True, "ctr")
    for made, item in (([5, -1], 1), ([1000], 0)):  # which item made it, of several
        with pytest.raises(
            InvalidInput,
            match=r"model 'ctr': the items preprocess to input 'item_id': values must lie "
            rf"within \[0, 999\]; got -?\d+ in item {item} \(1 value outside it\)",
        ):
            check_made({"item_id": np.array(made)}, signature, True, "ctr")


def test_a_step_of_no_rows_answers_outputs_of_no_rows_without_running(core: InProcess) -> None:
    """A detector that found nothing hands its classifier no crops: ``infer`` was a 400
    ("needs at least 1 row"), so pipeline code had to guard every call."""
    from service.core.steps import Steps
    from service.datatypes import TO_NUMPY
    from tests.identity import ONNX_TYPES

    steps = Steps(core.dataplane.repository, core.loop, 5.0)
    (served,) = [s for _, s in core.dataplane.repository.served_versions()]
    before = served.stats.inference_count
    none = steps.infer("identity", {t.name: t.data for t in all_inputs(0)})
    assert {name: (array.shape, array.dtype) for name, array in none.items()} == {
        f"out_{datatype}": ((0, 3), TO_NUMPY[datatype]) for datatype in ONNX_TYPES
    }
    assert served.stats.inference_count == before  # nothing ran
    one = steps.infer("identity", {t.name: t.data for t in all_inputs(1)})
    assert one["out_FP32"].shape == (1, 3)
    assert served.stats.inference_count == before + 1
    wrong = {t.name: t.data for t in all_inputs(0)} | {"in_FP32": np.zeros((0, 4), np.float32)}
    with pytest.raises(InvalidInput, match="pipeline step 'identity': input 'in_FP32'"):
        steps.infer("identity", wrong)  # 0 rows, and still checked


def test_a_bytes_answer_counts_what_its_strings_hold() -> None:
    """A BYTES output's ``nbytes`` is its pointers, 8 an element: 4 strings of 1 MiB were an
    answer of 32 bytes to the budget while it was made."""
    texts = np.array([b"x" * (1 << 20)] * 3 + ["\u00e9" * (1 << 20)], dtype=object)
    floats = np.zeros((2, 5), np.float32)
    result = InferenceResult(
        "m",
        "1",
        None,
        [OutputTensor("text", "BYTES", texts), OutputTensor("score", "FP32", floats)],
        {},
        {},
        None,
        True,
    )
    assert answer_bytes(result) == 4 * (1 << 20) + texts.nbytes + floats.nbytes


def test_a_bad_item_among_several_is_named_and_the_codes_exception_left_as_it_was() -> None:
    """Named by editing the code's own exception in place, an instance the code reuses took
    one more prefix with every request."""
    from preprocessing.pipeline import BadInput, Item, Pipeline

    reused = BadInput("not a record")

    class Records(Pipeline):
        def preprocess(self, item: Item, context: dict[str, object]) -> dict[str, np.ndarray]:
            if item.data == b"bad":
                raise reused
            return {"x": np.zeros(2, np.float32)}

    items = [Item(b"good", None), Item(b"bad", None)]
    for _ in range(2):
        with pytest.raises(BadInput) as refused:
            Records().preprocess_batch(items, [{}, {}])
        assert str(refused.value) == "item at index 1 (of 2): not a record"
    assert str(reused) == "not a record"
