"""SOURCE and option values from the command line, and credentials. Passwords never come
from argv or URLs. The URLs themselves are parsed by capture/sources.py (no click)."""

from __future__ import annotations

import os
import sys

import click

from dcptool.capture.sources import Source, parse_source as _parse_source, user_from
from dcptool.protocol.errors import BadSource

__all__ = ["Source", "parse_source", "user_from", "read_password", "capture_paths", "parse_vbuckets",
           "parse_size", "parse_duration"]


def parse_source(url: str) -> Source:
    """Parse a SOURCE argument; raise click.BadParameter with one clear line."""
    try:
        return _parse_source(url)
    except BadSource as exc:
        raise click.BadParameter(str(exc), param_hint=exc.hint) from None


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
    out = []
    for c in captures:
        if c == "-":
            out.extend(line.strip() for line in sys.stdin if line.strip())
        else:
            out.append(c)
    if not out:
        raise click.UsageError("no capture paths given (stdin was empty)")
    return out


def parse_vbuckets(text: str, limit: int = 1024) -> list[int]:
    """'0-15,32' -> [0..15, 32]; raises click.BadParameter."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
            else:
                lo = hi = int(part)
        except ValueError:
            raise click.BadParameter(f"not a vbucket range: {part!r}", param_hint="--vbuckets") from None
        if lo > hi:
            raise click.BadParameter(f"vbucket range {part!r} is reversed: write {hi}-{lo}",
                                     param_hint="--vbuckets")
        if lo < 0 or hi >= limit:
            raise click.BadParameter(f"vbucket range {part!r} outside 0-{limit - 1}",
                                     param_hint="--vbuckets")
        out.update(range(lo, hi + 1))
    if not out:
        raise click.BadParameter("no vbuckets selected", param_hint="--vbuckets")
    return sorted(out)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text: str, hint: str) -> int:
    import re
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise click.BadParameter(f"not a size: {text!r} (e.g. 256MiB)", param_hint=hint)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_duration(text: str, hint: str) -> float:
    import re
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise click.BadParameter(f"not a duration: {text!r} (e.g. 30s, 5m)", param_hint=hint)
    return float(m.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]
