"""SIGINT stops `restore` within 2 s with its summary (exit 130), whatever the target does:
the target here stops answering after its 5th write with meta (its event loop held; one
write in flight, so the first four were answered), so the signal always comes half way (a restore of a few hundred documents can finish between a poll
of the target's write count and the signal: tests/cli/test_restore.py's version of this
races), and the writes in flight are abandoned, not waited for."""

from __future__ import annotations

import json
import signal
import subprocess
import threading

from dcptool.protocol.dcp.server import kv
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.wire.constants import Opcode
from tests.support.cli_util import capture_files
from tests.support.paths import DCPTOOL
from tests.support.threaded_server import ThreadedServer


def test_sigint_half_way_stops_with_the_summary(tmp_path, monkeypatch):
    source = P.server_from_options(vbuckets=4, items=300, seed=21)
    with ThreadedServer(source) as srv:
        capture_files(f"couchbase://{srv.host}:{srv.port}/default", tmp_path / "caps", "--to", "now")
    fifth, release = threading.Event(), threading.Event()
    write = kv.DOCUMENT_COMMANDS[Opcode.SET_WITH_META]
    seen = [0]

    def held(conn, req, st, ix, now):       # runs on the target's event loop
        write(conn, req, st, ix, now)
        seen[0] += 1
        if seen[0] == 5:
            fifth.set()
            release.wait(60)                 # the target answers nothing more until released
    monkeypatch.setitem(kv.DOCUMENT_COMMANDS, Opcode.SET_WITH_META, held)
    target = P.server_from_options(vbuckets=4, items=0, seed=22)
    with ThreadedServer(target) as srv:
        proc = subprocess.Popen([DCPTOOL, "restore", str(tmp_path / "caps"), f"couchbase://{srv.host}:{srv.port}/default",
                                 "--json", "--window", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert fifth.wait(60), proc.stderr.read() if proc.poll() is not None else "no 5th write"
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=10)   # a bound, not a measure
        finally:
            release.set()
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, err
    summary = json.loads(out)
    assert summary["interrupted"] is True and summary["documents"] == 300 and "Traceback" not in err
    assert 0 < summary["written"] < 300
