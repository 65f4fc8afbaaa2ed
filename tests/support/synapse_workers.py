"""A real Synapse deployed with workers, for tests: a PostgreSQL cluster of its own (Debian's
`postgresql` package, initdb + postgres from /usr/lib/postgresql/*/bin, on a picked loopback
port in a temporary directory), a main process and one event persister
(`synapse.app.generic_worker` named event_persister1, `stream_writers: {events:
event_persister1}`), both with Redis enabled and an HTTP listener serving the `replication`
resource (the main one also `client`) checked with worker_replication_secret.

PostgreSQL refuses to run as root: as root the cluster runs as the `postgres` user and its
directory (made directly under the system temp dir, so that user can reach it) is owned by it.
The database is made as Synapse requires it (UTF8, `C` collation and ctype, from template0).

The replication listeners must be named in `instance_map` before the processes start, so
their ports are picked and the whole start is tried again on fresh ports when a bind failed
(ports.start_with_retry). Each process is ready when its own log says it listens; everything
is stopped (and the cluster's directory removed) by stop()."""

from __future__ import annotations

import glob
import hashlib
import hmac
import json
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import IO, Any

from tests.support.ports import pick_port, start_with_retry
from tests.support.synapse_env import (
    LOG_YAML,
    SERVER_NAME,
    SHARED_SECRET,
    SYNAPSE_PY,
    wait_log,
)

START_TIMEOUT = 120.0
IN_USE = "Address already in use"
DB_USER = "synapse"
DB_NAME = "synapse"
PG_USER = "postgres"    # the OS user the cluster runs as when the tests run as root


def pg_bindir() -> pathlib.Path | None:
    """The newest /usr/lib/postgresql/N/bin holding initdb, postgres and psql, or None."""
    found = []
    for d in glob.glob("/usr/lib/postgresql/*/bin"):
        p = pathlib.Path(d)
        if all((p / b).exists() for b in ("initdb", "postgres", "psql", "createdb")):
            ver = p.parent.name
            found.append((int(ver) if ver.isdigit() else 0, p))
    return max(found)[1] if found else None


def workers_available() -> str | None:
    """None when the worker deployment can run here, else the reason to skip."""
    if not SYNAPSE_PY.exists():
        return f"no Synapse venv at {SYNAPSE_PY.parent.parent} (run scripts/setup.sh --test)"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (run scripts/setup.sh --test)"
    if pg_bindir() is None:
        return "PostgreSQL is not installed (/usr/lib/postgresql/*/bin; run scripts/setup.sh --test)"
    env = _synapse_env()
    if subprocess.run([str(SYNAPSE_PY), "-c", "import psycopg2"], env=env, capture_output=True,
                      timeout=60).returncode != 0:
        return "the Synapse venv has no psycopg2 (run scripts/setup.sh --test)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_USER)
        except KeyError:
            return f"running as root and no {PG_USER!r} user to run PostgreSQL as"
    return None


