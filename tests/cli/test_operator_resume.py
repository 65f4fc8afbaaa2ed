"""Issue 39 (an operator's day): `capture --resume` of a directory that does not exist is one
line, exit 2, and makes nothing (it made the directory and "resumed 0 vbuckets")."""

from __future__ import annotations

import os
import subprocess

from tests.support.paths import DCPTOOL


def test_resume_of_a_missing_directory_is_one_line_exit_2(tmp_path):
    missing = tmp_path / "captrues"          # a typo of captures/
    env = {**os.environ, "DCPTOOL_PASSWORD": "password"}
    for source in ("couchbase://127.0.0.1:1/default", "synapse://127.0.0.1:1"):
        r = subprocess.run([DCPTOOL, "capture", source, "--user", "admin", "-o", str(missing), "--resume"],
                           capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, (source, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "does not exist" in lines[0] and str(missing) in lines[0], r.stderr
        assert not missing.exists()
    # an existing (empty) directory still resumes as before: it gets as far as connecting (exit 3)
    missing.mkdir()
    r = subprocess.run([DCPTOOL, "capture", "couchbase://127.0.0.1:1/default", "--user", "admin",
                        "-o", str(missing), "--resume", "--quiet"],
                       capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 3, r.stderr
