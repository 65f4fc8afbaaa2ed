"""`synapse+redis://` against a password-protected Redis (no Synapse needed): the password
comes from DCPTOOL_PASSWORD or --password-file, is refused with exit 4 when wrong, and is
never written to the capture or stderr."""

from __future__ import annotations

import shutil

import orjson
import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.synapse_env import RedisServer

pytestmark = pytest.mark.integration
SECRET = "s3cret-for-redis-tests"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (run scripts/setup.sh --test)")
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), "--requirepass", SECRET)
    yield server
    server.stop()


def test_password_from_env_and_file_and_never_recorded(locked_redis, tmp_path):
    url = f"synapse+redis://127.0.0.1:{locked_redis.port}/0?server_name=hs.test"
    res = CliRunner().invoke(cli, ["capture", url, "-o", str(tmp_path / "a"), "--quiet", "--json",
                                   "--max-messages", "1", "--duration", "30s"], env={"DCPTOOL_PASSWORD": SECRET})
    assert res.exit_code == 0, res.stderr
    rows = read_capture_table(find_captures([str(tmp_path / "a")])).to_pylist()
    # our REPLICATE went out and came back to us (Redis delivers our own publications)
    assert [(r["direction"], r["channel"], r["raw"]) for r in rows[:2]] == [
        ("out", "hs.test", b"REPLICATE "), ("in", "hs.test", b"REPLICATE ")]
    for f in (tmp_path / "a").iterdir():
        assert SECRET.encode() not in f.read_bytes()
    assert SECRET not in res.stderr and SECRET not in res.stdout
    assert orjson.loads(res.stdout)["received"] == 1

    pw = tmp_path / "pw"
    pw.write_text(SECRET + "\n")
    res = CliRunner().invoke(cli, ["stream", url, "--password-file", str(pw), "--format", "jsonl",
                                   "--max-messages", "1", "--duration", "10s"],
                             env={"DCPTOOL_PASSWORD": None})
    assert res.exit_code == 0, res.stderr
    assert [orjson.loads(l)["command"] for l in res.stdout.splitlines()] == ["REPLICATE", "REPLICATE"]


def test_wrong_or_missing_password_exits_4(locked_redis, tmp_path):
    url = f"synapse+redis://127.0.0.1:{locked_redis.port}?server_name=hs.test"
    for env in ({"DCPTOOL_PASSWORD": "wrong"}, {"DCPTOOL_PASSWORD": None}):
        res = CliRunner().invoke(cli, ["stream", url, "--duration", "5s"], env=env)
        assert res.exit_code == 4, (env, res.stderr)
        assert "wrong" not in res.stderr


def test_no_redis_exits_3(tmp_path):
    from tests.support.ports import refused_port
    with refused_port() as port:
        res = CliRunner().invoke(cli, ["stream", f"synapse+redis://127.0.0.1:{port}?server_name=x",
                                       "--duration", "5s"], env={"DCPTOOL_PASSWORD": None})
    assert res.exit_code == 3, res.stderr
