"""`serve synapse --redis URL`: the writer's side of Synapse's Redis transport, for trying
`synapse+redis://` with only a redis-server. As a Synapse process does, it subscribes to the
channel `<server_name>`, publishes every replication command there as `"NAME rest"` (the RDATA
lines of its feed, at `rate` lines a second, or as fast as Redis takes them), and answers every
`REPLICATE` it hears with a POSITION for each of its streams. Its own publications come back on
the subscription and are ignored, as Synapse ignores its own echoes. A subscription that is
dropped (`CLIENT KILL TYPE pubsub`) is made again, then a POSITION for every stream is
published, as Synapse does after its subscriber reconnects."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from dcptool.protocol.errors import ConnectFailed
from dcptool.protocol.synapse.server import Feed
from dcptool.protocol.text import printable

RESUBSCRIBE_TRIES = 50


def check_url(url: str, tcp_options: list[str]) -> None:
    """ValueError with the one-line reason for a --redis URL we cannot serve on, or TCP-only
    options given with it."""
    import urllib.parse
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("redis", "rediss") or not u.hostname:
        raise ValueError(f"--redis {url!r}: expected redis://HOST:PORT[/DB]")
    if u.password:
        raise ValueError("--redis: no password in the URL (it would show in ps)")
    if tcp_options:
        raise ValueError(f"--redis publishes to every subscriber at once: {tcp_options[0]} is for TCP connections")


async def publish(url: str, server_name: str, feed: Feed, *, rate: float, stop: asyncio.Event,
                  on_ready: Callable[[], None], chunk: int = 100,
                  clock: Callable[[], float] = time.monotonic) -> None:
    import redis.asyncio as aioredis
    import redis.exceptions as rexc

    r = aioredis.Redis.from_url(url, decode_responses=False)
    try:
        try:
            pubsub = await _subscribe(r, server_name)
        except (rexc.RedisError, OSError) as exc:
            raise ConnectFailed(f"cannot connect to Redis at {printable(url)}: {printable(str(exc))}") from None
        on_ready()
        t0, sent, failures = clock(), 0, 0
        while not stop.is_set():
            try:
                await _answer_replicates(r, pubsub, server_name, feed)
                failures = 0
            except (rexc.ConnectionError, OSError):
                failures += 1
                if failures > RESUBSCRIBE_TRIES:
                    raise ConnectFailed(f"lost Redis at {printable(url)}") from None
                await asyncio.sleep(0.1)
                try:
                    pubsub = await _subscribe(r, server_name)
                    await _publish_all(r, server_name, feed.positions())
                except (rexc.ConnectionError, OSError):
                    pass
                continue
            if feed.done:
                await asyncio.sleep(0.05)      # nothing left to publish: answer REPLICATEs only
                continue
            n = chunk
            if rate > 0:
                n = min(n, int((clock() - t0) * rate) - sent)
                if n <= 0:
                    await asyncio.sleep(min(0.05, 1.0 / rate))
                    continue
            lines = feed.take(n)
            await _publish_all(r, server_name, lines)
            sent += len(lines)
    finally:
        await r.aclose()


async def _subscribe(r: Any, channel: str) -> Any:
    pubsub = r.pubsub()
    await pubsub.subscribe(channel)
    for _ in range(100):                     # the subscription's confirmation, bounded
        msg = await pubsub.get_message(timeout=0.1)
        if msg is not None and msg.get("type") == "subscribe":
            return pubsub
    raise ConnectionError("no SUBSCRIBE confirmation")


async def _answer_replicates(r: Any, pubsub: Any, channel: str, feed: Feed) -> None:
    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.01)
    while msg is not None:
        if msg.get("type") == "message" and bytes(msg["data"]).strip() == b"REPLICATE":
            await _publish_all(r, channel, feed.positions())
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0)


async def _publish_all(r: Any, channel: str, lines: list[str]) -> None:
    if not lines:
        return
    pipe = r.pipeline(transaction=False)
    for line in lines:
        pipe.publish(channel, line)
    await pipe.execute()
