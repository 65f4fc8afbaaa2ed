"""Source URLs (CLI.md) and credentials. Passwords never come from argv or URLs."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import urllib.parse

import click

from dcptool.protocol.text import printable

DEFAULT_PORTS = {"couchbase": 11210, "couchbases": 11207, "synapse": None, "synapse+redis": 6379}
PROTOCOL_OF = {"couchbase": "dcp", "couchbases": "dcp", "synapse": "synapse",
               "synapse+redis": "synapse", "synapse+rediss": "synapse"}


@dataclasses.dataclass(frozen=True)
class Source:
    scheme: str               # couchbase, couchbases, synapse, synapse+redis, synapse+rediss
    host: str
    port: int
    bucket: str | None = None       # couchbase
    db: int = 0                     # synapse+redis
    server_name: str | None = None  # synapse+redis (required), synapse (optional: expected SERVER)
    tls: bool = False
    url: str = ""                   # safe to print and record: never holds a password
    seeds: tuple = ()               # couchbase: ((host, port), ...) in the order given; host/port = the first

    @property
    def seed_list(self) -> list[tuple[str, int]]:
        return list(self.seeds) or [(self.host, self.port)]

    @property
    def protocol(self) -> str:
        return PROTOCOL_OF[self.scheme]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _seeds(url: str, scheme: str) -> tuple[str, tuple]:
    """couchbase://[USER@]H1[:P1],H2[:P2].../BUCKET: the netloc as one seed (host:port) for
    urlsplit, and every seed. urlsplit cannot read a comma host list, so the netloc is split
    here; each seed without a port gets the scheme's default, IPv6 hosts go in brackets."""
    rest = url.split("://", 1)[1]
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    userinfo, at, hosts = netloc.rpartition("@")
    default = DEFAULT_PORTS[scheme]
    seeds = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            raise click.BadParameter(f"empty seed in the host list of {url!r}", param_hint="SOURCE")
        if part.startswith("["):
            host, sep, tail = part[1:].partition("]")
            if not sep or (tail and not tail.startswith(":")):
                raise click.BadParameter(f"bad IPv6 seed {part!r} (use [ADDR]:PORT)", param_hint="SOURCE")
            port_text = tail[1:] if tail else ""
        else:
            host, _, port_text = part.partition(":")
            if ":" in port_text:
                raise click.BadParameter(f"bad seed {part!r}: an IPv6 address goes in brackets",
                                         param_hint="SOURCE")
        if not host:
            raise click.BadParameter(f"no host in seed {part!r}", param_hint="SOURCE")
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise click.BadParameter(f"bad port in seed {part!r}", param_hint="SOURCE")
            port = int(port_text)
        else:
            port = default
        seeds.append((host, port))
    first = f"{_host_for_url(seeds[0][0])}:{seeds[0][1]}"
    one = url.replace(netloc, f"{userinfo}{at}{first}", 1)
    return one, tuple(seeds)


# the query parameters each scheme documents (CLI.md "Sources"); any other is a usage error
QUERY_PARAMETERS = {"couchbase": (), "couchbases": (), "synapse": ("server_name",),
                    "synapse+redis": ("server_name",), "synapse+rediss": ("server_name",)}
PASSWORD_REFUSED = "a password in the URL is refused: use DCPTOOL_PASSWORD, --password-file or the prompt"
# a query parameter named like a credential: refused like a password, never echoed or stored
_CREDENTIAL = re.compile(r"pass|pwd|secret|token|auth|cred|key|sasl|sig", re.IGNORECASE)


def _query(url: str, scheme: str) -> dict[str, str]:
    """The query parameters of `url`, checked: a credential-looking name is refused like a
    password in the user info, a name the scheme does not document is a usage error naming
    it (never its value), and so is a parameter given twice or a #fragment."""
    url, hash_, _fragment = url.partition("#")
    query = url.split("?", 1)[1] if "?" in url else ""
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        names = [p.split("=", 1)[0] for p in query.split("&")]
        if any(_CREDENTIAL.search(urllib.parse.unquote(n)) for n in names):
            raise click.BadParameter(PASSWORD_REFUSED, param_hint="SOURCE") from None
        raise click.BadParameter("the query of the URL is not NAME=VALUE&...", param_hint="SOURCE") from None
    if any(_CREDENTIAL.search(name) for name, _ in pairs):
        raise click.BadParameter(PASSWORD_REFUSED, param_hint="SOURCE")
    if hash_:
        raise click.BadParameter("a #fragment in the URL has no meaning: leave it out", param_hint="SOURCE")
    if scheme not in QUERY_PARAMETERS:
        return {}       # parse_source names the unknown scheme
    allowed = QUERY_PARAMETERS[scheme]
    out: dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            known = ", ".join(allowed) if allowed else "none"
            raise click.BadParameter(f"unknown query parameter {printable(name)!r} in the URL "
                                     f"({scheme}:// takes: {known})", param_hint="SOURCE")
        if name in out:
            raise click.BadParameter(f"query parameter {name!r} given twice", param_hint="SOURCE")
        out[name] = value
    return out


