"""`dcptool restore` as a library call: the documents of captures (documents.py) written into
a live bucket with SET_WITH_META / DEL_WITH_META (protocol/transport/kv_restore.py), counted.

Before anything is written: the target is bootstrapped (map, collections manifest) and every
collection the documents go to must exist there (`--collection-map` renames), else
UnknownTargetCollection (a usage error). Then the documents stream from the capture into the
cluster's pump (`window` requests in flight per connection, about `inflight` documents
submitted and not finished at most); a document whose expiry
has passed is skipped and counted (`replace_ttl`: written with no expiry instead). The stop
event ends the run within a moment: the writes in flight are abandoned (each is whole or not
at all on the target, and a re-run writes what is missing: conflict resolution makes it
idempotent)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import time
from typing import Any, Awaitable, Callable, Iterable, Iterator

from dcptool.protocol.dcp.client.kv_writer import Doc, Verdict
from dcptool.protocol.dcp.client.manifest import Manifest, parse_manifest
from dcptool.protocol.errors import DcptoolError, LateUsageError
from dcptool.protocol.transport.kv_restore import KvCluster
from dcptool.restore import documents
from dcptool.restore.documents import Captured, select


class UnknownTargetCollection(LateUsageError):
    """A collection the documents would go to does not exist in the target bucket."""


class RestoreFailed(DcptoolError):
    """Writes the target refused for good (the statuses are in the summary)."""


@dataclasses.dataclass
class RestoreOptions:
    files: list[Any]
    seeds: list[tuple[str, int]]
    bucket: str
    user: str | None = None
    password: str | None = None
    tls: ssl.SSLContext | None = None
    as_of: Any = None
    keys: str | None = None
    collection_map: dict[str, str] = dataclasses.field(default_factory=dict)   # "s.c" -> "s.c"
    force: bool = False
    replace_ttl: bool = False
    dry_run: bool = False
    window: int = 64              # requests in flight per connection
    inflight: int = 512           # documents submitted to the pump and not finished (queued or in flight)
    timeout: float = 30.0
    now: Callable[[], float] = time.time


@dataclasses.dataclass
class RestoreCounts:
    documents: int = 0
    written: int = 0
    deleted: int = 0               # of written: tombstones
    skipped: int = 0               # target newer or equal (KEY_EEXISTS)
    expired: int = 0               # expiry passed: not written
    failed: int = 0
    rerouted: int = 0
    statuses: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False
    signal: int | None = None      # the signal that stopped the run

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["skipped_target_newer_or_equal"] = d.pop("skipped")
        d["seconds"] = round(self.seconds, 3)
        return d


def parse_collection_map(texts: Iterable[str]) -> dict[str, str]:
    """SCOPE.COLL=SCOPE.COLL pairs; ValueError with the reason."""
    out = {}
    for text in texts:
        src, sep, dst = text.partition("=")
        for side in (src, dst):
            if not sep or side.count(".") != 1 or not all(side.split(".")):
                raise ValueError(f"{text!r} is not SCOPE.COLLECTION=SCOPE.COLLECTION")
        out[src] = dst
    return out


def target_ids(manifest: Manifest | None, mapping: dict[str, str], source: Manifest | None,
               cids: set[int]) -> dict[int, int]:
    """Source collection id -> target collection id; UnknownTargetCollection names what the
    target lacks. A collection not mapped keeps its name (and so its id when the source
    manifest is unknown)."""
    def target(name: str) -> int:
        scope, _, coll = name.partition(".")
        found = None if manifest is None else manifest.scopes.get(scope, (None, {}))[1].get(coll)
        if found is None:
            raise UnknownTargetCollection(f"collection {name} does not exist in the target bucket")
        return int(found)
    ids = {}
    for src, dst in mapping.items():
        scope, _, coll = src.partition(".")
        known = source or manifest
        sid = None if known is None else known.scopes.get(scope, (None, {}))[1].get(coll)
        if sid is None:
            raise UnknownTargetCollection(f"--collection-map: collection {src} is unknown to the capture")
        ids[sid] = target(dst)
    for cid in sorted(cids - set(ids)):
        if cid == 0:
            ids[0] = 0
            continue
        name = source.name_of(cid) if source is not None else (manifest.name_of(cid) if manifest else None)
        ids[cid] = target(name) if name is not None else _missing(cid)
    return ids


def _missing(cid: int) -> int:
    raise UnknownTargetCollection(f"collection id 0x{cid:x} of the capture does not exist in the target bucket")


def prepared(opts: RestoreOptions, docs: Iterable[Captured], ids: dict[int, int], counts: RestoreCounts) -> Iterator[Doc]:
    """kept() of the documents of `docs`."""
    return kept(opts, (c.doc for c in docs), ids, counts)


def kept(opts: RestoreOptions, docs: Iterable[Doc], ids: dict[int, int], counts: RestoreCounts) -> Iterator[Doc]:
    """The documents to write, counted: a passed expiry skipped (or, `replace_ttl`, none),
    the collection ids the target's (`ids`: target_ids)."""
    now = int(opts.now())
    for doc in docs:
        counts.documents += 1
        if not doc.deleted and doc.expiry and doc.expiry <= now:
            if not opts.replace_ttl:
                counts.expired += 1
                continue
            doc = doc._replace(expiry=0)
        cid = ids.get(doc.collection_id, doc.collection_id)
        yield doc if cid == doc.collection_id else doc._replace(collection_id=cid)


