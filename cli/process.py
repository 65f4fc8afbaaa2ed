"""The process edge of every command: standard descriptors closed at start, and stop signals
(SIGINT, SIGTERM, SIGHUP) that end any command within a bound, with its line and exit code."""

from __future__ import annotations

import sys


class _ClosedStdout:
    """sys.stdout when file descriptor 1 was closed at start (`>&-`): every write is the
    one-line error of cli/errors.StdoutClosed (exit 1) instead of `'NoneType' object has no
    attribute 'write'`."""

    closed = False
    encoding = "utf-8"

    def _closed(self, *_a, **_k):
        from dcptool.cli.exit_codes import StdoutClosed
        raise StdoutClosed()

    write = writelines = _closed

    @property
    def buffer(self):
        return self

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError(9, "standard output is closed")


def guard_stdio() -> None:
    """Standard descriptors closed at start: /dev/null takes each one (a file opened later
    must never become descriptor 1 and receive output), sys.stdout becomes _ClosedStdout
    (writing to it is an error) and sys.stderr /dev/null."""
    import fcntl
    import os
    closed = []
    for fd in (0, 1, 2):
        try:
            fcntl.fcntl(fd, fcntl.F_GETFD)
        except OSError:
            closed.append(fd)
    for fd in closed:
        try:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        except OSError:
            pass
    if 1 in closed or sys.stdout is None:
        sys.stdout = _ClosedStdout()
    if 2 in closed or sys.stderr is None:
        sys.stderr = open(os.devnull, "w")


def stdout_closed() -> bool:
    return isinstance(sys.stdout, _ClosedStdout)


STOP_EXIT_WITHIN = 1.5   # seconds from a stop signal to the exit, whatever the command waits for


def install_stop_signals() -> None:
    """SIGTERM and SIGHUP end a command as Ctrl-C does (cli/errors.Interrupted: one line,
    exit 143 / 129, where Python's default would be a silent kill), and every stop signal
    (SIGINT too) arms a last resort: a command still running STOP_EXIT_WITHIN seconds later
    (a library waiting in a retry loop, a thread that does not end) exits then, with its line
    and exit code. Commands that finish cleanly on a signal (stream, capture, serve) install
    their own handlers while they run."""
    import signal

    from dcptool.cli.exit_codes import STOP_SIGNALS, Interrupted

    def on_stop(signum, _frame):
        from dcptool.live.stdout_pipe import (
            note_signal,  # loaded by every command that prints rows
        )
        note_signal(signum)
        STOP_SIGNALS.append(signum)
        _arm_exit(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) is signal.SIG_IGN and sig == signal.SIGHUP:
                continue   # nohup: the user asked for SIGHUP to be ignored
            signal.signal(sig, on_stop)
        except (ValueError, OSError):
            pass


_armed: list[int] = []


def _arm_exit(signum: int) -> None:
    import threading
    if _armed:
        return
    _armed.append(signum)
    t = threading.Thread(target=_exit_later, args=(signum,), name="dcptool-stop", daemon=True)
    t.start()


def _exit_later(signum: int) -> None:
    import os
    import time

    from dcptool.cli.exit_codes import (  # loaded already: install_stop_signals imported it
        STOP_REPORTED,
        Interrupted,
        exit_code_for,
        stop_text,
    )
    time.sleep(STOP_EXIT_WITHIN)   # a deadline, not an ordering: the command had its chance to end
    if not STOP_REPORTED:
        try:
            os.write(2, f"dcptool: {stop_text(signum)}\n".encode())
        except OSError:
            pass
    os._exit(exit_code_for(Interrupted(signum)))   # cli/exit_codes.py's table: 128 + signal
