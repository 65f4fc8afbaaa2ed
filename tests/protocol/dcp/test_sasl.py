"""SCRAM client and server against the RFC test vectors, each other, and wrong passwords."""

import pytest

from dcptool.protocol.dcp.wire import sasl
from dcptool.protocol.errors import AuthRefused, RemoteError


def test_rfc5802_sha1_vector():
    c = sasl.ScramClient("SCRAM-SHA1", "user", "pencil", nonce=b"fyko+d2lbbFgONRv9qkxdawL")
    assert c.first() == b"n,,n=user,r=fyko+d2lbbFgONRv9qkxdawL"
    final = c.final(b"r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,s=QSXCR+Q6sek8bf92,i=4096")
    assert final == b"c=biws,r=fyko+d2lbbFgONRv9qkxdawL3rfcNHYJY1ZVvWVs7j,p=v0X8v3Bz2T0CJGbJQyF0X+HI4Ts="
    c.verify(b"v=rmF9pqV8S7suAoZWja4dJRkFsKQ=")


def test_rfc7677_sha256_vector():
    c = sasl.ScramClient("SCRAM-SHA256", "user", "pencil", nonce=b"rOprNGfwEbeRWgbNEkqO")
    final = c.final(b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
    assert final == (b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                     b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
    c.verify(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
    with pytest.raises(AuthRefused):
        c.verify(b"v=rmF9pqV8S7suAoZWja4dJRkFsKQ=")


def _server(password, mech):
    creds = sasl.ScramCredentials.derive(mech, password, b"salt-bytes-1234", 64)
    return sasl.ScramServer(mech, lambda u, m: creds if u == "a,b=c" else None)


@pytest.mark.parametrize("mech", list(sasl.SCRAM_HASHES))
def test_client_and_server_agree(mech):
    srv = _server("s3cret", mech)
    c = sasl.ScramClient(mech, "a,b=c", "s3cret")
    assert b"n=a=2Cb=3Dc," in c.first()
    final = srv.final(c.final(srv.first(c.first())))
    assert srv.user == "a,b=c"
    c.verify(final)


@pytest.mark.parametrize("mech", list(sasl.SCRAM_HASHES))
def test_wrong_password_refused_without_leaking(mech):
    srv = _server("s3cret", mech)
    c = sasl.ScramClient(mech, "a,b=c", "wrong-password")
    with pytest.raises(AuthRefused) as info:
        srv.final(c.final(srv.first(c.first())))
    assert "wrong-password" not in str(info.value) and "s3cret" not in str(info.value)
    assert "wrong" not in repr(c)


def test_unknown_user_fails_at_proof():
    srv = _server("s3cret", "SCRAM-SHA256")
    c = sasl.ScramClient("SCRAM-SHA256", "nobody", "s3cret")
    first = srv.first(c.first())
    assert first.startswith(b"r=")
    with pytest.raises(AuthRefused):
        srv.final(c.final(first))


def test_client_rejects_foreign_nonce():
    c = sasl.ScramClient("SCRAM-SHA1", "user", "pencil", nonce=b"abc")
    with pytest.raises(RemoteError):
        c.final(b"r=xyz123,s=QSXCR+Q6sek8bf92,i=4096")


def test_choose_mechanism_and_plain():
    assert sasl.choose_mechanism(b"PLAIN SCRAM-SHA1 SCRAM-SHA512", allow_plain=False) == "SCRAM-SHA512"
    assert sasl.choose_mechanism("SCRAM-SHA1 PLAIN", allow_plain=False) == "SCRAM-SHA1"
    with pytest.raises(AuthRefused, match="PLAIN is offered"):
        sasl.choose_mechanism("PLAIN", allow_plain=False)
    assert sasl.choose_mechanism("PLAIN", allow_plain=True) == "PLAIN"
    msg = sasl.plain_message("user", "pencil")
    assert msg == b"\x00user\x00pencil"
    assert sasl.check_plain(msg, lambda u, p: (u, p) == ("user", "pencil")) == "user"
    with pytest.raises(AuthRefused):
        sasl.check_plain(msg, lambda u, p: False)
