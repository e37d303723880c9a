"""An endpoint that does nothing, on the same stack as tensorgate: the framework's own ceiling.

    python bench/noop_server.py PORT

POST /noop reads the whole body and answers ``{}``, through FastAPI + uvicorn with the same loop
and HTTP parser choices as ``tensorgate serve``.
"""

from __future__ import annotations

import sys

import uvicorn
from fastapi import FastAPI, Request, Response

app = FastAPI()


@app.post("/noop")
async def noop(request: Request) -> Response:
    await request.body()
    return Response(b"{}", media_type="application/json")


if __name__ == "__main__":
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        access_log=False,
        loop="auto",
        http="auto",
    )
