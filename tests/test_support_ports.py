"""The port helpers of tests/support/ports.py: a refused port really refuses, and a
third-party server whose picked port was taken meanwhile is started again on another."""

from __future__ import annotations

import shutil
import socket

import pytest

from tests.support import ports


def test_refused_port_refuses_and_cannot_be_bound_meanwhile():
    with ports.refused_port() as port:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))


def test_start_with_retry_gives_up_after_the_attempts():
    calls = []

    def start():
        calls.append(1)
        raise ports.PortTaken("taken")
    with pytest.raises(ports.PortTaken):
        ports.start_with_retry(start, attempts=3)
    assert len(calls) == 3


@pytest.mark.integration
def test_redis_started_again_when_its_port_was_taken(tmp_path, monkeypatch):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (run scripts/setup.sh --test)")
    from tests.support import synapse_env
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real = ports.pick_port
        monkeypatch.setattr(synapse_env, "pick_port", lambda: next(picks, None) or real())
        server = synapse_env.RedisServer(tmp_path)
        try:
            assert server.port != taken
            assert server.client().ping()
        finally:
            server.stop()
