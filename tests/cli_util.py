"""Helpers the CLI tests share: the one error line of a failed run, and a self-signed TLS
server context for 127.0.0.1."""

from __future__ import annotations

import subprocess


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
