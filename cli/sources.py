"""SOURCE and option values from the command line, and credentials. Passwords never come
from argv or URLs. The URLs themselves are parsed by capture/sources.py (no click)."""

from __future__ import annotations

import os
import sys

import click

from dcptool.capture import values
from dcptool.capture.sources import Source, user_from
from dcptool.capture.sources import parse_source as _parse_source
from dcptool.protocol.errors import BadSource
from dcptool.replay.results import output_dir_problem

__all__ = ["Source", "parse_source", "user_from", "read_password", "capture_paths", "parse_vbuckets",
           "parse_size", "parse_duration"]


def parse_source(url: str) -> Source:
    """Parse a SOURCE argument; raise click.BadParameter with one clear line."""
    return _usage(_parse_source, url)


def read_password(password_file: str | None, *, needed: bool, user: str | None = None) -> str | None:
    """DCPTOOL_PASSWORD, then --password-file, then a prompt when stdin is a TTY. A password
    that is needed and cannot be had (no terminal to ask on) is a usage error now, not an
    authentication failure later."""
    env = os.environ.get("DCPTOOL_PASSWORD")
    if env is not None:
        return env
    if password_file:
        try:
            with open(password_file, encoding="utf-8") as fh:
                return fh.read().rstrip("\r\n")
        except OSError as exc:
            raise click.BadParameter(f"cannot read {password_file}: {exc.strerror}",
                                     param_hint="--password-file") from None
    if not needed:
        return None
    if sys.stdin is not None and _isatty(sys.stdin):
        return click.prompt("Password", hide_input=True, err=True)
    raise click.UsageError(f"no password for user {user!r}: set DCPTOOL_PASSWORD, use --password-file, "
                           "or run on a terminal")


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def capture_paths(captures) -> list[str]:
    """CAPTURE arguments of `inspect`, `replay` and the like: paths, and `-` for paths read
    from stdin (one per line)."""
    import click
    out: list[str] = []
    for c in captures:
        if c == "-":
            out.extend(line.strip() for line in sys.stdin if line.strip())
        else:
            out.append(c)
    if not out:
        raise click.UsageError("no capture paths given (stdin was empty)")
    return out


def _usage(fn, *args):
    try:
        return fn(*args)
    except BadSource as exc:
        raise click.BadParameter(str(exc), param_hint=exc.hint) from None


def parse_vbuckets(text: str, limit: int = 1024) -> list[int]:
    """'0-15,32' -> [0..15, 32]; raises click.BadParameter."""
    return _usage(values.vbucket_list, text, limit)


def parse_size(text: str, hint: str) -> int:
    return _usage(values.size_bytes, text, hint)


def parse_duration(text: str, hint: str) -> float:
    return _usage(values.duration_seconds, text, hint)


def output_dir_option(help_text: str, default: str | None = None):
    """`-o/--output DIR` as every command spells it, with `--out` kept as a hidden alias
    (replay's first spelling; scripts may use it). The value arrives as `output`, checked
    by OutputDir."""
    def deco(fn):
        fn = click.option("--out", "output_alias", type=OutputDir(), hidden=True,
                          help="Alias of --output.")(fn)
        return click.option("-o", "--output", type=OutputDir(), default=None,
                            show_default=default, help=help_text)(fn)
    return deco


class OutputDir(click.ParamType):
    """A directory, or a path one can be made at: a file, a device (/dev/null), a path under
    one or a symlink loop is a usage error (exit 2) saying it is not a directory."""
    name = "directory"

    def convert(self, value, param, ctx):
        problem = output_dir_problem(os.fspath(value))
        if problem:
            self.fail(problem, param, ctx)
        return value
