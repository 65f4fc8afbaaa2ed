"""A hostile DCP server for the tests: plain blocking sockets on 127.0.0.1, one thread per
connection, scripted by keyword arguments. By default it is a small well-behaved producer
(HELLO, SASL SCRAM, SELECT_BUCKET, GET_ALL_VB_SEQNOS, DCP_OPEN, DCP_CONTROL, STREAM_REQ
answered with a snapshot and `items` mutations per vbucket); each knob turns one step
hostile:

- `silent_at=OPCODE`: never answer that request (0: say nothing at all after accept)
- `half_frame_at=OPCODE`: answer it with a header announcing 20 MiB, then 1 byte per `drip`
- `sasl_endless`: answer every SASL step with AUTH_CONTINUE
- `iterations=N`: the SCRAM iteration count announced in server-first
- `mechs=b"..."`: the SASL mechanism list
- `refuse_controls={"enable_noop", ...}`: DCP_CONTROL keys answered NOT_SUPPORTED
- `inject=[frame or f(opaque) -> frame, ...]`: raw frames sent after the items of vbucket
  0's first stream (instead of its STREAM_END)
- `seqnos=[(vb, seqno), ...]`: the GET_ALL_VB_SEQNOS answer (default: every vbucket)
- `end_streams`: send STREAM_END after the items (False: stay silent, as `--to forever`)

Every wait in it is bounded and `stop()` ends every thread (tests use it as a context
manager)."""

from __future__ import annotations

import base64
import os
import socket
import struct
import threading

from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.frames import FrameParser
from dcptool.protocol.dcp.wire.sasl import GS2_HEADER

SUCCESS, AUTH_CONTINUE, NOT_SUPPORTED = 0x00, 0x21, 0x83
UUID = 0xABCDEF


def half_frame() -> bytes:
    """A mutation header announcing 20 MiB of body, and one byte of it."""
    return struct.pack(">BBHBBHIIQ", 0x80, 0x57, 3, 31, 0, 0, 20 * 1024 * 1024, 0, 0) + b"x"


def mutation(vb: int, seqno: int, key: bytes, opaque: int, value: bytes = b"{}") -> bytes:
    return m.encode(m.Mutation(vbucket=vb, key=key, value=value, by_seqno=seqno, rev_seqno=1,
                               opaque=opaque, datatype=0x01))


