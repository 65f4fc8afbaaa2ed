"""One rich console on stderr for progress, logs and errors; stdout carries only data."""

from __future__ import annotations

import contextlib
import sys

_console = None
NO_LIMIT = 1_000_000  # the width of a console that is not a terminal


def err_console():
    """The stderr console (re-made when sys.stderr was replaced, as test runners do)."""
    global _console
    if _console is None or _console.file is not sys.stderr:
        from rich.console import Console
        _console = Console(file=sys.stderr, stderr=True)
    return _console


def status_console():
    """err_console() where stderr is a terminal; elsewhere (no spinner to draw, no style) a
    writer of plain lines, so that a command in a pipe or a script never imports rich."""
    return err_console() if stdout_is_tty(sys.stderr) else _PlainConsole()


class _PlainConsole:
    def status(self, *args, **kwargs):
        return contextlib.nullcontext()

    def print(self, text: str, **kwargs) -> None:
        print(text, file=sys.stderr, flush=True)


def stdout_is_tty(file=None) -> bool:
    try:
        return (file or sys.stdout).isatty()
    except (AttributeError, ValueError):
        return False


def data_console(file=None, **kw):
    """A rich console for data on stdout, as wide as its content when not a terminal. A closed pipe (`| head`) ends the command
    quietly with exit 0 through cli/exit_codes.py, instead of rich's own exit 1."""
    from rich.console import Console

    class _DataConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError()

    file = file if file is not None else sys.stdout
    if "width" not in kw:
        try:
            tty = file.isatty()
        except (AttributeError, ValueError):
            tty = False
        if not tty:  # a pipe or a log: no width to fit, so nothing is cut at 80 columns
            kw["width"] = NO_LIMIT
    return _DataConsole(file=file, **kw)
