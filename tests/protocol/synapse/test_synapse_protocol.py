"""Synapse commands, framing, row layouts and the client state machine, on the real lines
recorded from Synapse 1.163.2 (fixtures/synapse) and on hand-made edge cases."""

from __future__ import annotations

import collections

import pytest

from dcptool.protocol.errors import ErrorCode, ProtocolError, RemoteError
from dcptool.protocol.synapse import commands as C
from dcptool.protocol.synapse.bulk import split_lines
from dcptool.protocol.synapse.client import Gap, SynapseClient, effective_tokens
from dcptool.protocol.synapse.framing import MAX_LINE, LineFramer
from dcptool.protocol.synapse.rows import STREAM_FIELDS, decode_row
from dcptool.protocol.synapse.server import (
    Feed,
    ServerConnection,
    generated_lines,
    recorded_lines,
)
from tests.support.paths import FIXTURES

FIX = FIXTURES / "synapse"
REDIS_TSV = FIX / "synapse-1.163.2-redis-lines.tsv"
TCP_TXT = FIX / "synapse-1.163.2-tcp-session.txt"


def redis_lines() -> list[tuple[str, str]]:
    out = []
    for raw in REDIS_TSV.read_text(encoding="utf-8").split("\n"):
        if raw:
            _, channel, line = raw.split("\t", 2)
            out.append((channel, line))
    return out


def tcp_lines() -> list[tuple[str, str]]:
    out = []
    for raw in TCP_TXT.read_text(encoding="utf-8").split("\n"):
        if raw:
            _, arrow, line = raw.split(" ", 2)
            out.append((arrow, line))
    return out


def all_real_lines() -> list[str]:
    return [line for _, line in redis_lines()] + [line for _, line in tcp_lines()]


def test_vectors_are_what_the_readme_says():
    assert len(redis_lines()) == 128
    assert len(tcp_lines()) == 42


@pytest.mark.parametrize("line", all_real_lines())
def test_every_real_line_parses_and_reencodes_exactly(line):
    cmd = C.parse_line(line)
    assert not isinstance(cmd, C.Unknown)
    assert C.format_line(cmd) == line
    assert C.parse_line(C.format_line(cmd)) == cmd
    assert C.encode_line(cmd) == line.encode() + b"\n"


def test_real_command_counts_and_fields():
    counts = collections.Counter(C.parse_line(line).NAME for line in all_real_lines())
    assert counts == {"POSITION": 90, "RDATA": 41, "LOCK_RELEASED": 18, "PING": 15,
                      "REPLICATE": 4, "NAME": 1, "SERVER": 1}
    first_rdata = next(C.parse_line(l) for _, l in redis_lines() if l.startswith("RDATA"))
    assert first_rdata == C.Rdata("device_lists", "master", 2, '["@alice:localhost",false,0]')
    assert first_rdata.row == ["@alice:localhost", False, 0]
    pos = C.parse_line("POSITION events master 14 14")
    assert (pos.stream, pos.instance, pos.prev_token, pos.new_token) == ("events", "master", 14, 14)
    lock = C.parse_line(next(l for _, l in redis_lines() if l.startswith("LOCK_RELEASED")))
    assert lock.fields["lock_name"] == "new_event_during_purge_lock"


def test_replicate_keeps_its_trailing_space():
    # Synapse publishes "REPLICATE " (empty argument); a bare "REPLICATE" also occurs.
    assert C.parse_line("REPLICATE ") == C.Replicate(True)
    assert C.parse_line("REPLICATE") == C.Replicate(False)
    assert C.format_line(C.Replicate(True)) == "REPLICATE "
    assert C.format_line(C.Replicate(False)) == "REPLICATE"


def test_every_defined_command_round_trips():
    cmds = [
        C.Server("example.org"), C.Rdata.make("typing", "master", 3, ["!r:x", ["@a:x"]]),
        C.Rdata("events", "w1", None, '["state-all",["!r:x"]]'),
        C.Position("caches", "master", 0, 7), C.Error("bad thing"), C.Ping("1795339218912"),
        C.Name("worker1"), C.Replicate(), C.UserSync("i1", "@a:x", None, True, 17),
        C.UserSync("i1", "@a:x", "DEV", False, 18), C.ClearUserSync("i1"),
        C.FederationAck("fed1", 99),
        C.UserIp.make("@a:x", "syt_secret", "127.0.0.1", "curl/8", "DEV", 1234),
        C.RemoteServerUp("other.org"), C.LockReleased('["master","lock","key"]'),
        C.NewActiveTask("task1"), C.CancelTask("task2"),
    ]
    assert {type(c).NAME for c in cmds} == set(C.COMMANDS)
    for cmd in cmds:
        line = C.format_line(cmd)
        assert C.parse_line(line) == cmd, line
    assert C.format_line(C.UserSync("i1", "@a:x", None, True, 17)) == "USER_SYNC i1 @a:x None start 17"
    assert C.redis_channel(cmds[12], "hs") == "hs/USER_IP"
    assert C.redis_channel(cmds[0], "hs") == "hs"


