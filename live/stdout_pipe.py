"""Standard output that may not drain, without the CLI: a run's rows go to a pipe through a
non-blocking descriptor of their own (private_pipe_fd, write_pipe), so a reader that stops
reading holds the run up, but a stop signal (noted by note_stop_signals' handlers) or the end
of --duration (run_deadline) still ends it: Interrupted or OutputStalled once the reader took
nothing for OUTPUT_GRACE seconds. cli/view/output.py's Sink writes through it."""

from __future__ import annotations

import os
import select
import signal
import stat
import time

from dcptool.protocol.errors import DcptoolError, Interrupted

OUTPUT_GRACE = 1.0   # seconds output may stay blocked once the run is asked to stop


class _StopState:
    """What the stdout writer of a run (Sink) knows about its end: a stop signal (noted by the
    handlers of note_stop_signals, at the moment it came) and the --duration deadline. A
    write the reader does not take is abandoned OUTPUT_GRACE seconds after either."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.signal_at: float | None = None
        self.deadline: float | None = None

    def limit(self) -> float | None:
        times = [t for t in (self.signal_at, self.deadline) if t is not None]
        return min(times) + OUTPUT_GRACE if times else None


STOP = _StopState()


def run_deadline(seconds: float | None) -> None:
    """A run starts; it ends `seconds` from now (--duration, None: no limit): a write blocked
    past that is abandoned."""
    STOP.signum = STOP.signal_at = None
    STOP.deadline = time.monotonic() + seconds if seconds else None


def note_signal(signum: int) -> None:
    if STOP.signum is None:
        STOP.signum, STOP.signal_at = int(signum), time.monotonic()


def note_stop_signals() -> None:
    """Have the current Python-level handlers of SIGINT, SIGTERM and SIGHUP also note the
    signal for the stdout writer (call it after asyncio's add_signal_handler: its handler only
    wakes the event loop, which cannot run while a write waits for the reader)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        old = signal.getsignal(sig)
        if getattr(old, "_notes_stop", False):
            continue

        def handler(signum, frame, old=old):
            note_signal(signum)
            if callable(old):
                old(signum, frame)
        setattr(handler, "_notes_stop", True)   # a function attribute mypy has no slot for: the mark looked for above
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):   # not the main thread
            return


class OutputStalled(DcptoolError):
    """The run ended (--duration) but stdout's reader took nothing for OUTPUT_GRACE seconds."""


def private_pipe_fd(out) -> int | None:
    """A non-blocking descriptor of our own on the pipe `out` writes to (opened anew through
    /proc, so the O_NONBLOCK flag is not shared with the other processes of the pipe), or
    None when `out` is no pipe (files never block; a terminal is a person)."""
    try:
        fd = out.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError, AttributeError):
        return None


def write_pipe(fd: int, data) -> None:
    """All of `data` to non-blocking `fd`, waiting for the reader as long as it takes, except
    after a stop (STOP): then Interrupted (a signal) or OutputStalled (--duration) once the
    reader took nothing for OUTPUT_GRACE seconds. EPIPE raises BrokenPipeError (`| head`)."""
    mv = memoryview(data).cast("B")
    poller = None
    while mv:
        try:
            n = os.write(fd, mv)
            mv = mv[n:]
            continue
        except BlockingIOError:
            pass
        if poller is None:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
        limit = STOP.limit()
        now = time.monotonic()
        if limit is not None and now >= limit:
            if STOP.signum is not None:
                raise Interrupted(STOP.signum)
            raise OutputStalled(f"nobody read standard output for {OUTPUT_GRACE:.0f}s after the end of the run; "
                                f"{len(mv)} bytes and the rows after them not written")
        poller.poll(100 if limit is None else max(1, min(100, int((limit - now) * 1000) + 1)))
