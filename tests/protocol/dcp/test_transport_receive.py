"""The transport's receive buffer (protocol/transport/dcp_client.py, ClientProtocol): a receive that
fills a good share of its buffer hands the buffer itself on (frames are slices of it, never
written again), a small one is copied out; a frame split anywhere across receives, and one
larger than the buffer, arrive whole and in order; a hostile length still ends the batch
after the frames before it."""

from __future__ import annotations

import asyncio
import random

import pytest

from dcptool.protocol.dcp.wire.constants import Opcode
from dcptool.protocol.dcp.wire.frames import encode_frame
from dcptool.protocol.errors import ErrorCode, RemoteError
from dcptool.protocol.transport import dcp_client as transport


class _Link:
    def stamp_sent(self, now):
        pass


class _Consumer:
    """What ClientProtocol asks of a consumer, recording what it is given."""
    finished = False
    should_pause = None

    def __init__(self):
        self.frames: list[bytes] = []
        self.link = _Link()

    def outgoing(self):
        return []

    def receive(self, buf, offsets, lengths, now):
        self.frames += [bytes(buf[o:o + n]) for o, n in zip(offsets.tolist(), lengths.tolist())]
        return []


class _Tap:
    def __init__(self):
        self.kept: list = []     # (buf, offsets, lengths) of every receive, kept past the call

    def on_received(self, buf, offsets, lengths, ts_ns, mono_ns):
        self.kept.append((buf, offsets.copy(), lengths.copy()))

    def on_sent(self, frame, ts_ns, mono_ns):
        pass


def _frames(rng: random.Random, count: int) -> list[bytes]:
    return [encode_frame(0x80, Opcode.DCP_MUTATION, vbucket_or_status=rng.randrange(4), opaque=1,
                         extras=bytes(31), key=b"k%d" % i, value=bytes([i % 251]) * rng.choice((10, 200, 5000)))
            for i in range(count)]


def _feed(chunks: list[bytes], max_body: int | None = None):
    """Each chunk as one receive (what recv_into wrote into get_buffer's view)."""
    async def run():
        cons, tap = _Consumer(), _Tap()
        kw = {} if max_body is None else {"max_body": max_body}
        proto = transport.ClientProtocol(cons, tap, None, **kw)
        for chunk in chunks:
            view = proto.get_buffer(-1)
            assert len(view) >= min(len(chunk), 65536)
            while len(view) < len(chunk):      # more than the buffer holds: two receives
                view[:] = chunk[:len(view)]
                proto.buffer_updated(len(view))
                chunk = chunk[len(view):]
                view = proto.get_buffer(-1)
            view[:len(chunk)] = chunk
            proto.buffer_updated(len(chunk))
        return cons, tap, proto
    return asyncio.run(run())


def _kept_frames(tap: _Tap) -> list[bytes]:
    return [bytes(buf[o:o + n]) for buf, offs, lens in tap.kept for o, n in zip(offs.tolist(), lens.tolist())]


def test_frames_split_anywhere_arrive_whole_and_kept_buffers_are_never_overwritten():
    rng = random.Random(26)
    frames = _frames(rng, 3000)
    stream = b"".join(frames)
    # receives of every size: a few bytes (inside a header), mid-body, and megabytes
    cuts, pos = [], 0
    while pos < len(stream):
        step = rng.choice((1, 7, 23, 300, 70_000, 2_500_000, 6_000_000))
        cuts.append(stream[pos:pos + step])
        pos += step
    cons, tap, _ = _feed(cuts)
    assert cons.frames == frames
    # every buffer the tap kept still holds its frames after all later receives
    assert _kept_frames(tap) == frames
    kinds = {type(buf) for buf, _, _ in tap.kept}
    assert kinds == {bytes, memoryview}           # small receives copied, big ones handed on
    handed = [buf for buf, _, _ in tap.kept if type(buf) is memoryview]
    assert all(buf.readonly for buf in handed)


