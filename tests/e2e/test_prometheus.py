"""The dashboard and the alert rules against a real Prometheus scraping a real server.

Debian's ``prometheus`` (installed by ``make test``: the Makefile's ``prometheus-tools``)
scrapes a ``tensorgate serve`` on 127.0.0.1 every second, with deploy/prometheus/rules.yaml
loaded, while a short known load runs (successes over v2, v1 and gRPC, batches, 400s and
404s). Then every expression the dashboard's panels and the rules use is asked of Prometheus's
HTTP API and must return data carrying the labels its panel's legend names: a renamed metric or
label breaks this test, not the dashboard an on-call person opens. Every rule must evaluate
without error, and no alert fires on the healthy server.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image

from tests.server import REPO_ROOT, Server, free_port

pytestmark = pytest.mark.e2e

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "tensorgate.json"
RULES = REPO_ROOT / "deploy" / "prometheus" / "rules.yaml"
DIGIT = {
    "inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.5] * 64}]
}
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "${__rate_interval}": "1m",
    "$__interval": "15s",
    "${__interval}": "15s",
    "$__range": "5m",
    "${__range}": "5m",
    "${model:regex}": ".*",
    "${model}": ".*",
    "$model": ".*",
}
"""What Grafana puts in for its variables: the model selector at "All"."""
GPU_ONLY = "tensorgate_gpu_"
"""Series that exist only on a GPU: their panels are empty here, and must be."""
COMPARISON = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*-?[0-9.]+(e[+-]?[0-9]+)?\s*$")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, expression as Grafana sends it, legend format) for every target."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if expr:
                queries.append((panel["title"], grafana(expr), target.get("legendFormat", "")))
    return queries


def grafana(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


class Prometheus:
    """``prometheus`` on 127.0.0.1, scraping ``target`` every second, the rules loaded."""

    def __init__(self, target: str, folder: Path) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: `make test` installs it (prometheus-tools)"
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "tensorgate", "static_configs": [{"targets": [target]}]}
            ],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = folder / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={folder / 'prometheus.yml'}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

    def wait_for(self, condition: Any, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                if condition():
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{what} within {timeout} s:\n{self.log.read_text()[-3000:]}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = self.client.get("/api/v1/query", params={"query": expr}).json()
        assert answer["status"] == "success", (expr, answer)
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8), 128, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _load(server: Server) -> int:
    """A short known load; returns how many inference requests it sent."""
    sent = 0
    client = server.client
    png = _png()
    for _ in range(40):
        assert client.post("/v2/models/digits/infer", json=DIGIT).status_code == 200
        assert (
            client.post(
                "/v1/models/digits:predict", content=png, headers={"content-type": "image/png"}
            ).status_code
            == 200
        )
        sent += 2
    for _ in range(10):
        bad = {"inputs": [{**DIGIT["inputs"][0], "data": [1.0]}]}
        assert client.post("/v2/models/digits/infer", json=bad).status_code == 400
        assert client.post("/v2/models/nosuchmodel/infer", json=DIGIT).status_code == 404
        sent += 2

    def one(_: int) -> int:
        with httpx.Client(base_url=server.url, timeout=30) as own:
            return own.post("/v2/models/digits/infer", json=DIGIT).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # concurrent: batches of several
        assert set(pool.map(one, range(160))) == {200}
    sent += 160
    import tritonclient.grpc as tgrpc

    grpc = tgrpc.InferenceServerClient(server.grpc_url)
    tensor = tgrpc.InferInput("image", [1, 1, 8, 8], "FP32")
    tensor.set_data_from_numpy(np.full((1, 1, 8, 8), 0.5, np.float32))
    for _ in range(20):
        grpc.infer("digits", [tensor])
        sent += 1
    grpc.close()
    return sent


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A Prometheus that has scraped the server through the whole load and after it."""
    from tests.server import copy_model

    folder = tmp_path_factory.mktemp("prometheus")
    repository = folder / "models"
    copy_model("digits", repository / "digits")
    server = Server(repository, log_path=folder / "server.log")
    prometheus = None
    try:
        server.wait_until()
        prometheus = Prometheus(f"127.0.0.1:{server.port}", folder)
        prometheus.wait_for(
            lambda: prometheus.client.get("/-/ready").status_code == 200, "Prometheus ready"
        )
        prometheus.wait_for(
            lambda: prometheus.query('up{job="tensorgate"} == 1'), "the server scraped"
        )
        sent = _load(server)

        def seen_all() -> bool:
            total = prometheus.query("sum(tensorgate_requests_total)")
            return bool(total) and float(total[0]["value"][1]) >= sent

        prometheus.wait_for(seen_all, f"the {sent} requests scraped")

        # and two more scrapes after it, so that every rate() window holds the load's end
        def scrapes() -> float:
            counted = prometheus.query('count_over_time(up{job="tensorgate"}[1h])')
            return float(counted[0]["value"][1]) if counted else 0.0

        before = scrapes()
        prometheus.wait_for(lambda: scrapes() >= before + 2, "two more scrapes")
        yield prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        server.stop()


def test_every_dashboard_expression_returns_data_with_its_legend_labels(
    scraped: Prometheus,
) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 15, "the dashboard has its panels"
    empty, unlabelled = [], []
    for title, expr, legend in queries:
        result = scraped.query(expr)
        if GPU_ONLY in expr:
            assert result == [], f"{title}: no GPU here, yet {expr} returned {result}"
            continue
        if not result:
            empty.append(f"{title}: {expr}")
            continue
        wanted = set(LEGEND_LABEL.findall(legend))
        for series in result:
            missing = wanted - set(series["metric"])
            if missing:
                unlabelled.append(f"{title}: {expr} lacks {sorted(missing)} for {legend!r}")
                break
    assert not empty, "panels with no data:\n" + "\n".join(empty)
    assert not unlabelled, "\n".join(unlabelled)


def test_every_rule_evaluates_and_each_alert_measures_something(scraped: Prometheus) -> None:
    def evaluated() -> bool:
        groups = scraped.client.get("/api/v1/rules").json()["data"]["groups"]
        return all(
            rule.get("lastEvaluation", "").startswith("2") for g in groups for rule in g["rules"]
        )

    scraped.wait_for(evaluated, "every rule evaluated once")
    groups = scraped.client.get("/api/v1/rules").json()["data"]["groups"]
    loaded = [rule for group in groups for rule in group["rules"]]
    assert len(loaded) == len(rules())
    for rule in loaded:
        assert rule["health"] == "ok", rule
    for rule in rules():
        if "record" in rule:
            assert scraped.query(rule["record"]), f"recording rule {rule['record']} has no data"
            continue
        quantity = COMPARISON.sub("", rule["expr"].strip())
        assert quantity != rule["expr"].strip(), (
            f"alert {rule['alert']}: its expr must end in `<op> <number>`"
        )
        if GPU_ONLY in quantity:
            continue
        assert scraped.query(quantity), f"alert {rule['alert']} measures nothing: {quantity}"
    firing = [rule["name"] for rule in loaded if rule.get("state") == "firing"]
    assert firing == [], f"alerts firing on a healthy server: {firing}"