class HostileDcp:
    def __init__(self, *, vbuckets: int = 2, items: int = 3, silent_at: int | None = None,
                 half_frame_at: int | None = None, drip: float = 1.0, sasl_endless: bool = False,
                 iterations: int = 4096, mechs: bytes = b"SCRAM-SHA512 SCRAM-SHA256 SCRAM-SHA1",
                 refuse_controls=(), inject=(), seqnos=None, end_streams: bool = True):
        self.vbuckets, self.items = vbuckets, items
        self.silent_at, self.half_frame_at, self.drip = silent_at, half_frame_at, drip
        self.sasl_endless, self.iterations, self.mechs = sasl_endless, iterations, mechs
        self.refuse_controls = set(refuse_controls)
        self.inject = list(inject)
        self.seqnos = seqnos
        self.end_streams = end_streams
        self.connections = 0
        self.requests: list[int] = []        # opcodes received, in order, all connections
        self.sasl_rounds = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self._listener.settimeout(0.2)
        self.host, self.port = self._listener.getsockname()
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    @property
    def url(self) -> str:
        return f"couchbase://{self.host}:{self.port}/default"

    # ---- lifecycle
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for s in self._socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self._listener.close()
        for t in self._threads:
            t.join(5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                s, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            s.settimeout(0.2)
            with self._lock:
                self.connections += 1
                self._socks.append(s)
            t = threading.Thread(target=self._serve, args=(s,), daemon=True)
            t.start()
            self._threads.append(t)

    # ---- one connection
    def _serve(self, s: socket.socket) -> None:
        parser = FrameParser()
        self._scram_nonce = b""
        try:
            while not self._stop.is_set():
                try:
                    data = s.recv(65536)
                except socket.timeout:
                    continue
                if not data:
                    return
                if self.silent_at == 0:
                    continue   # accept, read, never say a word
                for f in parser.feed(data):
                    if f.is_response:
                        continue
                    self.requests.append(f.opcode)
                    if self.silent_at is not None and f.opcode == self.silent_at:
                        continue
                    if self.half_frame_at is not None and f.opcode == self.half_frame_at:
                        self._dribble(s, f)
                        return
                    s.sendall(self._answer(f))
        except Exception:  # noqa: BLE001 - the client went away, or sent what we cannot parse
            return

    def _dribble(self, s: socket.socket, f) -> None:
        """A response header announcing 20 MiB, then one byte per `drip` seconds."""
        header = struct.pack(">BBHBBHIIQ", 0x81, f.opcode, 0, 0, 0, 0, 20 * 1024 * 1024, f.opaque, 0)
        s.sendall(header)
        while not self._stop.wait(self.drip):
            s.sendall(b"x")

    def _rsp(self, f, status: int = SUCCESS, value: bytes = b"") -> bytes:
        return m.encode(m.Response(opcode=f.opcode, opaque=f.opaque, status=status, value=value))

    def _answer(self, f) -> bytes:
        op = f.opcode
        if op == 0x1F:
            return m.encode(m.HelloResponse(opaque=f.opaque, features=()))
        if op == 0x20:
            return self._rsp(f, value=self.mechs)
        if op in (0x21, 0x22):
            return self._sasl(f)
        if op == 0x48:
            seqnos = tuple(self.seqnos or ((vb, self.items) for vb in range(self.vbuckets)))
            return m.encode(m.GetAllVbSeqnosResponse(opaque=f.opaque, seqnos=seqnos))
        if op == 0x5E:
            refused = f.key.decode() in self.refuse_controls
            return self._rsp(f, NOT_SUPPORTED if refused else SUCCESS)
        if op == 0x53:
            return self._stream(f)
        if op == 0x52:
            return self._rsp(f) + m.encode(m.StreamEnd(vbucket=f.vbucket_or_status, reason=1))
        if op in (0x5C, 0x5D):
            return b""
        return self._rsp(f)   # SELECT_BUCKET, DCP_OPEN and anything else: success

    def _sasl(self, f) -> bytes:
        self.sasl_rounds += 1
        if f.opcode == 0x21:
            cnonce = dict(p.split(b"=", 1) for p in f.value[len(GS2_HEADER):].split(b",")).get(b"r", b"")
            self._scram_nonce = cnonce + base64.b64encode(os.urandom(9))
        server_first = (b"r=" + self._scram_nonce + b",s=" + base64.b64encode(b"salty-salt")
                        + b",i=" + str(self.iterations).encode())
        if f.opcode == 0x21 or self.sasl_endless:
            return self._rsp(f, AUTH_CONTINUE, server_first)
        return self._rsp(f, 0x20)   # a well-formed final needs the password: refuse instead

    def _stream(self, f) -> bytes:
        vb = f.vbucket_or_status
        start = m.decode(f).start_seqno
        out = [m.encode(m.StreamRequestResponse(opaque=f.opaque, failover_log=((UUID, 0),)))]
        if start < self.items:
            out.append(m.encode(m.SnapshotMarker(vbucket=vb, opaque=f.opaque, snap_start=start + 1,
                                                 snap_end=self.items, snap_flags=1)))
        for seq in range(start + 1, self.items + 1):
            out.append(mutation(vb, seq, f"vb{vb}-k{seq}".encode(), f.opaque))
        if vb == 0 and self.inject and start == 0:
            out.extend(x(f.opaque) if callable(x) else x for x in self.inject)
        elif self.end_streams:
            out.append(m.encode(m.StreamEnd(vbucket=vb, opaque=f.opaque, reason=0)))
        return b"".join(out)