def _synapse_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class PostgresCluster:
    """A throwaway cluster on 127.0.0.1 (trust authentication, superuser `synapse`) with one
    database `synapse` as Synapse wants it."""

    def __init__(self) -> None:
        bindir = pg_bindir()
        assert bindir is not None
        self.bin = bindir
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="dcptool-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            pw = pwd.getpwnam(PG_USER)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        try:
            subprocess.run([str(self.bin / "initdb"), "-D", str(self.data), "-U", DB_USER, "--auth=trust",
                            "--encoding=UTF8", "--locale=C", "--no-sync"], check=True, cwd=self.dir,
                           capture_output=True, timeout=120, **self._as)
            self.port, self.proc = start_with_retry(self._start)
            subprocess.run([str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", DB_USER,
                            "--encoding=UTF8", "--lc-collate=C", "--lc-ctype=C", "--template=template0",
                            DB_NAME], check=True, capture_output=True, timeout=60)
        except BaseException:
            self.stop()
            raise

    def _start(self) -> tuple[int, subprocess.Popen[bytes]]:
        port = pick_port()
        self.log.unlink(missing_ok=True)
        with open(self.log, "wb") as logf:
            proc = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(self.data), "-h", "127.0.0.1", "-p", str(port),
                 "-k", str(self.dir), "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off", "-c", "max_connections=100"],
                cwd=self.dir, stdout=logf, stderr=subprocess.STDOUT, **self._as)
        try:
            wait_log([self.log], "database system is ready to accept connections", proc, 60, "postgres")
        except BaseException:
            _stop(proc, signal.SIGINT)
            raise
        return port, proc

    def query(self, sql: str) -> list[str]:
        """The rows of `sql` in the synapse database, one string per row (one column)."""
        res = subprocess.run([str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", DB_USER,
                              "-d", DB_NAME, "-AtXq", "-v", "ON_ERROR_STOP=1", "-c", sql],
                             check=True, capture_output=True, timeout=60)
        return [line for line in res.stdout.decode().splitlines() if line]

    def stop(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None:
            _stop(proc, signal.SIGINT)     # fast shutdown: clients are cut off
        shutil.rmtree(self.dir, ignore_errors=True)


_LIMIT = {"per_second": 1000, "burst_count": 1000}


def _shared_config(workdir: pathlib.Path, redis_port: int, pg: PostgresCluster, secret: str,
                   ports: dict[str, int]) -> dict[str, Any]:
    return {
        "server_name": SERVER_NAME,
        "pid_file": str(workdir / "homeserver.pid"),
        "public_baseurl": "http://127.0.0.1/",
        "listeners": [{"port": ports["master"], "bind_addresses": ["127.0.0.1"], "type": "http", "tls": False,
                       "x_forwarded": False, "resources": [{"names": ["client", "replication"], "compress": False}]}],
        "database": {"name": "psycopg2", "args": {
            "user": DB_USER, "database": DB_NAME, "host": "127.0.0.1", "port": pg.port, "cp_min": 1, "cp_max": 5}},
        "log_config": str(workdir / "log.yaml"),
        "media_store_path": str(workdir / "media_store"),
        "signing_key_path": str(workdir / "signing.key"),
        "registration_shared_secret": SHARED_SECRET,
        "enable_registration": False,
        "report_stats": False,
        "trusted_key_servers": [],
        "suppress_key_server_warning": True,
        "macaroon_secret_key": "dcptool-test-macaroon",
        "form_secret": "dcptool-test-form",
        "url_preview_enabled": False,
        "enable_metrics": False,
        "redis": {"enabled": True, "host": "127.0.0.1", "port": redis_port},
        "worker_replication_secret": secret,
        "instance_map": {
            "main": {"host": "127.0.0.1", "port": ports["master"]},
            "event_persister1": {"host": "127.0.0.1", "port": ports["event_persister1"]},
        },
        "stream_writers": {"events": "event_persister1"},
        "rc_message": _LIMIT, "rc_registration": _LIMIT,
        "rc_login": {"address": _LIMIT, "account": _LIMIT, "failed_attempts": _LIMIT},
        "rc_joins": {"local": _LIMIT, "remote": _LIMIT},
    }


class SynapseWorkers:
    """Main (`master`) and event_persister1 on `pg`. `base` is main's client API;
    `replication` maps each instance (as the capture names it) to its replication URL."""

    def __init__(self, workdir: pathlib.Path, redis_port: int, pg: PostgresCluster, secret: str):
        self.dir = workdir
        self.pg = pg
        self.redis_port = redis_port
        self.secret = secret
        self.env = _synapse_env()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._outs: list[IO[bytes]] = []
        (workdir / "log.yaml").write_text(LOG_YAML.format(log=workdir / "homeserver.log"))
        (workdir / "worker_log.yaml").write_text(LOG_YAML.format(log=workdir / "event_persister1.log"))
        self.ports: dict[str, int] = start_with_retry(self._start)
        self.base = f"http://127.0.0.1:{self.ports['master']}"
        self.replication = {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}

    def _spawn(self, args: list[str], out: pathlib.Path) -> subprocess.Popen[bytes]:
        f = open(out, "wb")
        self._outs.append(f)
        proc = subprocess.Popen([str(SYNAPSE_PY), "-m", *args], cwd=self.dir, env=self.env, stdout=f,
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def _start(self) -> dict[str, int]:
        ports = {"master": pick_port(), "event_persister1": pick_port()}
        cfg = self.dir / "homeserver.yaml"
        cfg.write_text(json.dumps(_shared_config(self.dir, self.redis_port, self.pg, self.secret, ports), indent=1))
        worker = self.dir / "event_persister1.yaml"
        worker.write_text(json.dumps({
            "worker_app": "synapse.app.generic_worker", "worker_name": "event_persister1",
            "worker_log_config": str(self.dir / "worker_log.yaml"),
            "worker_listeners": [{"type": "http", "port": ports["event_persister1"],
                                  "bind_addresses": ["127.0.0.1"], "resources": [{"names": ["replication"]}]}],
        }, indent=1))
        if not (self.dir / "signing.key").exists():
            subprocess.run([str(SYNAPSE_PY), "-m", "synapse.app.homeserver", "--config-path", str(cfg),
                            "--generate-keys"], check=True, cwd=self.dir, env=self.env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
        for f in (self.dir / "homeserver.log", self.dir / "event_persister1.log"):
            f.unlink(missing_ok=True)
        try:
            main = self._spawn(["synapse.app.homeserver", "--config-path", str(cfg)], self.dir / "main.out")
            wait_log([self.dir / "main.out", self.dir / "homeserver.log"],
                      rf"Synapse now listening on TCP port {ports['master']}\b", main, START_TIMEOUT, "synapse main")
            ep = self._spawn(["synapse.app.generic_worker", "--config-path", str(cfg), "--config-path", str(worker)],
                             self.dir / "event_persister1.out")
            wait_log([self.dir / "event_persister1.out", self.dir / "event_persister1.log"],
                      rf"Synapse now listening on TCP port {ports['event_persister1']}\b", ep, START_TIMEOUT,
                      "synapse event_persister1")
            self._wait_ready(f"http://127.0.0.1:{ports['master']}")
        except BaseException:
            self.stop()
            raise
        return ports

    def _wait_ready(self, base: str) -> None:
        end = time.monotonic() + START_TIMEOUT
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(base + "/_matrix/client/versions", timeout=30):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)    # polling readiness, bounded by the deadline
        raise RuntimeError("synapse main did not answer /_matrix/client/versions")

    def request(self, method: str, path: str, body: Any = None, token: str | None = None) -> dict[str, Any]:
        """A JSON request to main's client API."""
        req = urllib.request.Request(self.base + path, data=None if body is None else json.dumps(body).encode(),
                                     method=method, headers={"Content-Type": "application/json"})
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer: dict[str, Any] = json.loads(resp.read() or b"{}")
            return answer

    def register(self, user: str, password: str = "pw-for-tests") -> dict[str, Any]:
        """Register through the shared-secret admin API; returns user_id and access_token."""
        nonce = self.request("GET", "/_synapse/admin/v1/register")["nonce"]
        mac = hmac.new(SHARED_SECRET.encode(), digestmod=hashlib.sha1)
        mac.update(b"\x00".join([nonce.encode(), user.encode(), password.encode(), b"notadmin"]))
        return self.request("POST", "/_synapse/admin/v1/register", {
            "nonce": nonce, "username": user, "password": password, "admin": False, "mac": mac.hexdigest()})

    def stop(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)
        self.procs = []
        for f in self._outs:
            f.close()
        self._outs = []