def test_unknown_command_is_kept():
    cmd = C.parse_line("FROBNICATE a b c")
    assert cmd == C.Unknown("FROBNICATE", "a b c")
    assert cmd.NAME == "FROBNICATE"
    assert C.format_line(cmd) == "FROBNICATE a b c"
    assert C.format_line(C.parse_line("WORD")) == "WORD"


@pytest.mark.parametrize("line", [
    "RDATA events master", "RDATA events master 1x []", "POSITION a b 1", "POSITION a b 1 x",
    "USER_SYNC i u d middle 5", "FEDERATION_ACK a", "USER_IP @u notjson",
    "USER_IP @u [1,2]", "LOCK_RELEASED [1]", "SERVER", "POSITION a b 01 2",
])
def test_bad_arguments_are_coded_remote_errors(line):
    with pytest.raises(RemoteError) as info:
        C.parse_line(line)
    assert info.value.code == ErrorCode.BAD_COMMAND


def test_user_ip_access_token_is_masked():
    line = C.format_line(C.UserIp.make("@a:x", "syt_abc", "1.2.3.4", "ua", "D", 5)).encode()
    red = C.redact_user_ip(line)
    assert red == b'USER_IP @a:x ["*******","1.2.3.4","ua","D",5]'
    assert len(red) == len(line)
    assert C.redact_user_ip(b"PING 1") == b"PING 1"


# -- framing ------------------------------------------------------------------------------

def test_framer_whole_bytewise_and_followed():
    data = "".join(l + "\n" for l in all_real_lines()).encode()
    whole = LineFramer().feed(data)
    assert [l.decode() for l in whole] == all_real_lines()
    f = LineFramer()
    bytewise = [line for i in range(len(data)) for line in f.feed(data[i:i + 1])]
    assert bytewise == whole
    f = LineFramer()
    assert f.feed(b"PING 1\nPI") == [b"PING 1"]
    assert f.pending == 2
    assert f.feed(b"NG 2\n") == [b"PING 2"]


def test_framer_line_over_the_cap_keeps_what_came_before():
    f = LineFramer(max_line=16)
    lines = f.feed(b"PING 1\nPING 2\n" + b"R" * 17 + b"\nPING 3\n")
    assert lines == [b"PING 1", b"PING 2"]
    assert f.error.code == ErrorCode.LINE_TOO_LONG
    assert f.overlong == b"R" * 17
    assert f.feed(b"PING 4\n") == []
    # exactly the cap is fine; the cap is checked before the newline arrives too
    assert LineFramer(max_line=16).feed(b"X" * 16 + b"\n") == [b"X" * 16]
    g = LineFramer(max_line=16)
    assert g.feed(b"X" * 17) == [] and g.error.code == ErrorCode.LINE_TOO_LONG
    assert LineFramer().max_line == MAX_LINE == 16384


def test_invalid_utf8_is_kept_raw():
    f = LineFramer()
    assert f.feed(b"RDATA a b 1 [\"\xff\"]\n") == [b'RDATA a b 1 ["\xff"]']


# -- rows -----------------------------------------------------------------------------------

