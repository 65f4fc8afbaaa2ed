"""The only place that turns errors into exit codes (CLI.md)."""

from __future__ import annotations

import sys

import click

from dcptool.protocol.errors import (
    AuthRefused,
    ConnectFailed,
    ConnectionLost,
    DcptoolError,
    ErrorCode,
    Interrupted,
    LateUsageError,
    ProtocolError,
    one_line,
)

__all__ = ["Interrupted", "LateUsageError", "exit_code_for", "describe", "error_line", "handle"]

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_CONNECT = 3
EXIT_AUTH = 4
EXIT_PROTOCOL = 5
EXIT_FINDINGS = 6      # diff: the captures differ; verify: problems found
EXIT_INTERRUPTED = 130

AUTH_STATUSES = {0x1F, 0x20, 0x24}  # auth stale, auth error, access denied

# Every exception of the project derives from DcptoolError (protocol/errors.py); the first
# row that matches gives the exit code. Anything else (an OSError, a bug) is a runtime failure.
EXIT_CODES: tuple[tuple[type, int], ...] = (
    (KeyboardInterrupt, EXIT_INTERRUPTED),
    (LateUsageError, EXIT_USAGE),
    (ConnectFailed, EXIT_CONNECT),
    (AuthRefused, EXIT_AUTH),
    (ProtocolError, EXIT_PROTOCOL),
    (ConnectionLost, EXIT_RUNTIME),
    (DcptoolError, EXIT_RUNTIME),
)


class StdoutClosed(DcptoolError):
    """Standard output was closed when dcptool started (`>&-`): the output has nowhere to go
    (exit 1; a reader that went away, `| head`, is EPIPE and exit 0)."""

    def __init__(self, message: str = "standard output is closed: nothing to write the output to "
                                      "(redirect it to a file, or to /dev/null to drop it)"):
        super().__init__(message)


STOP_REPORTED: list[int] = []   # the `interrupted` / `stopped by` line was printed
# the stop signals this process received (cli/process.py): the first one is the exit code of an
# interruption reported by a library that cannot tell which signal it was (DuckDB answers every
# signal with "Query interrupted")
STOP_SIGNALS: list[int] = []


def exit_code_for(exc: BaseException) -> int:
    if isinstance(exc, Interrupted):
        return 128 + exc.signum
    if isinstance(exc, ProtocolError) and (exc.code == ErrorCode.AUTH_FAILED or exc.status in AUTH_STATUSES):
        return EXIT_AUTH
    return next((code for cls, code in EXIT_CODES if isinstance(exc, cls)), EXIT_RUNTIME)


def stop_text(signum: int) -> str:
    """The line of a command a stop signal ended."""
    import signal
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


def describe(exc: BaseException) -> str:
    """The one line for an error (protocol/errors.py one_line: server text escaped)."""
    return one_line(exc)


def error_line(message: str) -> None:
    """One clear line on stderr (text, never rich markup); plain if rich cannot load (EMFILE)."""
    try:
        from rich.markup import escape

        from dcptool.cli.view.console import err_console
        err_console().print(f"[bold red]dcptool:[/] {escape(message)}", highlight=False, soft_wrap=True)
    except (ImportError, OSError):   # no file descriptor left to import with: still the one line
        sys.stderr.write(f"dcptool: {message}\n")


def handle(ctx: click.Context, exc: BaseException):
    """Turn an exception escaping a command into one stderr line and an exit code."""
    if isinstance(exc, (click.exceptions.Exit, click.ClickException, click.exceptions.Abort)):
        raise exc
    if isinstance(exc, BrokenPipeError):
        # the reader of our stdout went away (`| head`): not an error
        _silence_stdout()
        ctx.exit(EXIT_OK)
    if isinstance(exc, (KeyboardInterrupt, Interrupted)):
        signum = STOP_SIGNALS[0] if STOP_SIGNALS else getattr(exc, "signum", 2)
        STOP_REPORTED.append(signum)   # the last resort of process.install_stop_signals says nothing more
        error_line(stop_text(signum))
        ctx.exit(exit_code_for(Interrupted(signum)))
    if (ctx.obj or {}).get("verbose"):
        import traceback

        from dcptool.protocol.text import printable
        for chunk in traceback.format_exception(exc):   # messages may quote the server: escaped
            sys.stderr.write("\n".join(printable(ln) for ln in chunk.rstrip("\n").split("\n")) + "\n")
    error_line(describe(exc))
    ctx.exit(exit_code_for(exc))


def _silence_stdout():
    import os
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
