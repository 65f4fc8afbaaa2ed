"""Helpers the CLI tests share: `dcptool` as a subprocess (run, stream_rows, capture_files),
the one error line of a failed run, and a self-signed TLS server context for 127.0.0.1."""

from __future__ import annotations

import json
import subprocess

from tests.support.paths import DCPTOOL


def run(*args, timeout=120):
    """`dcptool ARGS` as a subprocess (the installed entry point): the CompletedProcess."""
    return subprocess.run([DCPTOOL, *args], capture_output=True, text=True, timeout=timeout)


def stream_rows(url, *args) -> list[dict]:
    """The JSON-lines rows of a `dcptool stream` run that must succeed."""
    res = run("stream", url, "--format", "jsonl", *args)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


def capture_files(url, out, *args) -> list:
    """The capture files of a `dcptool capture -o OUT` run that must succeed."""
    from dcptool.replay.store.reader import find_captures
    res = run("capture", url, "-o", str(out), "--quiet", "--json", *args)
    assert res.returncode == 0, res.stderr
    return find_captures([str(out)])


def error_line(res) -> str:
    """The one `dcptool:` line on stderr (and no traceback)."""
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("dcptool:")]
    assert len(lines) == 1, res.stderr
    return lines[0]


def self_signed_tls(tmp_path):
    """(server SSLContext, certificate path) of a fresh self-signed certificate for
    127.0.0.1 (needs `openssl`)."""
    import ssl
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True, timeout=60)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx, cert