def parse_source(url: str) -> Source:
    """Parse a SOURCE argument; raise click.BadParameter with one clear line. Credentials
    are looked for first, so that no later message quotes one."""
    seeds: tuple = ()
    head = url.split("://", 1)[0].lower() if "://" in url else ""
    query = _query(url, head)
    if _userinfo_password(url):
        raise click.BadParameter(PASSWORD_REFUSED, param_hint="SOURCE")
    if head in ("couchbase", "couchbases") and "," in url.split("://", 1)[1].split("/", 1)[0]:
        url, seeds = _seeds(url, head)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise click.BadParameter(f"not a URL: {exc}", param_hint="SOURCE") from None
    scheme = parts.scheme.lower()
    if scheme not in PROTOCOL_OF:
        raise click.BadParameter(
            f"unknown scheme {scheme or '(none)'!r} in {url!r}; use couchbase://, couchbases://, "
            "synapse:// or synapse+redis://", param_hint="SOURCE")
    host = parts.hostname
    if not host:
        raise click.BadParameter(f"no host in {url!r}", param_hint="SOURCE")
    try:
        port = parts.port
    except ValueError:
        raise click.BadParameter(f"bad port in {url!r}", param_hint="SOURCE") from None
    if port is None:
        port = DEFAULT_PORTS.get(scheme.replace("rediss", "redis"))
        if port is None:
            raise click.BadParameter(f"{scheme}:// needs a port: {scheme}://HOST:PORT",
                                     param_hint="SOURCE")
    path = parts.path.strip("/")
    user_part = f"{parts.username}@" if parts.username else ""
    safe = urllib.parse.urlunsplit((scheme, f"{user_part}{_host_for_url(host)}:{port}",
                                    parts.path, parts.query, ""))
    if scheme in ("couchbase", "couchbases"):
        if not path or "/" in path:
            raise click.BadParameter(f"{scheme}:// needs exactly one bucket: {scheme}://HOST[:PORT]/BUCKET",
                                     param_hint="SOURCE")
        if seeds:
            safe = urllib.parse.urlunsplit((scheme, user_part + ",".join(
                f"{_host_for_url(h)}:{p}" for h, p in seeds), parts.path, parts.query, ""))
        return Source(scheme, host, port, bucket=urllib.parse.unquote(path),
                      tls=scheme == "couchbases", url=safe, seeds=seeds or ((host, port),))
    server_name = query.get("server_name") or None
    if scheme == "synapse":
        return Source(scheme, host, port, server_name=server_name, url=safe)
    db = 0
    if path:
        if not path.isdigit():
            raise click.BadParameter(f"the Redis database must be a number, not {path!r}",
                                     param_hint="SOURCE")
        db = int(path)
    if not server_name:
        raise click.BadParameter("synapse+redis:// needs ?server_name=NAME (the Synapse server name)",
                                 param_hint="SOURCE")
    return Source(scheme, host, port, db=db, server_name=server_name,
                  tls=scheme.endswith("rediss"), url=safe)


def _userinfo_password(url: str) -> bool:
    """USER:PASSWORD@ in the URL's netloc (read by hand: a seed list is no netloc urlsplit
    reads, and a password must be found before any message quotes the URL)."""
    rest = url.split("://", 1)[1] if "://" in url else url
    netloc = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    userinfo, at, _hosts = netloc.rpartition("@")
    return bool(at) and ":" in userinfo


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def user_from(option_user: str | None, source_url: str) -> str | None:
    if option_user:
        return option_user
    env = os.environ.get("DCPTOOL_USER")
    if env:
        return env
    name = urllib.parse.urlsplit(source_url).username
    return urllib.parse.unquote(name) if name else None


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
