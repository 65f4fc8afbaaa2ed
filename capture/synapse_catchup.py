"""`capture --catch-up INSTANCE=URL`: fetch the rows a Synapse capture missed from the
stream's writer, as Synapse's own workers do (protocol/synapse/catchup.py says how), and record
them in the capture beside the live lines.

A POSITION that shows a gap (after a connect, a reconnect or a resume) queues one fetch of
(committed, new_token] for its (stream, instance); one worker task runs the fetches in order,
page by page, next to the live traffic. Each page is recorded as it arrives: the request target
going out (direction `out`, never the secret), then the rows as RDATA lines and the range they
cover as a POSITION line, direction `catch-up` (CAPTURE_FORMAT.md). A writer that cannot be
reached or answers badly: one warning line, the gap stays as the capture recorded it, and the
capture goes on.
"""

from __future__ import annotations

import asyncio
import os
from typing import Awaitable, Callable

from dcptool.protocol.errors import RemoteError
from dcptool.protocol.synapse import catchup
from dcptool.protocol.synapse.client import Gap
from dcptool.protocol.transport import synapse_http

CATCH_UP = "catch-up"        # the direction of the lines a catch-up fetched
CHANNEL = "catch-up"         # their channel column
DRAIN_SECONDS = 15.0         # at the end of a run, how long queued fetches may still take
SECRET_ENV = "DCPTOOL_REPLICATION_SECRET"

Record = Callable[[str, list[str], str], None]    # (direction, lines, node)


def parse_endpoints(values: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`INSTANCE=URL` values into {instance: url}; ValueError with the one-line reason."""
    out: dict[str, str] = {}
    for v in values:
        name, sep, url = v.partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not name or not url:
            raise ValueError(f"--catch-up {v!r}: expected INSTANCE=URL, e.g. master=http://127.0.0.1:9093")
        if not catchup.valid_name(name):
            raise ValueError(f"--catch-up {v!r}: {name!r} is not a Synapse instance name")
        try:
            synapse_http.split_base(url)
        except ValueError as exc:
            raise ValueError(f"--catch-up {v!r}: {exc}") from None
        if name in out:
            raise ValueError(f"--catch-up names instance {name!r} twice")
        out[name] = url.rstrip("/")
    return out


def settings_of(values: tuple[str, ...] | list[str], protocol: str) -> dict[str, object]:
    """CaptureSettings fields of --catch-up values, with the secret from the environment."""
    if not values:
        return {}
    if protocol != "synapse":
        raise ValueError("--catch-up is for Synapse sources (synapse://, synapse+redis://)")
    return {"catch_up": tuple(parse_endpoints(values).items()),
            "catch_up_secret": os.environ.get(SECRET_ENV) or None}


def node_of(url: str) -> str:
    host, _, port, _ = synapse_http.split_base(url)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class CatchUp:
    """The queued fetches of one capture run and what became of them."""

    def __init__(self, endpoints: dict[str, str], secret: str | None, record: Record,
                 warn: Callable[[str], None], *, timeout: float = 30.0):
        self.endpoints = endpoints
        self.secret = secret
        self.record = record
        self.warn = warn
        self.timeout = timeout
        self.rows = 0            # rows fetched
        self.pages = 0
        self.filled = 0          # gaps fetched whole
        self.failed: list[dict[str, object]] = []   # gaps that stay: stream, instance, from, to, why
        self._queue: asyncio.Queue[catchup.Fetch] | None = None
        self._busy: catchup.Fetch | None = None    # the fetch under way
        self._txn = 0
        self._warned: set[str] = set()

    def gap(self, gap: Gap) -> None:
        """A gap the client saw: queue its fetch (called on the event loop's thread)."""
        if gap.kind != "missed":
            return        # the writer went back (a restart): nothing was missed
        fetch = catchup.fetch_for(gap.stream, gap.instance, gap.committed, gap.new_token)
        if fetch is None:
            return
        if gap.instance not in self.endpoints:
            self._fail(fetch, f"no --catch-up URL for instance {gap.instance!r}", once=gap.instance)
            return
        if self._queue is None:
            self._queue = asyncio.Queue()
        self._queue.put_nowait(fetch)

    async def around(self, run: Awaitable[object], hurry: Callable[[], bool]) -> object:
        """Run the transport coroutine `run` with the fetch worker beside it; when it ends,
        queued fetches get DRAIN_SECONDS more, unless `hurry()` (a signal) says stop now."""
        if self._queue is None:
            self._queue = asyncio.Queue()
        worker = asyncio.ensure_future(self._work())
        try:
            return await run
        finally:
            if not hurry():
                try:
                    await asyncio.wait_for(self._drained(), DRAIN_SECONDS)
                except asyncio.TimeoutError:
                    pass
            worker.cancel()
            try:
                await worker
            except asyncio.CancelledError:
                pass
            if self._busy is not None:
                self._fail(self._busy, "the capture ended before it was fetched whole")
                self._busy = None
            while self._queue.qsize():
                fetch = self._queue.get_nowait()
                self._fail(fetch, "the capture ended before it was fetched")

    async def _drained(self) -> None:
        assert self._queue is not None
        await self._queue.join()        # every queued fetch taken and done (task_done)

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            fetch = await self._queue.get()
            self._busy = fetch
            await self._fetch(fetch)
            self._busy = None
            self._queue.task_done()

    async def _fetch(self, fetch: catchup.Fetch) -> None:
        url = self.endpoints[fetch.instance]
        node = node_of(url)
        while not fetch.done:
            self._txn += 1
            target = fetch.target(f"dcptool{os.getpid()}n{self._txn}")
            self.record("out", [f"GET {target}"], node)
            try:
                body = await synapse_http.get(url, target, self.secret, timeout=self.timeout)
                before = fetch.rows
                lines = fetch.answered(body)
            except RemoteError as exc:
                self._fail(fetch, f"{url}: {exc.message}")
                return
            self.record(CATCH_UP, lines, node)
            self.pages += 1
            self.rows += fetch.rows - before
        self.filled += 1

    def _fail(self, fetch: catchup.Fetch, why: str, once: str | None = None) -> None:
        self.failed.append({"stream": fetch.stream, "instance": fetch.instance,
                            "from_token": fetch.from_token, "to_token": fetch.upto_token, "why": why})
        if once is not None:
            if once in self._warned:
                return
            self._warned.add(once)
        self.warn(f"catch-up of {fetch.stream}/{fetch.instance} after {fetch.from_token} up to "
                  f"{fetch.upto_token} failed: {why}; the gap stays recorded")

    def summary(self) -> dict[str, object]:
        return {"caught_up_rows": self.rows, "caught_up_pages": self.pages,
                "gaps_filled": self.filled, "catch_up_failed": self.failed}
