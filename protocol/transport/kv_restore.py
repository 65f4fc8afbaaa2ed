"""The I/O of writing documents with their metadata into a bucket (`dcptool restore`): one
asyncio connection per KV node, the handshake of protocol/dcp/client/kv_writer.py, then
SET_WITH_META / DEL_WITH_META pipelined (up to `window` requests in flight per connection,
answers matched by opaque), routed by the cluster map.

Two paths write. The pump (`start_pump`, `submit`, `room`: what a restore's documents go
through) keeps a queue per link and tops each link's window up from it as answers arrive, the
frames of a turn joined into one send, an answer judged from its header (no message decoded):
a few microseconds a document. A write the pump cannot finish (no open link to the owner, a
NOT_MY_VBUCKET whose body holds no newer map, a temporary status, a link that closed with it
in flight or queued) goes to `write`, the per-document path below, which waits, asks the map
again and re-routes.

The map comes from GET_CLUSTER_CONFIG at bootstrap (a node with none: every vbucket is its,
the number of vbuckets from GET_ALL_VB_SEQNOS). NOT_MY_VBUCKET with a newer map in its body
applies it and re-routes the write; with none (or an older one) the map is asked again, with
a backoff (0.1 s doubling to 2 s). A connection that closes (a node that left the cluster in
a rebalance, failed over, restarted) fails its writes in flight, which are sent again after
the map is asked again: a write with meta is idempotent (a repeat that the target already
holds is KEY_EEXISTS), so a rebalance during a restore loses nothing. A write that finds no
owner within `timeout` fails the run."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
import zlib
from typing import Callable, Iterable

from dcptool.protocol.dcp.client import kv_writer
from dcptool.protocol.dcp.client.kv_writer import Bootstrap, Doc, Handshake, Verdict
from dcptool.protocol.dcp.wire import cluster_config
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.cluster_config import ClusterConfig
from dcptool.protocol.dcp.wire.constants import (
    Feature,
    Opcode,
    Status,
)
from dcptool.protocol.dcp.wire.frames import FrameParser, parse_frame
from dcptool.protocol.errors import (
    ConnectFailed,
    ConnectionLost,
    DcptoolError,
    ErrorCode,
    RemoteError,
)

HANDSHAKE_TIMEOUT = 10.0
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 2.0
_FINAL = frozenset({Verdict.WRITTEN, Verdict.SKIPPED, Verdict.FAILED})
Done = Callable[[Doc, Verdict, int], None]          # a document's outcome: (doc, verdict, status)
# a pump's write answered: ((doc, vbucket), status, the whole answer frame when not a success)
Answered = tuple[tuple[Doc, int], int, bytes]


class KvLink:
    """One KV connection after its handshake: `call(message)` sends a request and waits for
    its answer; at most `window` requests are in flight."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str, window: int,
                 boot: Bootstrap):
        self.reader, self.writer, self.address, self.boot = reader, writer, address, boot
        self.window = asyncio.Semaphore(window)
        self.pending: dict[int, asyncio.Future[m.Message]] = {}
        self.opaque = 1 << 20
        self.closed: BaseException | None = None
        self.collections = Feature.COLLECTIONS in boot.features
        self.out: list[bytes] = []          # frames of this loop turn, written together (one send)
        # the pump's writes (KvCluster.submit): queued, then in flight by opaque; what is
        # answered, or left when the link fails, goes to the cluster's hooks
        self.queue: collections.deque[tuple[Doc, int]] = collections.deque()
        self.fast: dict[int, tuple[Doc, int]] = {}
        self.on_answers: Callable[[KvLink, list[Answered]], None] | None = None
        self.on_lost: Callable[[KvLink, list[tuple[Doc, int]]], None] | None = None
        self.task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, host: str, port: int, hs: Handshake, *, tls: ssl.SSLContext | None, window: int,
                   timeout: float = HANDSHAKE_TIMEOUT) -> "KvLink":
        address = f"{host}:{port}"
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=tls), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {address}: {exc or 'timed out'}") from None
        try:
            await asyncio.wait_for(_handshake(reader, writer, hs), timeout)
        except asyncio.TimeoutError:
            writer.close()
            raise RemoteError(ErrorCode.TIMEOUT, f"{address}: no answer to the handshake in {timeout:g} s") from None
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, address, window, hs.result)

    async def _read(self) -> None:
        buf = bytearray()
        try:
            while True:
                data = await self.reader.read(1 << 18)
                if not data:
                    raise ConnectionLost(f"{self.address} closed the connection")
                buf += data
                bounds, consumed, err = kv_writer.split_answers(buf)
                self._frames(buf, bounds)
                del buf[:consumed]
                if err is not None:
                    raise err
        except (OSError, DcptoolError, asyncio.IncompleteReadError) as exc:
            self._fail(exc if isinstance(exc, DcptoolError) else ConnectionLost(f"{self.address}: {exc}"))
        except asyncio.CancelledError:
            self._fail(ConnectionLost(f"{self.address}: closed"))
            raise

    def _frames(self, buf: bytearray, bounds: list[tuple[int, int, int, int]]) -> None:
        """The whole frames read: an answer to one of the pump's writes judged from its header
        (its body kept only when it is not a success: a NOT_MY_VBUCKET's map), the others
        decoded for `call`."""
        fast, answered, magics = self.fast, [], kv_writer.ANSWER_MAGICS
        for pos, length, opaque, status in bounds:
            write = fast.pop(opaque, None) if buf[pos] in magics else None
            if write is not None:
                answered.append((write, status, b"" if status == 0 else bytes(buf[pos:pos + length])))
                continue
            msg = m.decode(parse_frame(buf, pos, length), self.collections)
            fut = self.pending.pop(msg.opaque, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        if answered and self.on_answers is not None:
            self.on_answers(self, answered)

    def _fail(self, exc: BaseException) -> None:
        self.closed = exc
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self.pending.clear()
        left = list(self.fast.values()) + list(self.queue)
        self.fast.clear()
        self.queue.clear()
        if left and self.on_lost is not None:
            self.on_lost(self, left)

    def next_opaque(self) -> int:
        self.opaque = (self.opaque + 1) & 0xFFFFFFFF
        return self.opaque

    def send_bytes(self, data: bytes) -> None:
        """Frames written now, in one send (the pump's)."""
        if data and self.closed is None and not self.writer.is_closing():
            self.writer.write(data)

    async def call(self, build: Callable[[int], bytes]) -> m.Message:
        """`build(opaque)` gives the frame; its answer."""
        async with self.window:
            if self.closed is not None:
                raise self.closed
            opaque = self.next_opaque()
            fut: asyncio.Future[m.Message] = asyncio.get_running_loop().create_future()
            self.pending[opaque] = fut
            if not self.out:
                asyncio.get_running_loop().call_soon(self._flush)
            self.out.append(build(opaque))
            if self.writer.transport.get_write_buffer_size() > 1 << 20:
                await self.writer.drain()
            return await fut

    def _flush(self) -> None:
        if self.out and self.closed is None and not self.writer.is_closing():
            self.writer.write(b"".join(self.out))
        self.out.clear()

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hs: Handshake) -> None:
    parser = FrameParser()
    out: bytes | None = hs.start()
    while not hs.done:
        if out:
            writer.write(out)
            await writer.drain()
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionLost("the server closed the connection during the handshake")
        for fr in parser.feed(data):
            out = hs.feed(m.decode(fr))
            if hs.done:
                break


