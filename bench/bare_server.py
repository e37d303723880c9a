"""The thinnest server of a lone W1 image: the in-process pipeline behind a blocking socket.

    .venv/bin/python -m bench.bare_server PORT

One thread, one connection at a time: read a request's head and its ``Content-Length`` body,
then decode, preprocess, ONNX Runtime at batch 1 and top-5, exactly as the in-process side of
:func:`bench.batching.one_image_pairs` does, and answer the top-5 as JSON (any GET is answered
``{}``, for readiness). No framework, no event loop, no hand-off between threads: what serving
a lone image costs at least on this machine (the request's bytes to the server, the server's
wake-up, the answer's way back), against which ``bench.lone`` sets the server's own cost.
Not a server for anything else: no limits, no errors beyond closing the connection.
"""

from __future__ import annotations

import re
import socket
import sys

import orjson

from bench.batching import in_process, top5
from service.resources import available_cpus

_LENGTH = re.compile(rb"(?im)^content-length:\s*(\d+)")


def serve(port: int) -> None:
    pipeline, runtime = in_process(available_cpus())
    classifier = top5()
    with socket.create_server(("127.0.0.1", port)) as listener:
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                pending = b""
                while True:
                    request, pending = _read_request(conn, pending)
                    if request is None:
                        break
                    method, body = request
                    answer = b"{}"
                    if method == b"POST":
                        outputs = runtime.run({"input": pipeline(body)[None]})
                        answer = orjson.dumps(classifier({"logits": outputs["logits"][0]}))
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
                    )


def _read_request(conn: socket.socket, data: bytes) -> tuple[tuple[bytes, bytes] | None, bytes]:
    """The next request's method and body on ``conn`` (None once the client closes), and what
    came after it."""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, _, data = data.partition(b"\r\n\r\n")
    length = _LENGTH.search(head)
    size = int(length[1]) if length is not None else 0
    while len(data) < size:
        chunk = conn.recv(max(65536, size - len(data)))
        if not chunk:
            return None, b""
        data += chunk
    return (head.split(b" ", 1)[0], data[:size]), data[size:]


if __name__ == "__main__":
    serve(int(sys.argv[1]))
