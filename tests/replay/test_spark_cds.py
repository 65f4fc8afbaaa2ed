"""replay/spark/cds.py: the embedded driver JVM's class-data sharing archive, without a JVM
(the options it gives, and how an archive written by an earlier run is taken into use)."""

import os
import subprocess
import sys

from dcptool.replay.spark import cds as spark_cds


class _Proc:
    def __init__(self, pid):
        self.pid = pid


class _Session:
    """What ClassArchive.started reads of a session: the launched JVM's process."""
    def __init__(self, pid):
        class Ctx:
            pass
        self.sparkContext = Ctx()
        self.sparkContext._gateway = Ctx()
        self.sparkContext._gateway.proc = _Proc(pid)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_first_run_writes_the_archive_at_exit_under_its_own_name(tmp_path, monkeypatch):
    monkeypatch.setenv(spark_cds.ENV, "1")
    archive = spark_cds.ClassArchive(str(tmp_path))
    opts = archive.java_options()
    assert f"-XX:ArchiveClassesAtExit={archive.writing}" in opts and "-Xlog:disable" in opts
    assert archive.writing.startswith(archive.path + ".") and archive.writing.endswith(".tmp")
    archive.started(_Session(12345))
    with open(archive.writing + ".pid") as f:
        assert f.read() == "12345"


def test_a_finished_archive_is_renamed_into_place_and_mapped(tmp_path, monkeypatch):
    monkeypatch.setenv(spark_cds.ENV, "1")
    first = spark_cds.ClassArchive(str(tmp_path))
    first.java_options()
    with open(first.writing, "wb") as f:
        f.write(b"archive")
    first.started(_Session(_dead_pid()))   # its JVM has exited: the archive is complete
    second = spark_cds.ClassArchive(str(tmp_path))
    opts = second.java_options()
    assert second.writing is None
    assert f"-XX:SharedArchiveFile={second.path}" in opts and "-XX:+VerifySharedSpaces" in opts
    assert open(second.path, "rb").read() == b"archive"
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(second.path)]


def test_an_archive_still_being_written_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv(spark_cds.ENV, "1")
    first = spark_cds.ClassArchive(str(tmp_path))
    first.java_options()
    with open(first.writing, "wb") as f:
        f.write(b"half")
    first.started(_Session(os.getpid()))   # a live writer
    second = spark_cds.ClassArchive(str(tmp_path))
    opts = second.java_options()
    assert "ArchiveClassesAtExit" in opts and not os.path.exists(second.path)
    assert os.path.exists(first.writing)


def test_turned_off_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(spark_cds.ENV, "0")
    archive = spark_cds.ClassArchive(str(tmp_path))
    assert archive.java_options() == "" and archive.writing is None
    archive.started(_Session(1))
    assert os.listdir(tmp_path) == []


def test_the_archive_name_follows_where_pyspark_is_installed(tmp_path, monkeypatch):
    """Two environments with the same pyspark version (a second venv, a fresh clone) get
    archives of their own: the JVM refuses an archive written with another class path."""
    import importlib.util
    monkeypatch.setenv(spark_cds.ENV, "1")
    here = spark_cds.ClassArchive(str(tmp_path)).path
    real = importlib.util.find_spec

    class Spec:
        origin = str(tmp_path / "other-venv" / "pyspark" / "__init__.py")

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: Spec() if name == "pyspark" else real(name, *a))
    other = spark_cds.ClassArchive(str(tmp_path)).path
    assert here != other and os.path.dirname(here) == os.path.dirname(other)