def test_rows_of_real_lines_decode_into_named_fields():
    decoded = {}
    for line in all_real_lines():
        cmd = C.parse_line(line)
        if isinstance(cmd, C.Rdata):
            fields = decode_row(cmd.stream, cmd.row_json)
            assert not any(k.startswith("field") for k in fields), (line, fields)
            decoded.setdefault((cmd.stream, fields.get("row_type")), fields)
    assert decoded[("events", "ev")]["event_id"].startswith("$")
    assert decoded[("events", "ev")]["rejected"] == 0
    assert decoded[("events", "state")]["type"] == "m.room.create"
    assert decoded[("receipts", None)]["data"] == {"ts": 1795339095623}
    assert decoded[("presence", None)]["currently_active"] == 0
    assert decoded[("typing", None)]["user_ids"] == ["@bob:localhost"]
    assert decoded[("device_lists", None)] == {"user_id": "@alice:localhost",
                                               "is_signature": False, "hosts_calculated": 0}
    assert decoded[("account_data", None)]["data_type"] == "org.example.probe"
    assert decoded[("to_device", None)] == {"entity": "@bob:localhost"}
    assert decode_row("events", '["state-all",["!r"]]') == {"row_type": "state-all", "room_id": "!r"}
    assert decode_row("new_stream", '[1,2]') == {"field0": 1, "field1": 2}
    assert "quarantined_media" in STREAM_FIELDS


# -- the client state machine --------------------------------------------------------------

def test_batch_rows_get_the_token_of_the_next_numeric_rdata():
    rdata = [C.parse_line(l) for _, l in redis_lines() if l.startswith("RDATA")]
    tokens = effective_tokens(rdata)
    assert None not in tokens
    batch_rows = [(r, t) for r, t in zip(rdata, tokens) if r.token is None]
    assert len(batch_rows) == 10
    for i, (r, t) in enumerate(zip(rdata, tokens)):
        if r.token is None:
            nxt = next(x for x in rdata[i + 1:] if (x.stream, x.instance) == (r.stream, r.instance)
                       and x.token is not None)
            assert t == nxt.token
    # the room's five state rows of the power_levels batch all land on token 4
    assert sum(1 for r, t in batch_rows if t == 4) == 5
    assert effective_tokens([C.Rdata("a", "b", None, "[]")]) == [None]


def test_client_tracks_committed_tokens_on_the_real_redis_lines():
    c = SynapseClient("probe", keepalive=False)
    lines = [l.encode() for _, l in redis_lines()]
    events = c.receive(lines, 0.0)
    assert events == [] and c.gaps == []
    got = c.committed()
    assert got[("events", "master")] == 14
    assert got[("device_lists", "master")] == 5
    assert got[("presence", "master")] == 4
    assert c.pending() == {}
    assert ("quarantined_media", "master") in c.positions_seen


def test_client_pending_batch_until_numeric_and_dropped_on_reconnect():
    c = SynapseClient(keepalive=False, committed={("events", "m"): 4})
    c.receive([b'RDATA events m batch ["ev",[]]', b'RDATA events m batch ["ev",[]]'], 0.0)
    assert c.pending() == {("events", "m"): 2}
    assert c.committed()[("events", "m")] == 4
    c.receive([b'RDATA events m 5 ["ev",[]]'], 0.0)
    assert c.pending() == {} and c.committed()[("events", "m")] == 5
    c.receive([b'RDATA events m batch ["ev",[]]'], 0.0)
    c.connection_lost()
    assert c.pending() == {} and c.committed()[("events", "m")] == 5


def test_position_gaps_missed_and_rewind():
    c = SynapseClient(keepalive=False, committed={("events", "m"): 5, ("typing", "m"): 9})
    ev = c.receive([b"POSITION events m 5 8", b"POSITION typing m 12 12", b"POSITION caches m 0 3"], 0.0)
    assert ev == [Gap("typing", "m", 9, 12, 12)]
    assert ev[0].kind == "missed"
    assert c.committed() == {("events", "m"): 8, ("typing", "m"): 12, ("caches", "m"): 3}
    ev = c.receive([b"POSITION events m 2 3"], 0.0)
    assert ev[0].kind == "rewind" and c.committed()[("events", "m")] == 3
    # a POSITION drops the stream's pending batch rows
    c.receive([b"RDATA events m batch []", b"POSITION events m 3 3"], 0.0)
    assert c.pending() == {}


def test_connect_sends_name_ping_replicate_and_redis_only_replicate():
    tcp = SynapseClient("me")
    assert tcp.connect(100.0, wall_ms=1795339218912) == ["NAME me", "PING 1795339218912", "REPLICATE"]
    assert SynapseClient("me", replicate=False).connect(1.0)[:1] == ["NAME me"]
    assert SynapseClient(keepalive=False).connect(1.0) == ["REPLICATE "]
    assert SynapseClient(keepalive=False, replicate=False).connect(1.0) == []


