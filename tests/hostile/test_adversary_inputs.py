"""Inputs with a documented meaning only, and messages that say what is wrong (issue 24,
items 9, 11 and 14): `--duration 0` is a usage error, unknown URL query parameters are a
usage error and credential-looking ones are refused like a password in the URL (never
stored or printed), and each misleading message of the adversary pass now names the real
problem with its documented exit code."""

from __future__ import annotations

import json
import os
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dcptool.cli.sources import parse_source
from dcptool.protocol.dcp.server import producer as P
from tests.support.cli_util import error_line, run, self_signed_tls
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration

PASSWORD_REFUSED = "a password in the URL is refused"


@pytest.fixture(scope="module")
def dcp():
    model = P.server_from_options(vbuckets=4, items=50, seed=24)
    with ThreadedServer(model) as srv:
        yield f"couchbase://{srv.host}:{srv.port}/default", srv


def _dead_ports(n: int) -> list[int]:
    """Ports nobody listens on (bound, then closed: a connect is refused)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _usage(res, *words):
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    for w in words:
        assert w in res.stderr, res.stderr


# ------------------------------------------------------------------ item 9: --duration 0

@pytest.mark.parametrize("command", ["stream", "capture"])
@pytest.mark.parametrize("value", ["0", "0s", "0ms"])
def test_duration_zero_is_a_usage_error_not_no_limit(dcp, tmp_path, command, value):
    url, _ = dcp
    extra = ["-o", str(tmp_path / "c"), "--quiet"] if command == "capture" else ["--format", "jsonl"]
    res = run(command, url, "--to", "forever", "--duration", value, *extra, timeout=30)
    _usage(res, "--duration must be positive")
    assert res.stdout == "" and not (tmp_path / "c").exists()


# ------------------------------------------------------------------ item 11: URL query

@pytest.mark.parametrize("query", ["password=hunter2", "PassWord=hunter2", "pwd=hunter2", "secret=hunter2",
                                   "auth_token=hunter2", "x%41uth=hunter2", "password"])
def test_a_credential_in_the_query_is_refused_and_never_stored(dcp, tmp_path, query):
    url, _ = dcp
    out = tmp_path / "c"
    res = run("capture", f"{url}?{query}", "-o", str(out), "--quiet", "--json", "--max-messages", "5")
    _usage(res, PASSWORD_REFUSED)
    assert "hunter2" not in res.stderr + res.stdout
    assert not out.exists()      # nothing connected, nothing recorded
    # the same words as a password in the user info
    userinfo = run("stream", url.replace("://", "://admin:hunter2@"), "--max-messages", "1")
    _usage(userinfo, PASSWORD_REFUSED)
    assert error_text(res) == error_text(userinfo)


def error_text(res) -> str:
    """The error line (a usage error's hint line after it names the command: left out)."""
    return [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("Try '")][-1]


def test_an_unknown_query_parameter_is_named_never_its_value(dcp):
    url, _ = dcp
    res = run("stream", f"{url}?compression=snappy-please", "--max-messages", "1", "--format", "jsonl")
    _usage(res, "unknown query parameter 'compression'")
    assert "snappy-please" not in res.stderr and res.stdout == ""


@pytest.mark.parametrize("tail", ["#password=hunter2", "?server_name=x#hunter2"])
def test_a_fragment_is_a_usage_error_never_echoed(tail):
    res = run("stream", f"synapse://127.0.0.1:9{tail}", "--max-messages", "1")
    _usage(res, "#fragment")
    assert "hunter2" not in res.stderr


def test_the_documented_parameters_are_kept():
    assert parse_source("synapse+redis://127.0.0.1/2?server_name=example.org").server_name == "example.org"
    assert parse_source("synapse://127.0.0.1:9092?server_name=example.org").server_name == "example.org"
    src = parse_source("couchbase://127.0.0.1,127.0.0.2:11999/default")
    assert src.bucket == "default" and src.seed_list == [("127.0.0.1", 11210), ("127.0.0.2", 11999)]


@pytest.mark.parametrize("url", ["synapse+redis://127.0.0.1?server_name=x&token=abc",
                                 "synapse://127.0.0.1:9092?server_name=x&access_token=abc",
                                 "couchbase://127.0.0.1,127.0.0.2/default?sasl_password=abc"])
def test_credential_parameters_are_refused_on_every_scheme(url):
    res = run("stream", url, "--max-messages", "1")
    _usage(res, PASSWORD_REFUSED)
    assert "abc" not in res.stderr


# ------------------------------------------------------------------ item 14: messages

def test_a_reversed_vbucket_range_says_so(dcp):
    url, _ = dcp
    res = run("stream", url, "--vbuckets", "5-3")
    _usage(res, "reversed")
    assert "outside" not in res.stderr


@pytest.mark.parametrize("target", ["devnull", "file", "under-a-file"])
def test_capture_into_something_that_is_not_a_directory_is_a_usage_error(dcp, tmp_path, target):
    url, _ = dcp
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    path = {"devnull": os.devnull, "file": str(a_file), "under-a-file": str(a_file / "caps")}[target]
    res = run("capture", url, "-o", path, "--quiet", "--max-messages", "5")
    _usage(res, "not a directory", path)
    assert "File exists" not in res.stderr
    assert a_file.read_text() == "mine\n"


@pytest.mark.parametrize("kind", ["device", "loop"])
def test_inspect_says_what_a_path_is(tmp_path, kind):
    if kind == "device":
        path, expect = "/dev/zero", "character device"
    else:
        path = tmp_path / "loop"
        os.symlink(path, path)
        path, expect = str(path), "symlink loop"
    res = run("inspect", path)
    line = error_line(res)
    assert res.returncode == 1 and expect in line and "no such file" not in line, line


def _foreign_capture(path, **meta):
    md = {"dcptool.protocol": "dcp", "dcptool.capture_id": "0123abcd", "dcptool.segment": "0",
          "dcptool.started_at": "2026-11-26T00:00:00Z"}
    md.update(meta)
    pq.write_table(pa.table({"frame_no": pa.array([0], pa.int64())}).replace_schema_metadata(md), path)


@pytest.mark.parametrize("key,value", [("dcptool.protocol", "kafka"), ("dcptool.started_at", "yesterday"),
                                       ("dcptool.segment", "minus-one")])
def test_a_bad_metadata_value_names_the_key_and_says_invalid(tmp_path, key, value):
    seg = tmp_path / "seg.parquet"
    _foreign_capture(seg, **{key: value})
    line = error_line(run("inspect", str(seg)))
    assert "missing" not in line and "invalid value" in line and key in line and str(seg) in line, line


def test_diff_names_the_directory_without_captures(tmp_path):
    full, empty = tmp_path / "full", tmp_path / "empty"
    full.mkdir()
    empty.mkdir()
    _foreign_capture(full / "seg.parquet")
    res = run("diff", str(empty), str(full))
    line = error_line(res)
    assert res.returncode == 1 and str(empty) in line and "no capture files" in line, line


def test_ca_cert_that_is_not_a_certificate_is_a_usage_error(dcp, tmp_path):
    _, srv = dcp
    junk = tmp_path / "ca.pem"
    junk.write_text("this is not a certificate\n")
    res = run("stream", f"couchbases://{srv.host}:{srv.port}/default", "--ca-cert", str(junk),
              "--max-messages", "1")
    _usage(res, f"--ca-cert {junk}: not a PEM certificate")
    assert "X509" not in res.stderr and "_ssl.c" not in res.stderr


def test_ca_cert_that_is_a_certificate_still_works(tmp_path):
    ctx, cert = self_signed_tls(tmp_path)
    model = P.server_from_options(vbuckets=2, items=5, seed=3)
    with ThreadedServer(model, tls=ctx) as srv:
        res = run("stream", f"couchbases://127.0.0.1:{srv.port}/default", "--ca-cert", str(cert),
                  "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    assert sum(json.loads(ln)["op"] == "mutation" for ln in res.stdout.splitlines()) == 5


def test_dead_seeds_are_not_counted_as_connections(dcp):
    """Twenty seeds that refuse before the live one: one connection made, numbered 1."""
    _, srv = dcp
    seeds = ",".join(f"127.0.0.1:{p}" for p in _dead_ports(20)) + f",{srv.host}:{srv.port}"
    res = run("stream", f"couchbase://{seeds}/default", "--format", "jsonl", "--json", "--max-messages", "40")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stderr.strip().splitlines()[-1])
    assert summary["connections"] == 1
    assert {json.loads(ln)["conn"] for ln in res.stdout.splitlines()} == {1}


def test_stream_json_with_one_message_prints_the_summary(dcp):
    url, _ = dcp
    res = run("stream", url, "--json", "--max-messages", "1")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["stopped"] == "max-messages" and summary["messages_in"] == 1


def test_synapse_stream_json_with_one_message_prints_the_summary(serve):  # noqa: F811
    server = serve("--items", "50")
    res = run("stream", f"synapse://{server.address}", "--json", "--max-messages", "1", timeout=60)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["stopped"] == "max-messages" and summary["messages_in"] == 1