class KvCluster:
    """The target bucket: a link per node of the map, each write routed to its vbucket's
    active node (see the module)."""

    def __init__(self, seeds: list[tuple[str, int]], bucket: str, user: str | None, password: str | None, *,
                 tls: ssl.SSLContext | None = None, window: int = 64, timeout: float = 30.0, force: bool = False):
        self.seeds, self.bucket, self.user, self.password = seeds, bucket, user, password
        self.tls, self.window, self.timeout, self.force = tls, window, timeout, force
        self.links: dict[str, KvLink] = {}
        self.config: ClusterConfig | None = None
        self.num_vbuckets = 0
        self.manifest = b""
        self.rerouted = 0
        self._opening: dict[str, asyncio.Task[KvLink]] = {}
        self._asking: asyncio.Task[None] | None = None
        self.seed_only: str | None = None        # the node of a bucket without a map
        self._owners: list[str | None] | None = None    # owner() of each vbucket, until the map moves
        self._links_by_vb: list[KvLink | None] | None = None     # their links (_vb_links)
        # the pump (start_pump): documents submitted and not finished, the hooks, the waits
        self.outstanding = 0
        self._done: Done | None = None
        self._failed: Callable[[BaseException], None] | None = None
        self._slow: set[asyncio.Task[None]] = set()
        self._room: asyncio.Future[None] | None = None
        self._room_at = 0
        self.closing = False

    def _handshake(self) -> Handshake:
        return Handshake(self.bucket, self.user, self.password, allow_plain=self.tls is not None)

    async def connect(self) -> None:
        """Bootstrap from the first seed that answers: the map, the manifest, the vbuckets."""
        last: BaseException | None = None
        for host, port in self.seeds:
            try:
                link = await KvLink.open(host, port, self._handshake(), tls=self.tls, window=self.window)
            except (ConnectFailed, ConnectionLost, RemoteError) as exc:
                last = exc
                continue
            self.links[link.address] = self._adopt(link)
            self.manifest = link.boot.manifest
            if link.boot.config:
                self._apply(link.boot.config, host)
            if self.config is None:
                self.num_vbuckets = await self._count_vbuckets(link)
                self.seed_only = link.address
            self._owners = None
            return
        raise last if last is not None else ConnectFailed("no seed to connect to")

    async def _count_vbuckets(self, link: KvLink) -> int:
        rsp = await link.call(lambda o: m.encode(m.GetAllVbSeqnos(opaque=o)))
        if isinstance(rsp, m.GetAllVbSeqnosResponse) and rsp.seqnos:
            return len(rsp.seqnos)
        raise RemoteError(ErrorCode.UNSUPPORTED, f"{link.address} has no cluster map and does not list its vbuckets")

    def _apply(self, raw: bytes, host_used: str) -> bool:
        try:
            cfg = cluster_config.parse(raw, host_used)
        except DcptoolError:
            return False
        if not cluster_config.newer(cfg, self.config) and self.config is not None:
            return False
        self.config = cfg
        self.num_vbuckets = cfg.num_vbuckets
        self._owners = self._links_by_vb = None
        return True

    def owner(self, vb: int) -> str | None:
        if self.config is None:
            return self.seed_only
        node = self.config.active_node(vb)
        if node is None:
            return None
        host, port = node.kv_address(self.tls is not None)
        return None if port is None else f"{host}:{port}"

    async def link_to(self, address: str) -> KvLink:
        link = self.links.get(address)
        if link is not None and link.closed is None:
            return link
        task = self._opening.get(address)
        if task is None:
            host, _, port = address.rpartition(":")
            task = asyncio.get_running_loop().create_task(
                KvLink.open(host.strip("[]"), int(port), self._handshake(), tls=self.tls, window=self.window))
            self._opening[address] = task
        try:
            link = await task
        finally:
            self._opening.pop(address, None)
        self.links[address] = self._adopt(link)
        return link

    def _adopt(self, link: KvLink) -> KvLink:
        link.on_answers, link.on_lost = self._answers, self._lost
        self._links_by_vb = None
        return link

    async def open_links(self) -> None:
        """A link to every node that owns a vbucket, the handshakes at once (the pump writes
        only on open links); one that does not open is left to `write`."""
        async def one(address: str) -> None:
            with contextlib.suppress(ConnectFailed, ConnectionLost, RemoteError):
                await self.link_to(address)
        await asyncio.gather(*(one(a) for a in sorted({a for a in self._owner_list() if a is not None})))

    async def ask_config(self) -> None:
        """GET_CLUSTER_CONFIG from any live link (one request at a time however many ask)."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.get_running_loop().create_task(self._ask())
        with contextlib.suppress(Exception):
            await asyncio.shield(self._asking)

    async def _ask(self) -> None:
        for address in list(self.links) + [f"{h}:{p}" for h, p in self.seeds]:
            try:
                link = await self.link_to(address)
                rsp = await link.call(lambda o: m.encode(m.Request(opcode=Opcode.GET_CLUSTER_CONFIG, opaque=o)))
            except (ConnectFailed, ConnectionLost, RemoteError):
                continue
            if getattr(rsp, "status", 1) == Status.SUCCESS:
                self._apply(bytes(getattr(rsp, "value", b"")), address.rpartition(":")[0])
                return

    async def write(self, doc: Doc, after: Verdict | None = None) -> tuple[Verdict, int]:
        """One document written to its vbucket's owner, re-routed as the map moves: (the
        verdict, the status). `after` RETRY or REROUTE: the pump's try was answered so, the
        wait (and the map asked again) comes first."""
        vb = kv_writer.vbucket_of(doc.key, self.num_vbuckets)
        start = time.monotonic()
        backoff = BACKOFF_FIRST
        if after in (Verdict.RETRY, Verdict.REROUTE):
            await asyncio.sleep(backoff)
            backoff *= 2
            if after is Verdict.REROUTE:
                await self.ask_config()
        while True:
            address = self.owner(vb)
            status = -1
            try:
                if address is None:
                    raise ConnectionLost(f"no node owns vbucket {vb}")
                link = await self.link_to(address)
                if doc.collection_id and not link.collections:
                    return Verdict.FAILED, Status.UNKNOWN_COLLECTION    # the node speaks no collections
                rsp = await link.call(lambda o: kv_writer.write_frame(doc, vbucket=vb, opaque=o, force=self.force,
                                                                      collections=link.collections))
                status = getattr(rsp, "status", Status.EINTERNAL)
                verdict = kv_writer.verdict(status)
                if verdict not in (Verdict.REROUTE, Verdict.RETRY):
                    return verdict, status
                if verdict is Verdict.REROUTE:
                    self.rerouted += 1
                    if self._apply(bytes(getattr(rsp, "value", b"")), address.rpartition(":")[0]):
                        continue            # the body held a newer map: at once to the new owner
            except (ConnectFailed, ConnectionLost, RemoteError) as exc:   # a node gone, hung or restarting
                if time.monotonic() - start > self.timeout:
                    raise ConnectionLost(f"vbucket {vb} could not be written for {self.timeout:g} s: "
                                         f"{exc}") from None
            if time.monotonic() - start > self.timeout:
                return Verdict.FAILED, status
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)
            await self.ask_config()

    # ---- the pump (see the module)
    def start_pump(self, done: Done, failed: Callable[[BaseException], None]) -> None:
        """`done(doc, verdict, status)` for each document submitted, once; `failed(error)`
        when one cannot be written at all (no owner within `timeout`)."""
        self._done, self._failed = done, failed

    def _owner_list(self) -> list[str | None]:
        if self._owners is None:
            self._owners = [self.owner(vb) for vb in range(self.num_vbuckets)]
        return self._owners

    def submit(self, docs: Iterable[Doc]) -> None:
        """Documents to write: each queued on its owner's link (`write` when there is no
        open one), each link's window topped up at once."""
        links = self._vb_links()
        nvb, crc, n = self.num_vbuckets, zlib.crc32, 0
        for doc in docs:
            n += 1
            vb = ((crc(doc.key) >> 16) & 0x7FFF) % nvb      # kv_writer.vbucket_of
            link = links[vb]
            if link is None or link.closed is not None or (doc.collection_id and not link.collections):
                self._write_slowly(doc)
            else:
                link.queue.append((doc, vb))
        self.outstanding += n
        for link in list(self.links.values()):
            if link.queue:
                self._fill(link)

    def _vb_links(self) -> list[KvLink | None]:
        """Each vbucket's owner's link (None: not open), until the map or the links change."""
        if self._links_by_vb is None or any(link.closed is not None for link in self._links_by_vb if link):
            owners = self._owner_list()
            self._links_by_vb = [self.links.get(a) if a is not None else None for a in owners]
        return self._links_by_vb

    def _fill(self, link: KvLink) -> None:
        """As many queued writes as the link's window has room for, in one send."""
        queue, fast = link.queue, link.fast
        n = min(self.window - len(fast), len(queue))
        if n <= 0 or link.closed is not None:
            return
        writes = [queue.popleft() for _ in range(n)]
        first = (link.opaque + 1) & 0xFFFFFFFF
        for i, write in enumerate(writes):
            fast[(first + i) & 0xFFFFFFFF] = write
        link.opaque = (first + n - 1) & 0xFFFFFFFF
        link.send_bytes(kv_writer.write_frames(writes, first, force=self.force, collections=link.collections))

    def _answers(self, link: KvLink, answered: list[Answered]) -> None:
        done, written = self._done, Verdict.WRITTEN
        for write, status, frame in answered:
            if status == 0:                     # (the common case at once)
                self.outstanding -= 1
                if done is not None:
                    done(write[0], written, 0)
                continue
            verdict = kv_writer.verdict(status)
            if verdict in _FINAL:
                self._finish(write[0], verdict, status)
            elif verdict is Verdict.REROUTE:
                self.rerouted += 1
                value = getattr(m.decode_bytes(frame), "value", b"") if frame else b""
                if self._apply(bytes(value), link.address.rpartition(":")[0]):
                    self.outstanding -= 1           # the body held a newer map: at once to the new owner
                    self.submit([write[0]])
                else:
                    self._write_slowly(write[0], verdict)
            else:
                self._write_slowly(write[0], verdict)
        self._wake()
        self._fill(link)

    def _lost(self, link: KvLink, writes: list[tuple[Doc, int]]) -> None:
        if not self.closing:
            for doc, _vb in writes:
                self._write_slowly(doc)

    def _write_slowly(self, doc: Doc, after: Verdict | None = None) -> None:
        task = asyncio.get_running_loop().create_task(self._slowly(doc, after))
        self._slow.add(task)
        task.add_done_callback(self._slow.discard)

    async def _slowly(self, doc: Doc, after: Verdict | None) -> None:
        try:
            verdict, status = await self.write(doc, after)
        except DcptoolError as exc:
            if self._failed is not None:
                self._failed(exc)
            return
        self._finish(doc, verdict, status)

    def _finish(self, doc: Doc, verdict: Verdict, status: int) -> None:
        self.outstanding -= 1
        if self._done is not None:
            self._done(doc, verdict, status)
        self._wake()

    def _wake(self) -> None:
        room = self._room
        if room is not None and self.outstanding <= self._room_at and not room.done():
            room.set_result(None)

    async def room(self, limit: int) -> None:
        """Until at most `limit` submitted documents are not finished (0: all are)."""
        while self.outstanding > limit:
            self._room_at = limit
            self._room = asyncio.get_running_loop().create_future()
            await self._room

    async def close(self) -> None:
        self.closing = True
        for task in list(self._slow):
            task.cancel()
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()
