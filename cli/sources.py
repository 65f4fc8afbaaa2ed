"""SOURCE and option values from the command line, and credentials. Passwords never come
from argv or URLs. The URLs themselves are parsed by capture/sources.py (no click); option
values as users write them (vbucket lists '0-15,32', sizes '256MiB', durations '30s') here."""

from __future__ import annotations

import os
import re
import sys

import click

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
    return _usage(_vbucket_list, text, limit)


def parse_size(text: str, hint: str) -> int:
    return _usage(_size_bytes, text, hint)


def parse_duration(text: str, hint: str) -> float:
    return _usage(_duration_seconds, text, hint)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}
_SECONDS = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}


def _vbucket_list(text: str, limit: int = 1024, hint: str = "--vbuckets") -> list[int]:
    """'0-15,32' -> [0..15, 32], sorted, each once."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part),) * 2
        except ValueError:
            raise BadSource(f"not a vbucket range: {part!r}", hint) from None
        if lo > hi:
            raise BadSource(f"vbucket range {part!r} is reversed: write {hi}-{lo}", hint)
        if lo < 0 or hi >= limit:
            raise BadSource(f"vbucket range {part!r} outside 0-{limit - 1}", hint)
        out.update(range(lo, hi + 1))
    if not out:
        raise BadSource("no vbuckets selected", hint)
    return sorted(out)


def _size_bytes(text: str, hint: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise BadSource(f"not a size: {text!r} (e.g. 256MiB)", hint)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _duration_seconds(text: str, hint: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise BadSource(f"not a duration: {text!r} (e.g. 30s, 5m)", hint)
    return float(m.group(1)) * _SECONDS[m.group(2)]


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
