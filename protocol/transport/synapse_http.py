"""The HTTP side of Synapse's replication: a GET to a writer's replication listener (the
catch-up of missed rows, protocol/synapse/catchup.py). One request per connection
(`Connection: close`), the answer read whole (Content-Length, chunked, or to the end), bounded
in size and time. The shared secret goes in the Authorization header and nowhere else."""

from __future__ import annotations

import asyncio
import ssl as ssl_module
import urllib.parse
from typing import Callable

from dcptool.protocol.errors import ErrorCode, RemoteError
from dcptool.protocol.synapse.catchup import MAX_ANSWER
from dcptool.protocol.text import printable
from dcptool.protocol.transport.served import Served

MAX_HEAD = 64 * 1024


class HttpError(RemoteError):
    """The writer could not be reached or did not answer 200."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(ErrorCode.BAD_CATCH_UP, message)
        self.http_status = status


def split_base(url: str) -> tuple[str, str, int, bool]:
    """(host, base path, port, tls) of a listener URL such as http://127.0.0.1:9093."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http:// or https:// URL: {url}")
    if u.username or u.password:
        raise ValueError("a catch-up URL carries no credentials (the secret comes from the environment)")
    tls = u.scheme == "https"
    return u.hostname, u.path.rstrip("/"), u.port or (443 if tls else 80), tls


async def get(base_url: str, target: str, secret: str | None, *, timeout: float = 30.0) -> bytes:
    """The body of a 200 answer to GET base_url + target; HttpError otherwise."""
    host, prefix, port, tls = split_base(base_url)
    try:
        return await asyncio.wait_for(_get(host, port, tls, prefix + target, secret), timeout)
    except asyncio.TimeoutError:
        raise HttpError(f"{base_url}: no answer within {timeout:g} s") from None
    except OSError as exc:
        raise HttpError(f"{base_url}: {printable(exc.strerror or str(exc))}") from None


async def _get(host: str, port: int, tls: bool, target: str, secret: str | None) -> bytes:
    ctx = ssl_module.create_default_context() if tls else None
    reader, writer = await asyncio.open_connection(host, port, ssl=ctx, limit=MAX_HEAD)
    try:
        head = [f"GET {target} HTTP/1.1", f"Host: {host}:{port}", "Accept: application/json",
                "Connection: close", "User-Agent: dcptool"]
        if secret:
            head.append(f"Authorization: Bearer {secret}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        await writer.drain()
        status, headers = await _read_head(reader)
        body = await _read_body(reader, headers)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
    if status != 200:
        raise HttpError(f"HTTP {status}: {printable(body[:200].decode('utf-8', 'replace'))}", status)
    return body


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        raise HttpError("the connection closed before an HTTP answer") from None
    except asyncio.LimitOverrunError:
        raise HttpError(f"HTTP headers above {MAX_HEAD} bytes") from None
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"not an HTTP answer: {printable(lines[0][:80])}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            size_line = await reader.readline()
            try:
                size = int(size_line.split(b";", 1)[0].strip() or b"x", 16)
            except ValueError:
                raise HttpError("a malformed chunk size") from None
            if size == 0:
                await reader.readline()
                return bytes(out)
            if len(out) + size > MAX_ANSWER:
                raise HttpError(f"an answer above {MAX_ANSWER} bytes")
            out += await _exactly(reader, size)
            await reader.readline()
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit() or int(length) > MAX_ANSWER:
            raise HttpError(f"Content-Length {printable(length[:20])} not accepted")
        return await _exactly(reader, int(length))
    out = bytearray()
    while chunk := await reader.read(1 << 16):     # no length: the body ends with the connection
        out += chunk
        if len(out) > MAX_ANSWER:
            raise HttpError(f"an answer above {MAX_ANSWER} bytes")
    return bytes(out)


async def _exactly(reader: asyncio.StreamReader, n: int) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise HttpError("the connection closed in the middle of the answer") from None


Answer = Callable[[str, "str | None"], "tuple[int, bytes]"]   # (target, Authorization) -> (status, body)
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}


async def serve_http(bind: str, port: int, answer: Answer, served: Served | None = None) -> asyncio.AbstractServer:
    """A small replication listener: each GET answered by ``answer(target, authorization)``
    (sans-IO, e.g. protocol/synapse/server.py catch_up_answer), one request per connection;
    its connections tracked by `served` (transport/served.py: ended at a stop by its owner)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            lines = raw.decode("latin-1").split("\r\n")
            method, _, rest = lines[0].partition(" ")
            target = rest.rpartition(" ")[0] or rest
            auth = next((v.strip() for k, _, v in (h.partition(":") for h in lines[1:])
                         if k.strip().lower() == "authorization"), None)
            status, body = answer(target, auth) if method == "GET" else (405, b"{}")
            head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError, OSError):
            pass
        finally:
            writer.close()
    return await asyncio.start_server((served or Served()).wrap(handle), bind, port, limit=MAX_HEAD)
