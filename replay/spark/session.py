"""The Spark session of one replay (the library call, replay/run.py): which Spark runs it
(`--remote`'s endpoint, the warm server of `dcptool spark start`, or an embedded session on a
master), and a progress line while a job runs. What it tells goes through the caller's hooks
(replay/run.py Hooks): this module draws nothing itself and imports no pyspark
(replay/spark/engine.py does)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import warnings
from typing import Any, Iterator
from urllib.parse import urlparse

from dcptool.protocol.errors import ConnectFailed, LateUsageError, one_line

REMOTE_WAIT = 10.0   # seconds --remote may take to accept a connection and answer as gRPC (CLI.md)


class SparkUnreachable(ConnectFailed):
    """The Spark Connect endpoint of --remote cannot be reached or refuses the session (exit 3)."""


class SparkRequestError(LateUsageError):
    """A Spark setting the session refuses, or --sql's check that cannot run there (exit 2)."""


@contextlib.contextmanager
def opened(master: str | None, remote: str | None, conf: dict[str, str], verbose: bool, fenced_sql: bool,
           hooks: Any) -> Iterator[tuple[Any, str]]:
    """(session, label) of this replay, stopped at the end; while it runs, a warm server is
    kept marked as used. `remote`: that endpoint (unreachable: SparkUnreachable); else with no
    `master` the warm server of `dcptool spark start` when it answers (else the embedded
    session, with a warning when one is recorded); else an embedded session on `master`. The
    label says which (the CLI prints it after a successful run)."""
    if not verbose:
        warnings.filterwarnings("ignore", module="pyspark")
        warnings.filterwarnings("ignore", category=FutureWarning)
    session, keep_alive, label = _open(master, remote, conf, verbose, fenced_sql, hooks)
    from dcptool.replay.spark import engine as spark_engine
    with keep_alive:
        try:
            yield session, label
        finally:
            spark_engine.stop_session(session)


def _open(master: str | None, remote: str | None, conf: dict[str, str], verbose: bool, fenced_sql: bool,
          hooks: Any) -> tuple[Any, Any, str]:
    from dcptool.replay.spark import connect_server
    from dcptool.replay.spark import engine as spark_engine
    keep_alive: Any = contextlib.nullcontext()
    url: str | None = None
    token: str | None = None
    label = ""
    if remote:
        _reach(remote)
        url, label = remote, f"Spark Connect {remote}"
    elif master is None:
        rec, warning = connect_server.warm()
        if warning:
            hooks.say(f"{warning}; using an embedded local[*] session", warning=True)
        elif rec is not None and fenced_sql:
            hooks.say("--sql's read-only check needs Spark's parser in this process: an embedded "
                      "local[*] session, not the warm server (--unsafe-sql uses it)")
        elif rec is not None:
            url, token, label = rec.url, rec.token, f"warm Spark Connect server {rec.url} (pid {rec.pid})"
            keep_alive = connect_server.keep_alive(rec)
    if url is None:
        master = master or "local[*]"
        label = f"embedded {master} session"
        with hooks.status(f"starting Spark ({master})"):
            session = spark_engine.make_session(master, app_name="dcptool-replay", conf=conf, verbose=verbose)
        return session, keep_alive, label
    if fenced_sql:
        raise SparkRequestError("--sql over --remote cannot be checked read-only (the check needs Spark's "
                                "parser in this process); add --unsafe-sql to run it as is")
    if token:
        connect_server.touch()   # before the session: the watchdog must not stop it now
    try:
        session = spark_engine.connect_session(url, token, verbose=verbose)
    except Exception as exc:  # noqa: BLE001 - gRPC and Spark errors come as many classes
        raise SparkUnreachable(f"cannot use the Spark Connect server at {url}: {one_line(exc)}") from exc
    for k, v in conf.items():
        try:
            session.conf.set(k, v)
        except Exception as exc:  # noqa: BLE001 - static settings cannot change on a running server
            spark_engine.stop_session(session)
            raise SparkRequestError(f"--conf {k}: {one_line(exc)}") from exc
    return session, keep_alive, label


def _reach(remote: str) -> None:
    """The endpoint accepts a connection and answers as gRPC within REMOTE_WAIT seconds."""
    from dcptool.replay.spark import connect_server
    from dcptool.replay.spark import engine as spark_engine
    parsed = urlparse(remote)
    port = parsed.port or connect_server.DEFAULT_PORT
    deadline = time.monotonic() + REMOTE_WAIT
    try:
        socket.create_connection((parsed.hostname, port), timeout=REMOTE_WAIT).close()
    except OSError as exc:
        raise SparkUnreachable(f"--remote {remote}: cannot reach the Spark Connect server "
                               f"({exc.strerror or exc})") from exc
    if not spark_engine.connect_answers(remote, deadline):
        raise SparkUnreachable(f"--remote {remote}: no Spark Connect (gRPC) server answers there within "
                               f"{REMOTE_WAIT:.0f}s (the port accepts connections: another kind of server?)")


def remote_url_problem(url: str) -> str | None:
    """Why `url` is no --remote endpoint (sc://HOST[:PORT][/;param=value...], without a token:
    a credential never goes on the command line; pyspark reads SPARK_CONNECT_AUTHENTICATE_TOKEN),
    or None."""
    parsed = urlparse(url)
    if parsed.scheme != "sc" or not parsed.hostname:
        return f"--remote wants sc://HOST:PORT, got {url!r}"
    if "token=" in url.lower():
        return "--remote: a token does not go on the command line; set SPARK_CONNECT_AUTHENTICATE_TOKEN instead"
    try:
        parsed.port
    except ValueError:
        return f"--remote: bad port in {url!r}"
    return None


@contextlib.contextmanager
def progress(session: Any, label: str, hooks: Any) -> Iterator[None]:
    """A status line (hooks.status) with Spark's stage progress while a job runs (a Connect
    session has no status tracker in this process: the line says `working`)."""
    from dcptool.replay.spark import engine as spark_engine
    if spark_engine.is_connect(session):
        with hooks.status(f"{label}: working"):
            yield
        return
    stop = threading.Event()
    with hooks.status(f"{label}: starting") as status:
        def poll() -> None:
            tracker = session.sparkContext.statusTracker()
            while not stop.wait(0.5):
                try:
                    done = total = 0
                    for sid in tracker.getActiveStageIds():
                        info = tracker.getStageInfo(sid)
                        if info is not None:
                            done += info.numCompletedTasks
                            total += info.numTasks
                    if status is not None:
                        status.update(f"{label}: {done}/{total} tasks" if total else f"{label}: working")
                except Exception:  # noqa: BLE001 - progress must never break the replay
                    pass
        t = threading.Thread(target=poll, daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join(timeout=2)
