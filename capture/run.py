"""How a `stream` or `capture` run goes and ends, the same for DCP and Synapse: the common
counters of its summary (RunStats), the signals that end it cleanly (StopSignals), the
event loop that runs a transport until it ends, a duration passes or a signal comes
(run_until_stopped), and the --vbuckets and unserved-vbucket checks.

Every summary has the common fields (COMMON_FIELDS) counted over this run only: the
messages the command received and sent (for `stream`: the rows it printed), their bytes on
the wire, the connections it opened, and why it stopped. Protocol-specific fields are added
after them, never instead of them.

SIGINT (Ctrl-C), SIGTERM and SIGHUP all end a run the same way: streams closed, files
finished, summary printed; then the exit code is 130 for SIGINT and 128 + the signal number
for the others (143 SIGTERM, 129 SIGHUP). Our handler is installed even when the parent
left SIGINT ignored (a script's `dcptool capture ... &`).
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Awaitable, Callable, Literal

from dcptool.protocol.errors import (
    ConnectionLost,
    Interrupted,
    LateUsageError,
    one_line,
)
from dcptool.protocol.text import ranges_text
from dcptool.replay.timestamps import iso_ns

# why a run stopped
MAX_MESSAGES = "max-messages"   # --max-messages reached
DURATION = "duration"           # --duration passed
TO = "to"                       # DCP: every stream reached its --to seqno
END = "end"                     # DCP: the server ended every stream (e.g. with --to forever)
INTERRUPTED = "interrupted"     # SIGINT (Ctrl-C)
SIGNAL = "signal"               # SIGTERM or SIGHUP
ERROR = "error"                 # an error ended the run (the exit code says which)

COMMON_FIELDS = ("protocol", "source", "started_at", "ended_at", "seconds", "stopped", "signal",
                 "error", "messages_in", "messages_out", "bytes_in", "bytes_out", "connections")

STOP_SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGHUP"))
                     if s is not None)

GRACE = 1.0   # seconds a stop request may take (closing streams) before the run is cancelled: a
# signal ends the command within 2 s (CLI.md)


class RunStats:
    """The common counters of one run. `stop(reason)` keeps the first reason given."""

    def __init__(self, protocol: str, source: str):
        self.protocol = protocol
        self.source = source
        self.started_ns = time.time_ns()
        self._t0 = time.monotonic()
        self.messages_in = 0
        self.messages_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.connections = 0
        self.stopped: str | None = None
        self.signum: int | None = None

    def stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason

    def summary(self, error: BaseException | None = None, default: str = END) -> dict:
        """The common fields, in COMMON_FIELDS order."""
        stopped = self.stopped or default
        if isinstance(error, (Interrupted, KeyboardInterrupt)):
            signum = getattr(error, "signum", signal.SIGINT)
            self.signum = self.signum or signum
            stopped = INTERRUPTED if signum == signal.SIGINT else SIGNAL
            error = None
        elif error is not None:
            stopped = ERROR
        elif self.signum is not None:
            stopped = INTERRUPTED if self.signum == signal.SIGINT else SIGNAL
        ended = time.time_ns()
        return {
            "protocol": self.protocol,
            "source": self.source,
            "started_at": iso_ns(self.started_ns),
            "ended_at": iso_ns(ended),
            "seconds": round(time.monotonic() - self._t0, 3),
            "stopped": stopped,
            "signal": signal.Signals(self.signum).name if self.signum else None,
            "error": one_line(error) if error is not None else None,
            "messages_in": self.messages_in,
            "messages_out": self.messages_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "connections": self.connections,
        }


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP, from start to finish of a run, call `on_signal(signum)`
    callbacks instead of killing the process. Use as a context manager around the whole run;
    `attach(loop)` routes them through the event loop while it runs (so a blocked select
    wakes up), `detach(loop)` hands them back to the plain handler for the finishing phase
    (closing files), during which a second signal is only recorded."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.callbacks: list = []
        self._saved: dict = {}

    def __enter__(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            try:
                # installed whatever the inherited disposition is, SIG_IGN included
                self._saved[sig] = signal.signal(sig, self._handler)
            except (ValueError, OSError):   # not the main thread: signals stay as they are
                pass
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        for sig, old in self._saved.items():
            try:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):
                pass
        return False

    def _handler(self, signum, _frame) -> None:
        self.fire(signum)

    def fire(self, signum: int) -> None:
        if self.signum is None:
            self.signum = int(signum)
        for cb in list(self.callbacks):
            cb(int(signum))

    def attach(self, loop) -> None:
        for sig in self._saved:
            try:
                loop.add_signal_handler(sig, self.fire, sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass

    def detach(self, loop) -> None:
        for sig in self._saved:
            try:
                loop.remove_signal_handler(sig)
                signal.signal(sig, self._handler)   # remove_signal_handler restored the default
            except (NotImplementedError, RuntimeError, ValueError, OSError):
                pass

    def interrupted(self) -> Interrupted | None:
        return Interrupted(self.signum) if self.signum is not None else None


def stop_reason_for_signal(signum: int) -> str:
    return INTERRUPTED if signum == signal.SIGINT else SIGNAL


def run_until_stopped(start: Callable[[], Awaitable], request_stop: Callable[[str], None], stats: RunStats, *,
                      duration: float | None = None, signals: StopSignals | None = None,
                      when_cancelled: Callable[[], object] = lambda: None,
                      on_attach: Callable[[], None] | None = None):
    """Run the coroutine `start()` on a fresh event loop until it ends, `duration` passes,
    or a signal (SIGINT, SIGTERM, SIGHUP through `signals`) asks it to stop. A stop calls
    `request_stop(reason)` (close the streams cleanly); a run still connecting or backing
    off GRACE seconds later is cancelled, and `when_cancelled()` is returned. Returns what
    the coroutine returned; the stop reason is in `stats`. `on_attach()` runs once the signals
    are routed through the loop (the CLI lets a blocked write of stdout see them too)."""

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(start())
        cancelled_by_us = []

        def stop(reason: str) -> None:
            request_stop(reason)

            def hard_stop():   # still connecting or backing off: nothing to close cleanly
                if not task.done():
                    cancelled_by_us.append(True)
                    task.cancel()
            loop.call_later(GRACE, hard_stop)

        def on_signal(signum: int) -> None:
            stats.signum = stats.signum or signum
            loop.call_soon_threadsafe(stop, stop_reason_for_signal(signum))

        if signals is not None:
            signals.attach(loop)
            if on_attach is not None:
                on_attach()
            signals.callbacks.append(on_signal)
            if signals.signum is not None:       # came before the loop ran
                on_signal(signals.signum)
        if duration:
            loop.call_later(duration, stop, DURATION)
        try:
            return await task
        except asyncio.CancelledError:
            if cancelled_by_us:
                return when_cancelled()
            raise
        finally:
            if signals is not None:
                signals.callbacks.remove(on_signal)
                signals.detach(loop)

    return asyncio.run(main())


class NoProgress:
    """The progress of a capture nobody watches: every call is a no-op (the CLI's live
    display, cli/view/progress.py, has the same methods)."""

    def update(self, **_kw) -> None:
        pass

    def add(self, frames: int = 0, wire_bytes: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- --vbuckets check

def server_vbucket_count(known: list[int] | tuple) -> int:
    """The number of vbuckets of the bucket from the vbuckets one node reports: its highest
    vbucket + 1, rounded up to a power of two (Couchbase buckets have 64, 128 or 1024; a node
    of a cluster need not hold the last one)."""
    n = max(known) + 1
    return 1 << (n - 1).bit_length()


def check_vbuckets(requested: list[int] | None, known) -> None:
    """Raise LateUsageError when --vbuckets names vbuckets the bucket does not have."""
    if not requested or not known:
        return
    count = server_vbucket_count(known)
    bad = [vb for vb in requested if vb >= count]
    if bad:
        raise LateUsageError(f"--vbuckets: {ranges_text(bad)} out of range; the bucket has vbuckets "
                             f"0-{count - 1}")


def unserved_text(unserved: dict[int, str]) -> str:
    """'0-3: reason; 7: other reason' (vbuckets grouped by reason)."""
    by: dict[str, list[int]] = {}
    for vb, why in sorted(unserved.items()):
        by.setdefault(why, []).append(vb)
    return "; ".join(f"{ranges_text(vbs)}: {why}" for why, vbs in by.items())


def unserved_fields(unserved: dict[int, str]) -> dict:
    """The summary fields of a cluster run's unserved vbuckets (none when all were served)."""
    if not unserved:
        return {}
    return {"unserved_vbuckets": len(unserved), "unserved": unserved_text(unserved)}


def unserved_error(unserved: dict[int, str]) -> ConnectionLost:
    """Exit 1 with one line naming the vbuckets a cluster run could not serve, and why."""
    return ConnectionLost(f"{len(unserved)} vbucket(s) could not be served: {unserved_text(unserved)}")