def test_keepalive_with_a_test_clock():
    c = SynapseClient("me", ping_interval=5.0, timeout=25.0)
    c.connect(1000.0)
    assert c.next_deadline() == 1005.0
    assert c.tick(1004.9) == []
    assert c.tick(1005.0, wall_ms=7) == ["PING 7"]
    # no PING seen yet: silence alone does not kill the connection
    assert c.tick(1100.0, wall_ms=8) == ["PING 8"]
    c.receive([b"SERVER localhost", b"PING 1"], 1100.0)
    assert c.next_deadline() == 1105.0
    for t in range(1105, 1126, 5):
        assert c.tick(float(t), wall_ms=t) == [f"PING {t}"]
    assert c.next_deadline() == 1125.0
    with pytest.raises(RemoteError) as info:
        c.tick(1125.1)
    assert info.value.code == ErrorCode.DEAD_CONNECTION
    # anything received resets the silence
    c.receive([b"RDATA events master 1 []"], 1125.0)
    assert c.tick(1126.0) == []
    assert c.tick(1149.0) == ["PING 1149000"]


def test_server_name_check_and_server_error():
    c = SynapseClient("me", expected_server="example.org")
    c.connect(0.0)
    c.receive([b"SERVER localhost", b"PING 1"], 0.0)
    assert isinstance(c.error, ProtocolError) and c.error.code == ErrorCode.SERVER_NAME_MISMATCH
    ok = SynapseClient("me", expected_server="localhost")
    ok.connect(0.0)
    ok.receive([b"SERVER localhost"], 0.0)
    assert ok.error is None and ok.server_name == "localhost"
    e = SynapseClient("me")
    e.connect(0.0)
    e.receive([b"ERROR ping timeout"], 0.0)
    assert e.error.code == ErrorCode.SERVER_ERROR


def test_client_replays_the_real_tcp_session():
    c = SynapseClient("probe-client", expected_server="localhost")
    sent = c.connect(1795339218.913, wall_ms=1795339218912)
    assert sent == [l for a, l in tcp_lines()[:3]]
    c.receive([l.encode() for a, l in tcp_lines() if a == "<<"], 1795339258.916)
    assert c.error is None and c.gaps == []
    assert c.committed()[("events", "master")] == 15
    assert c.committed()[("typing", "master")] == 2


def test_bulk_split_marks_the_slow_lines():
    sp = split_lines([b"RDATA a b 1 []", b"PING 1", b"RDATA a b batch [1 2]", b"RDATA a b x []", b""])
    assert sp.slow == [1, 3, 4]
    assert sp.tokens == [1, None, None, None, None]
    assert sp.rows()[2] == b"[1 2]"


# -- the server side ------------------------------------------------------------------------

def test_server_greets_answers_replicate_and_rejects_nonsense():
    feed = Feed(generated_lines(3, 10))
    sc = ServerConnection("hs", feed)
    assert sc.connect(2.0) == ["SERVER hs", "PING 2000"]
    out = sc.receive([b"NAME w", b"PING 5", b"REPLICATE"], 2.0)
    assert sc.client_name == "w" and sc.replicated
    assert len(out) == 18 and all(l.startswith("POSITION ") for l in out)
    assert sc.receive([b"RDATA x y 1 []"], 2.0) == ["ERROR invalid command: RDATA"]
    assert sc.receive([b"POSITION x"], 2.0)[0].startswith("ERROR failed to parse line")
    assert sc.receive([b"\xff"], 2.0) == ["ERROR invalid UTF-8"]
    assert sc.tick(30.0) == (["ERROR ping timeout"], True)


def test_generated_stream_is_deterministic_and_well_formed():
    a = list(generated_lines(7, 500))
    assert a == list(generated_lines(7, 500)) and len(a) == 500
    rdata = [C.parse_line(l) for l in a]
    assert all(isinstance(r, C.Rdata) for r in rdata)
    assert None not in effective_tokens(rdata)
    assert any(r.token is None for r in rdata)
    sizes = [len(l) for l in a if l.startswith("RDATA events")]
    assert 130 <= sum(sizes) / len(sizes) <= 190


def test_recorded_lines_from_both_vector_formats():
    expected = [l for _, l in redis_lines() if l.startswith(("RDATA ", "LOCK_RELEASED "))]
    assert recorded_lines(REDIS_TSV.read_text()) == expected
    tcp = recorded_lines(TCP_TXT.read_text())
    assert [l.split(" ")[0] for l in tcp] == ["LOCK_RELEASED", "RDATA", "LOCK_RELEASED", "RDATA",
                                              "RDATA", "RDATA"]
