"""Soak: 100,000 requests mixed across the bundled models and both protocols; RSS must stay flat.

    .venv/bin/python -m bench.soak [--requests 100000] [--max-seconds 600]

wrk rotates through prepared requests (digits v2 JSON, digits v1 PNG, minilm v1 text, minilm
v2 BYTES, efficientnet v1 JPEG, 1 in 20) on 8 connections, in rounds, until the request count
or the time bound is reached. The server's RSS is read from /proc after warm-up, and after
the rounds that pass 10k and 100k requests. Writes bench/results/soak.md.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tempfile
import time
from pathlib import Path

import orjson
import skimage.data
from PIL import Image

from bench.common import parse_wrk, publish, require_wrk, table
from tests.server import MODELS, Server

LUA = """
local paths, bodies, types = {}, {}, {}
local n = 0
for line in io.lines(os.getenv("TG_SOAK_PLAN")) do
  local path, file, ctype = line:match("(%S+) (%S+) (%S+)")
  local f = io.open(file, "rb"); local body = f:read("*all"); f:close()
  n = n + 1
  paths[n] = path; bodies[n] = body; types[n] = ctype
end
local i = 0
request = function()
  i = i + 1
  local k = (i % n) + 1
  return wrk.format("POST", paths[k], {["Content-Type"] = types[k]}, bodies[k])
end
"""


def plan(folder: Path) -> Path:
    def write(name: str, data: bytes) -> Path:
        path = folder / name
        path.write_bytes(data)
        return path

    png, jpeg = io.BytesIO(), io.BytesIO()
    Image.new("L", (8, 8), 100).save(png, format="PNG")
    Image.fromarray(skimage.data.coffee()).save(jpeg, format="JPEG")
    digits = orjson.dumps(
        {
            "inputs": [
                {"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.3] * 64}
            ]
        }
    )
    text_v1 = orjson.dumps({"instances": ["a soak test sends many small requests"]})
    text_v2 = orjson.dumps(
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello soak"]}]}
    )
    entries = [
        ("/v2/models/digits/infer", write("digits.json", digits), "application/json"),
        ("/v1/models/digits:predict", write("digit.png", png.getvalue()), "image/png"),
        ("/v1/models/minilm:predict", write("text_v1.json", text_v1), "application/json"),
        ("/v2/models/minilm/infer", write("text_v2.json", text_v2), "application/json"),
    ] * 5
    entries.append(
        (
            "/v1/models/efficientnet_lite0:predict",
            write("coffee.jpg", jpeg.getvalue()),
            "image/jpeg",
        )
    )
    path = folder / "plan.txt"
    path.write_text("".join(f"{p} {f} {t}\n" for p, f, t in entries))
    return path


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--max-seconds", type=int, default=600)
    parser.add_argument("--round-seconds", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "soak.lua").write_text(LUA)
        plan_path = plan(folder)
        server = Server(MODELS, env={"TG_ACCESS_LOG": "false", "TG_LOG_LEVEL": "warning"})
        rows: list[list[str]] = []
        try:
            server.wait_until(timeout=300)
            pid = server.process.pid
            env = {"TG_SOAK_PLAN": str(plan_path), "PATH": "/usr/bin:/bin"}

            def round_(seconds: int) -> tuple[int, int]:
                out = subprocess.run(
                    [
                        require_wrk(),
                        "-t1",
                        "-c8",
                        f"-d{seconds}s",
                        "--timeout",
                        "30s",
                        "-s",
                        str(folder / "soak.lua"),
                        server.url,
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=seconds + 60,
                ).stdout
                result = parse_wrk(out)
                return result.requests, result.errors

            warm, errors = round_(3)
            total = warm
            rows.append(["after warm-up", str(total), f"{rss_mb(pid):.1f}", str(errors)])
            base = rss_mb(pid)
            started = time.monotonic()
            marks = [10_000, args.requests]
            while marks and time.monotonic() - started < args.max_seconds:
                done, failed = round_(args.round_seconds)
                total += done
                errors += failed
                while marks and total >= marks[0]:
                    rows.append(
                        [f"≥ {marks.pop(0):,}", str(total), f"{rss_mb(pid):.1f}", str(errors)]
                    )
            final = rss_mb(pid)
            elapsed = time.monotonic() - started
        finally:
            server.stop()
    growth = (final - base) / base * 100
    text = (
        "\n".join(
            [
                "# Soak: mixed models and protocols",
                "",
                table(rows, ["point", "requests", "RSS MB", "errors (non-2xx + socket)"]),
                "",
                f"{total:,} requests in {elapsed:.0f} s after warm-up; RSS growth from warm-up to the end: "
                f"{growth:+.1f} % (target within 5 %).",
            ]
        )
        + "\n"
    )
    publish("soak", text)


if __name__ == "__main__":
    main()
