"""The only place that turns errors into exit codes (CLI.md)."""

from __future__ import annotations

import sys

import click

from dcptool.protocol.errors import (AuthRefused, ConnectFailed, ConnectionLost, ErrorCode,
                                     ProtocolError)

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_CONNECT = 3
EXIT_AUTH = 4
EXIT_PROTOCOL = 5
EXIT_FINDINGS = 6      # diff: the captures differ; verify: problems found
EXIT_INTERRUPTED = 130

AUTH_STATUSES = {0x1F, 0x20, 0x24}  # auth stale, auth error, access denied


class Interrupted(Exception):
    """Raised by a command after it closed everything cleanly on a signal: Ctrl-C (SIGINT)
    exits 130, SIGTERM and SIGHUP 128 + the signal number (143, 129)."""

    def __init__(self, signum: int = 2):
        super().__init__(signum)
        self.signum = int(signum)


class LateUsageError(Exception):
    """A usage error found only after connecting (an option the server's answer rules out,
    e.g. --vbuckets beyond the bucket's): exit 2 with one line."""


def exit_code_for(exc: BaseException) -> int:
    if isinstance(exc, Interrupted):
        return 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, LateUsageError) or getattr(exc, "usage_error", False):
        return EXIT_USAGE       # also a library error marked so (a capture format too new)
    if isinstance(exc, ConnectFailed):
        return EXIT_CONNECT
    if isinstance(exc, AuthRefused):
        return EXIT_AUTH
    if isinstance(exc, ProtocolError):
        if exc.code == ErrorCode.AUTH_FAILED or exc.status in AUTH_STATUSES:
            return EXIT_AUTH
        return EXIT_PROTOCOL
    if isinstance(exc, ConnectionLost):
        return EXIT_RUNTIME
    return EXIT_RUNTIME


def describe(exc: BaseException) -> str:
    """The one line for an error. Messages quote what the server sent (mechanism lists,
    error texts, names): control characters and terminal escapes come out escaped."""
    from dcptool.cli.output import printable
    if isinstance(exc, ProtocolError):
        extra = f" (status 0x{exc.status:02x})" if exc.status is not None else ""
        return printable(f"{exc.message}{extra}")
    text = str(exc) or type(exc).__name__
    line = text.splitlines()[0] if text.strip() else type(exc).__name__
    # a library's message may carry raw bytes of the damaged input: show them escaped
    return printable(line)


def error_line(message: str) -> None:
    """One clear line on stderr (the message is text, never rich markup)."""
    from rich.markup import escape

    from dcptool.cli.console import err_console
    err_console().print(f"[bold red]dcptool:[/] {escape(message)}", highlight=False, soft_wrap=True)


def handle(ctx: click.Context, exc: BaseException):
    """Turn an exception escaping a command into one stderr line and an exit code."""
    if isinstance(exc, (click.exceptions.Exit, click.ClickException, click.exceptions.Abort)):
        raise exc
    if isinstance(exc, BrokenPipeError):
        # the reader of our stdout went away (`| head`): not an error
        _silence_stdout()
        ctx.exit(EXIT_OK)
    if isinstance(exc, (KeyboardInterrupt, Interrupted)):
        signum = getattr(exc, "signum", 2)
        import signal
        error_line("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}")
        ctx.exit(exit_code_for(exc))
    if (ctx.obj or {}).get("verbose"):
        import traceback

        from dcptool.cli.output import printable
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
