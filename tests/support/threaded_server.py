"""A ProducerServer (protocol/transport/dcp_server.py) on its own event loop in a daemon
thread: the built-in producer for tests and benchmarks."""

from __future__ import annotations

import asyncio
import ssl
import threading

from dcptool.protocol.dcp.server.producer import ServerModel
from dcptool.protocol.transport.dcp_server import ProducerServer


class ThreadedServer:
    """A ProducerServer on its own event loop in a daemon thread (tests, benchmarks)."""

    def __init__(self, model: ServerModel, host: str = "127.0.0.1", port: int = 0, rate: float = 0.0,
                 tls: ssl.SSLContext | None = None):
        self.server = ProducerServer(model, rate)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(host, port, tls), daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"producer did not start: {self._error}")
        self.host, self.port = self.server.address
        self.addresses = list(self.server.addresses)

    def _run(self, host, port, tls) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start(host, port, tls))
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.close()

    async def _shutdown(self) -> None:
        await self.server.close()
        await asyncio.sleep(0)
        # a connection accepted or dropped while closing left a writer behind: end it here,
        # not as "Task was destroyed but it is pending" when the loop closes
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        if rest:
            await asyncio.gather(*rest, return_exceptions=True)
        self.loop.stop()

    def stop(self) -> None:
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        self._thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
