"""SASL for memcached connections, sans-IO: SCRAM-SHA512/256/SHA1 (RFC 5802) client and
server, and PLAIN. Couchbase salts the password with PBKDF2-HMAC of the mechanism's hash.

Secrets never appear in exceptions, reprs or logs: messages name the mechanism and the
step, not the data.

Bounds against a hostile server: a SCRAM iteration count above MAX_SCRAM_ITERATIONS is
refused before any PBKDF2 work (PBKDF2 runs in C and cannot be interrupted, so the ceiling
is what keeps Ctrl-C responsive), and a server that asks for another step after the final
SCRAM message is refused instead of looping."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import os
from typing import Callable

from dcptool.protocol.errors import AuthRefused, ErrorCode, LocalError, RemoteError

# mechanism name -> hashlib name; strongest first (the client's preference order)
SCRAM_HASHES = {"SCRAM-SHA512": "sha512", "SCRAM-SHA256": "sha256", "SCRAM-SHA1": "sha1"}
PREFERENCE = ("SCRAM-SHA512", "SCRAM-SHA256", "SCRAM-SHA1", "PLAIN")
SERVER_MECHS = "SCRAM-SHA512 SCRAM-SHA256 SCRAM-SHA1 PLAIN"
GS2_HEADER = b"n,,"
# Couchbase's default is 10,000; 100x that is ~1.3 s of PBKDF2-SHA512 on one 2020s core.
MAX_SCRAM_ITERATIONS = 1_000_000
MAX_SASL_ROUNDS = 10        # SASL_AUTH + SASL_STEPs answered AUTH_CONTINUE, any mechanism
MAX_MECHS_SHOWN = 200       # characters of a server's mechanism list quoted in an error


def choose_mechanism(offered: bytes | str, *, allow_plain: bool) -> str:
    """The strongest mechanism both sides support; PLAIN only when allowed (TLS or an
    explicit flag). Raises AuthRefused when nothing fits."""
    if isinstance(offered, bytes):
        offered = offered.decode("ascii", "replace")
    names = set(offered.split())
    for mech in PREFERENCE:
        if mech in names and (mech != "PLAIN" or allow_plain):
            return mech
    hint = " (PLAIN is offered: use TLS or --sasl-plain)" if "PLAIN" in names else ""
    shown = offered.strip()
    if len(shown) > MAX_MECHS_SHOWN:
        shown = shown[:MAX_MECHS_SHOWN] + f"... ({len(offered)} characters)"
    raise AuthRefused(f"no common SASL mechanism; server offers {shown or 'none'}{hint}")


def plain_message(user: str, password: str) -> bytes:
    return b"\x00" + user.encode("utf-8") + b"\x00" + password.encode("utf-8")


def _escape_name(user: str) -> bytes:
    return user.replace("=", "=3D").replace(",", "=2C").encode("utf-8")


def _unescape_name(name: bytes) -> str:
    return name.decode("utf-8").replace("=2C", ",").replace("=3D", "=")


def _attrs(msg: bytes) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for part in msg.split(b","):
        if len(part) >= 2 and part[1:2] == b"=":
            out.setdefault(part[:1].decode("ascii", "replace"), part[2:])
    return out


def salted_password(hash_name: str, password: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac(hash_name, password.encode("utf-8"), salt, iterations)


def _hmac(hash_name: str, key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hash_name).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b))


class ScramClient:
    """first() -> client-first; final(server_first) -> client-final; verify(server_final)."""

    def __init__(self, mechanism: str, user: str, password: str, nonce: bytes | None = None):
        if mechanism not in SCRAM_HASHES:
            raise LocalError(ErrorCode.UNSUPPORTED, f"not a SCRAM mechanism: {mechanism}")
        self.mechanism = mechanism
        self._hash = SCRAM_HASHES[mechanism]
        self._user = user
        self._password = password
        self._cnonce = nonce if nonce is not None else base64.b64encode(os.urandom(18))
        self._first_bare = b"n=" + _escape_name(user) + b",r=" + self._cnonce
        self._server_signature: bytes | None = None

    def __repr__(self) -> str:
        return f"ScramClient({self.mechanism})"

    def first(self) -> bytes:
        return GS2_HEADER + self._first_bare

    def final(self, server_first: bytes) -> bytes:
        if self._server_signature is not None:
            raise RemoteError(ErrorCode.SASL_LIMIT, f"{self.mechanism}: the server asked for another "
                              "SASL step after the final SCRAM message (AUTH_CONTINUE instead of SUCCESS)")
        a = _attrs(server_first)
        try:
            nonce, salt, iterations = a["r"], base64.b64decode(a["s"], validate=True), int(a["i"])
        except (KeyError, ValueError):
            raise RemoteError(ErrorCode.AUTH_FAILED,
                              f"{self.mechanism}: malformed server-first message") from None
        if not nonce.startswith(self._cnonce) or len(nonce) <= len(self._cnonce):
            raise RemoteError(ErrorCode.AUTH_FAILED, f"{self.mechanism}: server nonce does not extend ours")
        if iterations < 1:
            raise RemoteError(ErrorCode.AUTH_FAILED, f"{self.mechanism}: bad iteration count")
        if iterations > MAX_SCRAM_ITERATIONS:
            raise RemoteError(ErrorCode.SASL_LIMIT,
                              f"{self.mechanism}: the server asks for {iterations:,} PBKDF2 iterations, "
                              f"above the ceiling of {MAX_SCRAM_ITERATIONS:,} (Couchbase's default is "
                              "10,000); refusing to compute it")
        without_proof = b"c=" + base64.b64encode(GS2_HEADER) + b",r=" + nonce
        auth_message = self._first_bare + b"," + server_first + b"," + without_proof
        salted = salted_password(self._hash, self._password, salt, iterations)
        client_key = _hmac(self._hash, salted, b"Client Key")
        stored_key = hashlib.new(self._hash, client_key).digest()
        proof = _xor(client_key, _hmac(self._hash, stored_key, auth_message))
        server_key = _hmac(self._hash, salted, b"Server Key")
        self._server_signature = _hmac(self._hash, server_key, auth_message)
        return without_proof + b",p=" + base64.b64encode(proof)

    def verify(self, server_final: bytes) -> None:
        """Raise AuthRefused unless the server proved it knows our password."""
        a = _attrs(server_final)
        if "e" in a:
            raise AuthRefused(f"{self.mechanism}: server refused: {a['e'].decode('ascii', 'replace')}")
        try:
            v = base64.b64decode(a["v"], validate=True)
        except (KeyError, ValueError):
            raise AuthRefused(f"{self.mechanism}: malformed server-final message") from None
        if self._server_signature is None or not hmac.compare_digest(v, self._server_signature):
            raise AuthRefused(f"{self.mechanism}: server signature does not verify")


@dataclasses.dataclass(frozen=True)
class ScramCredentials:
    """What a server stores for a user and mechanism (never the password)."""
    salt: bytes
    iterations: int
    stored_key: bytes = dataclasses.field(repr=False)
    server_key: bytes = dataclasses.field(repr=False)

    @classmethod
    def derive(cls, mechanism: str, password: str, salt: bytes, iterations: int = 4096) -> ScramCredentials:
        h = SCRAM_HASHES[mechanism]
        salted = salted_password(h, password, salt, iterations)
        client_key = _hmac(h, salted, b"Client Key")
        return cls(salt, iterations, hashlib.new(h, client_key).digest(), _hmac(h, salted, b"Server Key"))


class ScramServer:
    """first(client_first) -> server-first; final(client_final) -> server-final or raise
    AuthRefused. `lookup(user, mechanism)` returns ScramCredentials or None."""

    def __init__(self, mechanism: str, lookup: Callable[[str, str], ScramCredentials | None],
                 nonce: bytes | None = None):
        self.mechanism = mechanism
        self._hash = SCRAM_HASHES[mechanism]
        self._lookup = lookup
        self._snonce = nonce if nonce is not None else base64.b64encode(os.urandom(18))
        self.user: str | None = None
        self._creds: ScramCredentials | None = None
        self._first_bare = b""
        self._server_first = b""
        self._nonce = b""

    def first(self, client_first: bytes) -> bytes:
        if not client_first.startswith(b"n,"):
            raise AuthRefused(f"{self.mechanism}: channel binding is not supported")
        parts = client_first.split(b",", 2)
        if len(parts) < 3:
            raise AuthRefused(f"{self.mechanism}: malformed client-first message")
        self._first_bare = parts[2]
        a = _attrs(self._first_bare)
        if "n" not in a or "r" not in a or not a["r"]:
            raise AuthRefused(f"{self.mechanism}: malformed client-first message")
        self.user = _unescape_name(a["n"])
        creds = self._lookup(self.user, self.mechanism)
        if creds is None:  # answer as for a real user, fail at the proof: no user probing
            creds = ScramCredentials.derive(self.mechanism, os.urandom(16).hex(), os.urandom(16), 4096)
            self._unknown = True
        else:
            self._unknown = False
        self._creds = creds
        self._nonce = a["r"] + self._snonce
        self._server_first = (b"r=" + self._nonce + b",s=" + base64.b64encode(creds.salt)
                              + b",i=" + str(creds.iterations).encode())
        return self._server_first

    def final(self, client_final: bytes) -> bytes:
        if self._creds is None:
            raise AuthRefused(f"{self.mechanism}: final message before the first")
        idx = client_final.rfind(b",p=")
        if idx < 0:
            raise AuthRefused(f"{self.mechanism}: no proof")
        without_proof = client_final[:idx]
        a = _attrs(without_proof)
        if a.get("r") != self._nonce or a.get("c") != base64.b64encode(GS2_HEADER):
            raise AuthRefused(f"{self.mechanism}: nonce or channel binding mismatch")
        try:
            proof = base64.b64decode(client_final[idx + 3:], validate=True)
        except ValueError:
            raise AuthRefused(f"{self.mechanism}: malformed proof") from None
        auth_message = self._first_bare + b"," + self._server_first + b"," + without_proof
        signature = _hmac(self._hash, self._creds.stored_key, auth_message)
        client_key = _xor(proof, signature)
        if (self._unknown or len(proof) != len(signature)
                or not hmac.compare_digest(hashlib.new(self._hash, client_key).digest(), self._creds.stored_key)):
            raise AuthRefused(f"{self.mechanism}: authentication failed")
        return b"v=" + base64.b64encode(_hmac(self._hash, self._creds.server_key, auth_message))


def check_plain(message: bytes, verify: Callable[[str, str], bool]) -> str:
    """Server side of PLAIN: returns the user when verify(user, password) is true."""
    parts = message.split(b"\x00")
    if len(parts) != 3:
        raise AuthRefused("PLAIN: malformed message")
    user, password = parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace")
    if not verify(user, password):
        raise AuthRefused("PLAIN: authentication failed")
    return user
