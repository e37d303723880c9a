"""The integration tests' server helper: the ports it picks."""

from __future__ import annotations

import pytest

from tests.server import free_port

pytestmark = pytest.mark.unit


def test_free_port_never_gives_one_port_twice() -> None:
    # A server takes two (HTTP, gRPC); the kernel gives a port it just freed out again, and one
    # CI run's server bound its gRPC listener on its own HTTP port.
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
