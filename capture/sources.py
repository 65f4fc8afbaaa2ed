"""Source URLs (CLI.md "Sources"): couchbase://, couchbases:// (with seed lists),
synapse://, synapse+redis://. A password is never part of a URL: one in it is refused, and
`Source.url` (what is printed and recorded) never holds one."""

from __future__ import annotations

import dataclasses
import os
import re
import urllib.parse

from dcptool.protocol.errors import BadSource
from dcptool.protocol.text import printable

DEFAULT_PORTS = {"couchbase": 11210, "couchbases": 11207, "synapse": None, "synapse+redis": 6379}
PROTOCOL_OF = {"couchbase": "dcp", "couchbases": "dcp", "synapse": "synapse",
               "synapse+redis": "synapse", "synapse+rediss": "synapse"}

# the query parameters each scheme documents (CLI.md "Sources"); any other is a usage error
QUERY_PARAMETERS = {"couchbase": (), "couchbases": (), "synapse": ("server_name",),
                    "synapse+redis": ("server_name",), "synapse+rediss": ("server_name",)}
PASSWORD_REFUSED = "a password in the URL is refused: use DCPTOOL_PASSWORD, --password-file or the prompt"
# a query parameter named like a credential: refused like a password, never echoed or stored
_CREDENTIAL = re.compile(r"pass|pwd|secret|token|auth|cred|key|sasl|sig", re.IGNORECASE)


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
    assert default is not None, "seed lists are couchbase:// and couchbases://, which have a port"
    seeds = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            raise BadSource(f"empty seed in the host list of {url!r}")
        if part.startswith("["):
            host, sep, tail = part[1:].partition("]")
            if not sep or (tail and not tail.startswith(":")):
                raise BadSource(f"bad IPv6 seed {part!r} (use [ADDR]:PORT)")
            port_text = tail[1:] if tail else ""
        else:
            host, _, port_text = part.partition(":")
            if ":" in port_text:
                raise BadSource(f"bad seed {part!r}: an IPv6 address goes in brackets")
        if not host:
            raise BadSource(f"no host in seed {part!r}")
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise BadSource(f"bad port in seed {part!r}")
            port = int(port_text)
        else:
            port = default
        seeds.append((host, port))
    first = f"{_host_for_url(seeds[0][0])}:{seeds[0][1]}"
    one = url.replace(netloc, f"{userinfo}{at}{first}", 1)
    return one, tuple(seeds)


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
            raise BadSource(PASSWORD_REFUSED) from None
        raise BadSource("the query of the URL is not NAME=VALUE&...") from None
    if any(_CREDENTIAL.search(name) for name, _ in pairs):
        raise BadSource(PASSWORD_REFUSED)
    if hash_:
        raise BadSource("a #fragment in the URL has no meaning: leave it out")
    if scheme not in QUERY_PARAMETERS:
        return {}       # parse_source names the unknown scheme
    allowed = QUERY_PARAMETERS[scheme]
    out: dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            known = ", ".join(allowed) if allowed else "none"
            raise BadSource(f"unknown query parameter {printable(name)!r} in the URL "
                            f"({scheme}:// takes: {known})")
        if name in out:
            raise BadSource(f"query parameter {name!r} given twice")
        out[name] = value
    return out


def _userinfo_password(url: str) -> bool:
    """USER:PASSWORD@ in the URL's netloc (read by hand: a seed list is no netloc urlsplit
    reads, and a password must be found before any message quotes the URL)."""
    rest = url.split("://", 1)[1] if "://" in url else url
    netloc = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    userinfo, at, _hosts = netloc.rpartition("@")
    return bool(at) and ":" in userinfo


def parse_source(url: str) -> Source:
    """Parse a SOURCE URL; raise BadSource with one clear line. Credentials are looked for
    first, so that no later message quotes one."""
    seeds: tuple = ()
    head = url.split("://", 1)[0].lower() if "://" in url else ""
    query = _query(url, head)
    if _userinfo_password(url):
        raise BadSource(PASSWORD_REFUSED)
    if head in ("couchbase", "couchbases") and "," in url.split("://", 1)[1].split("/", 1)[0]:
        url, seeds = _seeds(url, head)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise BadSource(f"not a URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in PROTOCOL_OF:
        raise BadSource(
            f"unknown scheme {scheme or '(none)'!r} in {url!r}; use couchbase://, couchbases://, "
            "synapse:// or synapse+redis://")
    host = parts.hostname
    if not host:
        raise BadSource(f"no host in {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise BadSource(f"bad port in {url!r}") from None
    if port is None:
        port = DEFAULT_PORTS.get(scheme.replace("rediss", "redis"))
        if port is None:
            raise BadSource(f"{scheme}:// needs a port: {scheme}://HOST:PORT")
    path = parts.path.strip("/")
    user_part = f"{parts.username}@" if parts.username else ""
    safe = urllib.parse.urlunsplit((scheme, f"{user_part}{_host_for_url(host)}:{port}",
                                    parts.path, parts.query, ""))
    if scheme in ("couchbase", "couchbases"):
        if not path or "/" in path:
            raise BadSource(f"{scheme}:// needs exactly one bucket: {scheme}://HOST[:PORT]/BUCKET")
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
            raise BadSource(f"the Redis database must be a number, not {path!r}")
        db = int(path)
    if not server_name:
        raise BadSource("synapse+redis:// needs ?server_name=NAME (the Synapse server name)")
    return Source(scheme, host, port, db=db, server_name=server_name,
                  tls=scheme.endswith("rediss"), url=safe)


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