async def _write_all(cluster: KvCluster, slices: Iterator[list[Doc]], ids: dict[int, int], opts: RestoreOptions,
                     counts: RestoreCounts, stop: asyncio.Event, progress: Callable[[RestoreCounts], None]) -> None:
    """The documents a slice at a time (documents.Rows: read here, where the writes are, a
    short call each once the plan's first rows are in) into the cluster's pump, which keeps
    at most about `opts.inflight` of them submitted and not finished; the first error (a
    failed read of the capture raises from `slices`), or the stop event, ends the run."""
    loop = asyncio.get_running_loop()
    errors: list[BaseException] = []

    def done(doc: Doc, verdict: Verdict, status: int) -> None:
        if verdict is Verdict.WRITTEN:
            counts.written += 1
            counts.deleted += doc.deleted
        elif verdict is Verdict.SKIPPED:
            counts.skipped += 1
        else:
            counts.failed += 1
            name = f"0x{status:02x}" if status >= 0 else "no_answer"
            counts.statuses[name] = counts.statuses.get(name, 0) + 1
        progress(counts)

    def failed(exc: BaseException) -> None:
        errors.append(exc)
        stop.set()

    cluster.start_pump(done, failed)
    stopped: asyncio.Task[Any] = loop.create_task(stop.wait())
    try:
        for docs in slices:
            cluster.submit(kept(opts, docs, ids, counts))
            if not await _unless_stopped(cluster.room(opts.inflight), stopped):
                break
        else:
            await _unless_stopped(cluster.room(0), stopped)
    finally:
        stopped.cancel()
    if errors:
        raise errors[0]


async def _unless_stopped(aw: Awaitable[Any], stopped: asyncio.Task[Any]) -> bool:
    """Waits for `aw` unless the stop event comes first (then False; `aw` cancelled)."""
    task = asyncio.ensure_future(aw)
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        return False
    task.result()
    return True


def dry_run(opts: RestoreOptions, emit: Callable[[dict[str, Any]], None]) -> RestoreCounts:
    """What a restore would write, one dict per document (no connection is made)."""
    counts = RestoreCounts()
    start = time.monotonic()
    for doc in prepared(opts, select(opts.files, opts.as_of, opts.keys), {}, counts):
        emit({"key": doc.key.decode("utf-8", "replace"), "collection_id": doc.collection_id,
              "op": "delete" if doc.deleted else "set", "rev_seqno": doc.rev_seqno, "cas": doc.cas,
              "flags": doc.flags, "expiry": doc.expiry, "datatype": doc.datatype, "value_len": len(doc.value)})
    counts.seconds = time.monotonic() - start
    return counts


def restore(opts: RestoreOptions, *, progress: Callable[[RestoreCounts], None] = lambda c: None,
            signals: tuple[int, ...] = ()) -> RestoreCounts:
    """Write the documents; the counts (`interrupted` when one of `signals` ended the run:
    the caller reports, then exits as interrupted)."""
    return asyncio.run(_restore(opts, progress, signals))


async def _restore(opts: RestoreOptions, progress: Callable[[RestoreCounts], None],
                   signals: tuple[int, ...]) -> RestoreCounts:
    counts = RestoreCounts()
    start = time.monotonic()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    def stopped(signum: int) -> None:
        counts.signal = counts.signal or signum
        stop.set()
    for sig in signals:
        loop.add_signal_handler(sig, stopped, sig)
    cluster = KvCluster(opts.seeds, opts.bucket, opts.user, opts.password, tls=opts.tls, window=opts.window,
                        timeout=opts.timeout, force=opts.force)
    stop_wait: asyncio.Task[Any] = loop.create_task(stop.wait())
    opening = documents.Opening(opts.files, opts.as_of)
    try:
        # the capture opens in DuckDB and its plan runs to its first rows (a second or more)
        # while the target is bootstrapped
        opened = loop.run_in_executor(None, opening.run)
        try:
            await cluster.connect()
        except BaseException:
            opening.close()
            with contextlib.suppress(Exception):
                await opened
            raise
        await cluster.open_links()
        if await _unless_stopped(opened, stop_wait):
            cids, rows = opened.result()
            manifest = parse_manifest(cluster.manifest) if cluster.manifest else None
            ids = target_ids(manifest, opts.collection_map, None, cids)
            await _write_all(cluster, rows.slices(documents.key_matcher(opts.keys)), ids, opts, counts, stop,
                             progress)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        counts.rerouted = cluster.rerouted
        counts.seconds = time.monotonic() - start
        counts.interrupted = stop.is_set()
        stop_wait.cancel()
        opening.close()
        await cluster.close()
    return counts
