"""The warm Spark Connect server of `dcptool spark start|stop|status`: launching it from the
pyspark package, recording it, and the watchdog that stops it when idle. No pyspark import
(only replay/spark/engine.py imports it): the package directory comes from importlib.

State lives in one directory (DCPTOOL_STATE_DIR, else $XDG_STATE_HOME/dcptool, else
~/.local/state/dcptool), mode 0700:
  spark-connect.json   the record: pid, host, port, token, log, idle timeout, watchdog pid
  spark-connect.used   touched by every replay that uses the server (its mtime is the last use)
  spark-connect.log    the server's and the watchdog's output
  spark-connect.lock   held while starting or stopping, so two starts make one server
  spark-connect.session  the id of the server session replays share (shared_session);
                       spark-connect.session.lock, held by the one replay using it, and
                       spark-connect.session.busy, there while a replay is in it

The server is `spark-submit --class ...SparkConnectServer` on `local[*]`, its gRPC port bound
to 127.0.0.1 (or the host asked for), the driver bound to 127.0.0.1, no UI, the settings of
the embedded session (replay/spark/engine.py) and a random token: any local user could otherwise
run code as us through it. The token reaches the server and clients through the environment
and the record (0600), never argv."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass

from dcptool.protocol.errors import DcptoolError

STATE_ENV = "DCPTOOL_STATE_DIR"
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
TOKEN_ENV = "SPARK_CONNECT_AUTHENTICATE_TOKEN"
DEFAULT_PORT = 15002
DEFAULT_IDLE = 30 * 60.0
LOOPBACK = "127.0.0.1"

# the settings every dcptool session runs with (replay/spark/engine.py make_session has the same)
SESSION_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.legacy.parquet.nanosAsLong": "true",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.shuffle.partitions": str(os.cpu_count() or 2),   # local[*]: one per core (spark.shuffle_partitions)
    "spark.sql.runSQLOnFiles": "false",
}

_SECRET_ENV = re.compile(r"PASS|SECRET|TOKEN|CREDENTIAL|API_?KEY|PRIVATE_?KEY|ACCESS_?KEY|AUTH", re.IGNORECASE)


class ServerError(DcptoolError):
    """The server could not be started or stopped (one line; the log path says where to look)."""


class StateDirError(ServerError):
    """The state directory cannot be made or written (e.g. HOME is not writable)."""


@dataclass
class Record:
    pid: int
    host: str
    port: int
    token: str
    log: str
    started_at: float
    idle_timeout_s: float
    watchdog_pid: int | None = None
    spark_version: str | None = None
    pid_start: int | None = None        # /proc/PID/stat field 22 of `pid` (a recycled pid has another)
    watchdog_start: int | None = None   # the same of `watchdog_pid`

    @property
    def url(self) -> str:
        """The address clients use: `localhost` so that pyspark sends the token over a local
        (unencrypted) gRPC channel rather than asking for TLS."""
        host = "localhost" if self.host in (LOOPBACK, "localhost", "0.0.0.0") else self.host
        return f"sc://{host}:{self.port}"


# --- the state directory ------------------------------------------------------------------

def state_dir() -> str:
    d = os.environ.get(STATE_ENV)
    if not d:
        base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        d = os.path.join(base, "dcptool")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise StateDirError(f"cannot use the state directory {d} ({exc.strerror or exc}); "
                            f"set {STATE_ENV} to a writable directory") from None
    return d


def _path(name: str) -> str:
    return os.path.join(state_dir(), f"spark-connect.{name}")


@contextlib.contextmanager
def _locked():
    fd = os.open(_path("lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # closing releases the lock


def read_record() -> Record | None:
    try:
        with open(_path("json")) as f:
            data = json.load(f)
        return Record(**data)
    except (OSError, ValueError, TypeError):
        return None


def _write_record(rec: Record) -> None:
    tmp = _path("json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(rec), f)
    os.replace(tmp, _path("json"))


def _clear_record(pid: int | None = None) -> None:
    """Remove the record (only if it still names `pid`, when given)."""
    rec = read_record()
    if pid is not None and rec is not None and rec.pid != pid:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path("json"))


def touch() -> None:
    """Mark the server as used now (the watchdog measures idle time from the last mark)."""
    p = _path("used")
    with open(p, "a"):
        pass
    os.utime(p)


def shared_session(renew: bool = False) -> tuple[str, int] | None:
    """The id of the server session that `replay --spark` runs share, and a file descriptor
    holding its lock (closing it releases the session to the next replay); None while
    another replay holds it (that replay then opens a session of its own, as before). A new
    id when `renew` (the server closed the session: idle past its session timeout, or a
    replay that left something in it released it) or none is recorded yet.

    Why share: Spark Connect gives every server session its own class loader, and Spark's
    generated code is compiled, and warmed by the JIT, per class loader: a replay in a new
    session recompiled its whole plan (0.6 s of 2 s, 1.5 s of server CPU, at 1M frames)."""
    fd = os.open(_path("session.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    path = _path("session")
    busy = _path("session.busy")
    # left by a replay that ended without stop_session (killed): whatever it set in the session
    # may still be there, so the session is not joined again
    renew = renew or os.path.exists(busy)
    sid = None
    if not renew:
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                sid = str(uuid.UUID(f.read().strip()))
    if sid is None:
        sid = str(uuid.uuid4())
        tmp = _path("session.tmp")
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(sid)
            os.replace(tmp, path)
        except OSError:
            os.close(fd)
            return None
    try:
        with open(busy, "w"):
            pass
    except OSError:
        os.close(fd)
        return None
    return sid, fd


def leave_shared_session(fd: int, kept: bool) -> None:
    """The end of a replay in the shared session (shared_session's descriptor): `kept`, it
    left the session as it found it, and the next replay may join it."""
    try:
        if kept:
            with contextlib.suppress(OSError):
                os.unlink(_path("session.busy"))
    finally:
        os.close(fd)


def last_used(rec: Record) -> float:
    try:
        return max(os.stat(_path("used")).st_mtime, rec.started_at)
    except OSError:
        return rec.started_at


@contextlib.contextmanager
def keep_alive(rec: Record):
    """Mark the server as used now, every third of its idle timeout while the block runs (a
    long replay is not idle), and at the end."""
    import threading
    touch()
    stop = threading.Event()
    every = max(1.0, min(rec.idle_timeout_s / 3, 30.0)) if rec.idle_timeout_s > 0 else 30.0

    def beat():
        while not stop.wait(every):
            with contextlib.suppress(OSError):
                touch()
    t = threading.Thread(target=beat, name="dcptool-spark-keep-alive", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=1)
        with contextlib.suppress(OSError):
            touch()


# --- processes ------------------------------------------------------------------------------

def start_time(pid: int) -> int | None:
    """When process `pid` started (/proc/PID/stat field 22, clock ticks since boot), or None
    when there is no such process (or it has exited: a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()   # after the command name: field 3 on
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return int(fields[19])


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


WATCHDOG_MARK = b"dcptool.replay.spark.connect_server\0watch\0"


def is_ours(pid: int | None, started: int | None, mark: bytes) -> bool:
    """Process `pid` is the one a record names: alive, its command line carries `mark` (the
    server class, or the watchdog's module and `watch`), and it started when the record says
    (when the record says; a recycled pid started later). Never pid 1 or below."""
    if not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        return False
    now = start_time(pid)
    if now is None or (started is not None and now != started):
        return False
    return mark in _cmdline(pid)


def is_server_process(pid: int, started: int | None = None) -> bool:
    """`pid` is alive and is a Spark Connect server (a recycled pid is not)."""
    return is_ours(pid, started, SERVER_CLASS.encode())


def record_is_ours(rec: Record) -> bool:
    """The record's server process is alive and is the one it recorded."""
    return is_server_process(rec.pid, rec.pid_start)


def answers(host: str, port: int, timeout: float = 2.0) -> bool:
    """The server's gRPC port accepts a connection."""
    host = LOOPBACK if host in ("0.0.0.0", "localhost") else host
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _terminate(pid: int, started: int | None, grace: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; each only while `pid` is still the process
    that started at `started` (a pid freed and reused meanwhile is not signalled)."""
    now = start_time(pid)
    if now is None or (started is not None and now != started):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if start_time(pid) is None:
            return
        time.sleep(0.1)   # waiting for a process we do not parent to exit: poll, bounded
    if started is None or start_time(pid) == started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def spark_home() -> str:
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("pyspark is not installed")
    return list(spec.submodule_search_locations)[0]


def _spark_version(home: str) -> str | None:
    with contextlib.suppress(OSError):
        with open(os.path.join(home, "version.py")) as f:
            m = re.search(r"__version__[^\"']*[\"']([^\"']+)", f.read())
            return m.group(1) if m else None
    return None


def server_command(home: str, host: str, port: int, warehouse: str) -> list[str]:
    conf = dict(SESSION_CONF)
    conf.update({
        "spark.connect.grpc.binding.address": host,
        "spark.connect.grpc.binding.port": str(port),
        "spark.driver.host": LOOPBACK,
        "spark.driver.bindAddress": LOOPBACK,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.catalogImplementation": "in-memory",
        "spark.sql.warehouse.dir": warehouse,
        "spark.log.level": "WARN",
    })
    cmd = [os.path.join(home, "bin", "spark-submit"), "--master", "local[*]", "--driver-memory", "2g",
           "--name", "dcptool Spark Connect server", "--class", SERVER_CLASS]
    for k, v in conf.items():
        cmd += ["--conf", f"{k}={v}"]
    return cmd + ["spark-internal"]


def server_env(home: str, token: str) -> dict[str, str]:
    """The server's environment: no credentials of ours (a query could read them), the token,
    loopback for everything Spark binds, this interpreter for the Python workers."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DCPTOOL_USER", "DCPTOOL_PASSWORD", "DCPTOOL_PASSWORD_FILE") and not _SECRET_ENV.search(k)}
    for k in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE"):
        env.pop(k, None)
    env.update({TOKEN_ENV: token, "SPARK_HOME": home, "SPARK_LOCAL_IP": LOOPBACK,
                "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable})
    return env


# --- start, stop, status --------------------------------------------------------------------

def current() -> Record | None:
    """The recorded server when its process is alive; a record of a dead one is removed."""
    rec = read_record()
    if rec is None:
        return None
    if not record_is_ours(rec):
        _clear_record(rec.pid)
        return None
    return rec


def start(host: str = LOOPBACK, port: int = DEFAULT_PORT, idle_timeout: float = DEFAULT_IDLE,
          wait: float = 180.0) -> tuple[Record, bool]:
    """Start the server (or reuse the running one: its idle timeout becomes `idle_timeout`).
    Returns (record, started). Waits until the port answers."""
    with _locked():
        rec = current()
        if rec is not None:
            if not answers(rec.host, rec.port):
                raise ServerError(f"a Spark Connect server is running (pid {rec.pid}) but does not answer "
                                  f"on port {rec.port}; `dcptool spark stop` stops it (log: {rec.log})")
            rec.idle_timeout_s = idle_timeout
            _write_record(rec)
            touch()
            return rec, False
        if answers(host, port, timeout=0.5):
            raise ServerError(f"port {port} on {host} is taken by another program; choose one with --port")
        home = spark_home()
        log = _path("log")
        warehouse = os.path.join(state_dir(), "spark-warehouse")
        token = secrets.token_hex(24)
        with open(log, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} starting on {host}:{port}\n".encode())
            out.flush()
            proc = subprocess.Popen(server_command(home, host, port, warehouse), env=server_env(home, token),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                    cwd=state_dir())
        rec = Record(pid=proc.pid, host=host, port=port, token=token, log=log, started_at=time.time(),
                     idle_timeout_s=idle_timeout, spark_version=_spark_version(home), pid_start=start_time(proc.pid))
        deadline = time.monotonic() + wait
        while not answers(host, port, timeout=0.5):
            if proc.poll() is not None:
                raise ServerError(f"the Spark Connect server exited during start-up (status {proc.returncode}); "
                                  f"see {log}")
            if time.monotonic() > deadline:
                _terminate(proc.pid, start_time(proc.pid))
                raise ServerError(f"the Spark Connect server did not answer within {wait:.0f}s; see {log}")
            time.sleep(0.25)   # waiting for the JVM to open its port: poll, bounded by the deadline
        _write_record(rec)
        touch()
        rec.watchdog_pid = _start_watchdog(rec)
        rec.watchdog_start = start_time(rec.watchdog_pid)
        _write_record(rec)
        return rec, True


def _start_watchdog(rec: Record) -> int:
    with open(rec.log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dcptool.replay.spark.connect_server", "watch", str(rec.pid)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                env=dict(os.environ, **{STATE_ENV: state_dir()}))
    return proc.pid


def stop() -> tuple[Record | None, bool]:
    """Stop the recorded server and its watchdog, each only when it is the process the record
    names (pid, start time and command line: a pid reused by another program is never
    signalled). Returns (the record or None, whether its server was running): a record of a
    server that is gone, or whose pid is now another program's, is stale and only removed."""
    with _locked():
        rec = read_record()
        if rec is None:
            return None, False
        _clear_record()   # first: no replay picks a server that is stopping
        if rec.watchdog_pid is not None and is_ours(rec.watchdog_pid, rec.watchdog_start, WATCHDOG_MARK):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.watchdog_pid, signal.SIGTERM)
        if not record_is_ours(rec):
            return rec, False
        _terminate(rec.pid, rec.pid_start)
        return rec, True


def status() -> dict:
    rec = current()
    if rec is None:
        return {"running": False, "state_dir": state_dir()}
    now = time.time()
    used = last_used(rec)
    return {"running": True, "answers": answers(rec.host, rec.port), "url": rec.url, "host": rec.host,
            "port": rec.port, "pid": rec.pid, "log": rec.log, "spark_version": rec.spark_version,
            "started_at": rec.started_at, "idle_timeout_s": rec.idle_timeout_s,
            "idle_s": round(now - used, 1), "stops_in_s": (round(max(0.0, rec.idle_timeout_s - (now - used)), 1)
                                                          if rec.idle_timeout_s > 0 else None),
            "state_dir": state_dir()}


def warm() -> tuple[Record | None, str | None]:
    """For `replay --spark`: (the recorded server, when it answers; a warning when one is
    recorded but cannot be used)."""
    try:
        rec = read_record()
    except StateDirError as exc:
        return None, str(exc)
    if rec is None:
        return None, None
    if not record_is_ours(rec):
        _clear_record(rec.pid)
        return None, f"the recorded Spark Connect server (pid {rec.pid}) is gone"
    if not answers(rec.host, rec.port):
        return None, f"the Spark Connect server (pid {rec.pid}) does not answer on port {rec.port}"
    return rec, None


# --- the watchdog -------------------------------------------------------------------------

def watch(pid: int) -> None:
    """Stop server `pid` once no replay used it for its idle timeout (read from the record
    each round, so `spark start --idle-timeout` changes a running server's). Ends with the
    server, or when the record names another server."""
    while True:
        rec = read_record()
        if rec is None or rec.pid != pid or not record_is_ours(rec):
            _clear_record(pid)
            return
        idle = time.time() - last_used(rec)
        if rec.idle_timeout_s > 0 and idle >= rec.idle_timeout_s:
            with _locked():
                rec = read_record()
                if rec is None or rec.pid != pid or time.time() - last_used(rec) < rec.idle_timeout_s:
                    continue
                print(f"--- idle for {idle:.0f}s: stopping the server (pid {pid})", flush=True)
                _clear_record(pid)   # first: no replay picks a server that is stopping
                _terminate(pid, rec.pid_start)
            return
        left = rec.idle_timeout_s - idle if rec.idle_timeout_s > 0 else 60.0
        time.sleep(max(0.1, min(left, 10.0)))   # a timer: the next moment the server may be idle


if __name__ == "__main__":   # the watchdog process: python -m dcptool.replay.spark.connect_server watch PID
    if len(sys.argv) == 3 and sys.argv[1] == "watch":
        watch(int(sys.argv[2]))   # `spark stop` ends it with SIGTERM (its default action)
