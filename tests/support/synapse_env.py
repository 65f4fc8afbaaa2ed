"""Fixtures that start a real Redis (Debian's redis-server) and a real Synapse (from
.synapse-venv, installed by `scripts/setup.sh --test`) on loopback in a temporary directory,
and stop them afterwards.

Synapse binds port 0 itself and logs the port it got ("Synapse now listening on TCP port N"),
which is read back. redis-server cannot (`--port 0` means "no TCP at all"), so it is started on
a picked port and started again on another if the bind failed (ports.start_with_retry); it is
ready when its own log says so, never by connecting to a port another program may hold.

Synapse runs with SQLite, one HTTP listener (client + admin API) on 127.0.0.1, Redis
enabled and pointed at the test Redis, and a registration shared secret so tests can
register users through the admin API. Without the Synapse venv (or redis-server) the tests
that need them are skipped with the reason."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pathlib
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.support.paths import ROOT
from tests.support.ports import PortTaken, pick_port, start_with_retry

SYNAPSE_PY = ROOT / ".synapse-venv" / "bin" / "python"
SERVER_NAME = "localhost"
SHARED_SECRET = "dcptool-test-registration-secret"  # a throwaway secret for a throwaway server
START_TIMEOUT = 120.0
IN_USE = "Address already in use"


def wait_log(logs, pattern: str, proc: subprocess.Popen, timeout: float, what: str) -> re.Match:
    """The first match of `pattern` in the server's own logs (the server saying it listens),
    polled until `timeout`; PortTaken if it exited because its port was in use."""
    end = time.monotonic() + timeout
    while True:
        text = "".join(pathlib.Path(p).read_text(errors="replace") for p in logs if os.path.exists(p))
        found = re.search(pattern, text)
        if found:
            return found
        if proc.poll() is not None:
            if IN_USE in text:
                raise PortTaken(f"{what}: {IN_USE}")
            raise RuntimeError(f"{what} exited with {proc.returncode} during start-up\n{text[-3000:]}")
        if time.monotonic() > end:
            raise RuntimeError(f"{what} did not say it is ready within {timeout:.0f} s\n{text[-3000:]}")
        time.sleep(0.1)   # polling the log for the condition, bounded by the deadline


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class RedisServer:
    def __init__(self, workdir: pathlib.Path, *extra: str):
        self.dir = workdir
        self.log = workdir / "redis.log"
        self.port, self.proc = start_with_retry(lambda: self._start(extra))

    def _start(self, extra) -> tuple[int, subprocess.Popen]:
        port = pick_port()
        self.log.unlink(missing_ok=True)
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--logfile", str(self.log),
             "--daemonize", "no", "--protected-mode", "yes", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_log([self.log], "(?i)ready to accept connections", proc, 20, "redis-server")
        except BaseException:
            _stop(proc)
            raise
        return port, proc

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30)

    def stop(self):
        _stop(self.proc)


HOMESERVER_YAML = """\
server_name: "{server_name}"
pid_file: "{dir}/homeserver.pid"
public_baseurl: "http://127.0.0.1/"
listeners:
  - port: 0
    bind_addresses: ["127.0.0.1"]
    type: http
    tls: false
    x_forwarded: false
    resources:
      - names: [client]
        compress: false
database:
  name: sqlite3
  args:
    database: "{dir}/homeserver.db"
log_config: "{dir}/log.yaml"
media_store_path: "{dir}/media_store"
signing_key_path: "{dir}/signing.key"
registration_shared_secret: "{secret}"
enable_registration: false
report_stats: false
trusted_key_servers: []
suppress_key_server_warning: true
macaroon_secret_key: "dcptool-test-macaroon"
form_secret: "dcptool-test-form"
url_preview_enabled: false
enable_metrics: false
redis:
  enabled: true
  host: 127.0.0.1
  port: {redis_port}
rc_message:
  per_second: 1000
  burst_count: 1000
rc_registration:
  per_second: 1000
  burst_count: 1000
rc_login:
  address: {{per_second: 1000, burst_count: 1000}}
  account: {{per_second: 1000, burst_count: 1000}}
  failed_attempts: {{per_second: 1000, burst_count: 1000}}
rc_joins:
  local: {{per_second: 1000, burst_count: 1000}}
  remote: {{per_second: 1000, burst_count: 1000}}
"""

LOG_YAML = """\
version: 1
formatters:
  precise:
    format: '%(asctime)s - %(name)s - %(lineno)d - %(levelname)s - %(message)s'
handlers:
  file:
    class: logging.FileHandler
    formatter: precise
    filename: "{log}"
root:
  level: INFO
  handlers: [file]
disable_existing_loggers: false
"""


class SynapseServer:
    def __init__(self, workdir: pathlib.Path, redis_port: int):
        self.dir = workdir
        cfg = workdir / "homeserver.yaml"
        cfg.write_text(HOMESERVER_YAML.format(server_name=SERVER_NAME, dir=workdir, secret=SHARED_SECRET,
                                              redis_port=redis_port))
        (workdir / "log.yaml").write_text(LOG_YAML.format(log=workdir / "homeserver.log"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        subprocess.run([str(SYNAPSE_PY), "-m", "synapse.app.homeserver", "--config-path", str(cfg),
                        "--generate-keys"], check=True, cwd=workdir, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
        self.out = workdir / "stdout.log"
        self._out = open(self.out, "wb")
        self.proc = subprocess.Popen([str(SYNAPSE_PY), "-m", "synapse.app.homeserver",
                                      "--config-path", str(cfg)], cwd=workdir, env=env,
                                     stdout=self._out, stderr=subprocess.STDOUT)
        try:
            found = wait_log([self.out, workdir / "homeserver.log"], r"Synapse now listening on TCP port (\d+)",
                              self.proc, START_TIMEOUT, "synapse")
            self.http_port = int(found.group(1))
            self.base = f"http://127.0.0.1:{self.http_port}"
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        end = time.monotonic() + START_TIMEOUT
        while time.monotonic() < end:
            try:
                self.request("GET", "/_matrix/client/versions")
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise RuntimeError("synapse did not answer /_matrix/client/versions")

    def request(self, method: str, path: str, body=None, token: str | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read() or b"{}")

    def register(self, user: str, password: str = "pw-for-tests") -> dict:
        """Register through the shared-secret admin API; returns user_id and access_token."""
        nonce = self.request("GET", "/_synapse/admin/v1/register")["nonce"]
        mac = hmac.new(SHARED_SECRET.encode(), digestmod=hashlib.sha1)
        mac.update(b"\x00".join([nonce.encode(), user.encode(), password.encode(), b"notadmin"]))
        return self.request("POST", "/_synapse/admin/v1/register", {
            "nonce": nonce, "username": user, "password": password, "admin": False,
            "mac": mac.hexdigest()})

    def stop(self):
        _stop(self.proc)
        self._out.close()


def synapse_available() -> str | None:
    """None when the real-server tests can run, else the reason to skip."""
    if not SYNAPSE_PY.exists():
        return f"no Synapse venv at {SYNAPSE_PY.parent.parent} (run scripts/setup.sh --test)"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (run scripts/setup.sh --test)"
    return None


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (run scripts/setup.sh --test)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def synapse_server(tmp_path_factory, redis_server):
    reason = synapse_available()
    if reason:
        pytest.skip(reason)
    server = SynapseServer(tmp_path_factory.mktemp("synapse"), redis_server.port)
    yield server
    server.stop()
