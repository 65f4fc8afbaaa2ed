"""`capture --shard K/N` (DCP): this process streams the vbuckets with vb % N == K - 1 (of
--vbuckets when given: the intersection), and its segments record "shard": "K/N" in their
dcptool.options metadata, so that `verify` can tell whether the shards present in a
directory cover the bucket. Several shard processes write one directory at once: segment
names carry each run's capture id, and each shard's ring and retained-state record are
its own (capture/ring.py)."""

from __future__ import annotations

import re

from dcptool.protocol.errors import LateUsageError

MAX_SHARDS = 1024        # a bucket has at most 1024 vbuckets
_SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def check_shard(text: str | None, protocol: str = "dcp") -> str | None:
    """"K/N" normalised; LateUsageError (exit 2) for anything else than 1 <= K <= N <= 1024,
    and for a Synapse source (one stream set: nothing to divide)."""
    if text is None:
        return None
    if protocol != "dcp":
        raise LateUsageError("--shard is for DCP: a Synapse capture is one stream set")
    m = _SHARD_RE.match(text)
    if m is None:
        raise LateUsageError(f"--shard: {text!r} is not K/N (e.g. 1/4: the first of four shards)")
    k, n = int(m.group(1)), int(m.group(2))
    if not 1 <= n <= MAX_SHARDS or not 1 <= k <= n:
        raise LateUsageError(f"--shard {text}: K/N needs 1 <= K <= N <= {MAX_SHARDS}")
    return f"{k}/{n}"


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """"K/N" -> (K - 1, N), the consumer's (index, count); None without a shard."""
    text = check_shard(text)
    if text is None:
        return None
    k, n = (int(x) for x in text.split("/"))
    return k - 1, n


def shard_vbuckets(opts) -> list[int] | None:
    """The vbuckets a run streams: --vbuckets, less those of other shards; None: every
    vbucket of the bucket (of this shard: the consumer filters them)."""
    shard = parse_shard(opts.shard)
    if opts.vbuckets is None or shard is None:
        return opts.vbuckets
    mine = [vb for vb in opts.vbuckets if vb % shard[1] == shard[0]]
    if not mine:
        raise LateUsageError(f"--shard {opts.shard} holds none of the vbuckets given with --vbuckets")
    return mine


def in_shard(vb: int, shard: str | None) -> bool:
    parsed = parse_shard(shard)
    return parsed is None or vb % parsed[1] == parsed[0]


def shard_name(name: str, shard: str | None) -> str:
    """The DCP connection name of a shard: a shard suffix, so that shards given one --name do
    not replace each other's connections (a producer closes the older one of a name)."""
    if shard is None:
        return name
    k, n = shard.split("/")
    return f"{name}-shard-{k}-of-{n}"