def test_a_frame_larger_than_the_buffer_grows_it():
    big = encode_frame(0x80, Opcode.DCP_MUTATION, opaque=1, extras=bytes(31), key=b"big",
                       value=bytes(range(256)) * (transport.READ_BUFFER // 256 + 1000))
    small = _frames(random.Random(1), 3)
    stream = small[0] + big + small[1] + small[2]
    cons, tap, _ = _feed([stream[i:i + 1_000_000] for i in range(0, len(stream), 1_000_000)])
    assert cons.frames == [small[0], big, small[1], small[2]]
    assert _kept_frames(tap) == cons.frames


def test_a_hostile_length_ends_the_batch_after_the_frames_before_it():
    frames = _frames(random.Random(2), 50)
    bad = bytearray(frames[0])
    bad[8:12] = (1 << 30).to_bytes(4, "big")           # a body length above the cap
    cons, tap, proto = _feed([b"".join(frames) + bytes(bad) + frames[1]])
    assert cons.frames == frames and _kept_frames(tap) == frames
    with pytest.raises(RemoteError) as err:
        proto.done.result()
    assert err.value.code == ErrorCode.BODY_TOO_LARGE


def test_a_buffer_nothing_holds_any_more_is_received_into_again(monkeypatch):
    class Forgetful(_Tap):
        handed = 0

        def on_received(self, buf, offsets, lengths, ts_ns, mono_ns):
            self.handed += type(buf) is memoryview
            self.kept.append((bytes(buf), offsets.copy(), lengths.copy()))   # a copy: buf is let go

    allocated = []
    empty = transport.np.empty

    def counted(size, *a, **kw):
        allocated.append(size)
        return empty(size, *a, **kw)

    frames = _frames(random.Random(3), 20000)
    stream = b"".join(frames)
    step = 2_500_000
    tap = Forgetful()

    async def run():
        proto = transport.ClientProtocol(_Consumer(), tap, None)
        monkeypatch.setattr(transport.np, "empty", counted)
        for pos in range(0, len(stream), step):
            chunk = stream[pos:pos + step]
            view = proto.get_buffer(-1)
            view[:len(chunk)] = chunk
            del view
            proto.buffer_updated(len(chunk))
    asyncio.run(run())
    monkeypatch.undo()
    assert _kept_frames(tap) == frames
    assert tap.handed >= 10 and len(allocated) <= 3


def test_an_ack_held_back_at_the_consumers_look_goes_out_when_the_transport_does_not_pause():
    """The consumer holds its buffer ack back when the capture's queue is full at its look;
    if the queue has room by the transport's own look, nothing pauses, so the transport must
    send that ack at once (before, it waited for the next periodic check while the producer
    sat blocked on a full window)."""
    class Held(_Consumer):
        def __init__(self):
            super().__init__()
            self.looks = iter([True, False])    # full at the consumer's look, room at the transport's
            self.should_pause = lambda: next(self.looks)
            self.held = self.sent = False

        def receive(self, buf, offsets, lengths, now):
            super().receive(buf, offsets, lengths, now)
            self.held = self.should_pause()     # what consumer.flush_acks does on a full queue
            return []

        def flush_acks(self, check_pause=True):
            self.sent = self.held and not check_pause
            return self.sent

        def outgoing(self):
            return [b"ack"] if self.sent else []

    class Wire:
        def __init__(self):
            self.written: list[bytes] = []

        def write(self, data):
            self.written.append(data)

        def is_closing(self):
            return False

        def pause_reading(self):
            raise AssertionError("nothing asked to pause at the transport's look")

    async def run():
        cons, wire = Held(), Wire()
        proto = transport.ClientProtocol(cons, _Tap(), None)
        proto.transport = wire
        frame = _frames(random.Random(1), 1)[0]
        view = proto.get_buffer(-1)
        view[:len(frame)] = frame
        proto.buffer_updated(len(frame))
        return cons, wire
    cons, wire = asyncio.run(run())
    assert len(cons.frames) == 1
    assert wire.written == [b"ack"]
