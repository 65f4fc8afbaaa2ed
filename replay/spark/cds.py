"""The class-data sharing (CDS) archive of the embedded Spark driver JVM: the classes Spark
loads at start-up (tens of thousands, from ~250 jars), parsed and verified once and then
mapped by every later JVM, which saves seconds of each cold `replay --spark` (REPLAY.md "Warm
Spark"). No pyspark import (only replay/spark/engine.py imports it).

The first run writes the archive when its JVM exits (-XX:ArchiveClassesAtExit), under a
name of its own next to a file with the JVM's pid; a later run renames it into place once
that JVM is gone (a JVM still writing is never read). Every run that maps it has the JVM
check its checksum (-XX:+VerifySharedSpaces) and fall back to loading classes from the jars
when it does not fit (-Xshare:auto: another JDK, other jars, a damaged file). The key in
the name changes with the java binary, the pyspark version and where pyspark is installed
(the archive only fits the class path it was written with), so an upgrade or another
environment writes its own archive. JVM logging is off: its warnings would go to stdout,
which carries only data.
DCPTOOL_SPARK_CDS=0 turns all of this off."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import time

ENV = "DCPTOOL_SPARK_CDS"
QUIET = "-Xlog:disable"
STALE_S = 3600.0   # a half-written archive without a live writer, removed after an hour


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _key() -> str:
    java = shutil.which("java", path=os.path.join(os.environ["JAVA_HOME"], "bin")) if os.environ.get("JAVA_HOME") \
        else shutil.which("java")
    parts = []
    if java:
        java = os.path.realpath(java)
        with contextlib.suppress(OSError):
            parts += [java, str(os.stat(java).st_mtime_ns)]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        parts.append(importlib.metadata.version("pyspark"))
    # where the jars are: the JVM keeps an archive's classes only on the class path it was
    # written with, so two environments with the same pyspark (a second venv, a fresh clone)
    # must not share one archive (the other's would be refused at every start, silently)
    spec = importlib.util.find_spec("pyspark")
    if spec is not None and spec.origin:
        parts.append(os.path.realpath(os.path.dirname(spec.origin)))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


class ClassArchive:
    def __init__(self, directory: str):
        self.enabled = os.environ.get(ENV, "1") != "0"
        self.path = os.path.join(directory, f"spark-cds-{_key()}.jsa")
        self.writing: str | None = None

    def _adopt(self) -> None:
        """Rename a finished archive of an earlier run into place; remove abandoned ones."""
        for tmp in glob.glob(glob.escape(self.path) + ".*.tmp"):
            try:
                with open(tmp + ".pid") as f:
                    pid = int(f.read().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            try:
                age = time.time() - os.stat(tmp).st_mtime
            except OSError:
                continue
            if pid and _alive(pid):
                continue
            if not pid and age < STALE_S:
                continue   # its JVM may be starting still (the pid file comes after)
            with contextlib.suppress(OSError):
                if pid and not os.path.exists(self.path):
                    os.replace(tmp, self.path)
                else:
                    os.unlink(tmp)
            with contextlib.suppress(OSError):
                os.unlink(tmp + ".pid")

    def java_options(self) -> str:
        """The driver's extra JVM options: map the archive, or write one at exit."""
        if not self.enabled:
            return ""
        with contextlib.suppress(OSError):
            self._adopt()
        if os.path.exists(self.path):
            return f"-Xshare:auto -XX:+VerifySharedSpaces -XX:SharedArchiveFile={self.path} {QUIET}"
        self.writing = f"{self.path}.{os.getpid()}.{time.time_ns()}.tmp"
        return f"-XX:ArchiveClassesAtExit={self.writing} {QUIET}"

    def started(self, session) -> None:
        """Record the pid of the JVM that writes the archive at its exit."""
        if self.writing is None:
            return
        try:
            pid = session.sparkContext._gateway.proc.pid
        except AttributeError:   # not a JVM this process launched
            return
        with contextlib.suppress(OSError):
            with open(self.writing + ".pid", "w") as f:
                f.write(str(pid))
