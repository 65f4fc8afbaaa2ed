"""Hostile Synapse replication peers for the tests, on 127.0.0.1 only.

``HostileTcp(script)``: a TCP line-protocol server. Each connection gets the scripted bytes
in one write (so the lines reach the client in one receive batch, as a burst from a real
server would), then the connection is held open until the client leaves or the server is
stopped (``close_after=True`` closes it right away instead). Whatever the client sends is
kept in ``received``.

``RedisPublisher(redis_port, server_name, script)``: waits for the client's `REPLICATE`
on the `server_name` channel of a real redis-server (tests/support/synapse_env.py starts one), then
publishes each scripted line as one message.

Both run on daemon threads with bounded waits and stop by themselves."""

from __future__ import annotations

import socket
import threading
import time


class HostileTcp:
    def __init__(self, script: bytes, *, close_after: bool = False, max_connections: int = 8):
        self.script = script
        self.close_after = close_after
        self.max_connections = max_connections
        self.received = bytearray()
        self.connections = 0
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(4)
        self._sock.settimeout(0.1)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"synapse://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        deadline = time.monotonic() + 120  # never outlive a test run
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.connections += 1
            if self.connections > self.max_connections:
                conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(0.1)
        try:
            conn.sendall(self.script)
            if self.close_after:
                return
            deadline = time.monotonic() + 60
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    data = conn.recv(65536)
                except socket.timeout:
                    continue
                if not data:
                    return
                self.received += data
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(5)


class RedisPublisher:
    def __init__(self, redis_port: int, server_name: str, script: list[bytes],
                 timeout: float = 30.0):
        import redis
        self.script = script
        self.server_name = server_name
        self.published = 0
        self._r = redis.Redis(host="127.0.0.1", port=redis_port, socket_timeout=10)
        self._sub = self._r.pubsub()
        self._sub.subscribe(server_name)
        assert self._sub.get_message(timeout=10)["type"] == "subscribe"
        self._timeout = timeout
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            msg = self._sub.get_message(timeout=0.2)
            if msg and msg["type"] == "message" and msg["data"].startswith(b"REPLICATE"):
                break
        else:
            return
        for line in self.script:
            self._r.publish(self.server_name, line)
            self.published += 1

    def stop(self) -> None:
        self._thread.join(self._timeout)
        self._sub.close()
        self._r.close()


def lines(*items: bytes | str) -> bytes:
    """Lines joined with newlines (and a final one)."""
    return b"".join((i.encode() if isinstance(i, str) else i) + b"\n" for i in items)
