"""Shared fixtures: one local SparkSession for the whole run (bound to 127.0.0.1), free
loopback ports, and paths to the shared test vectors."""

from __future__ import annotations

import os
import pathlib
import socket

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def spark():
    """One local[2] session for every Spark test: UI off, few shuffle partitions, driver
    bound to loopback."""
    from dcptool.replay.spark import make_session
    session = make_session("local[2]", app_name="dcptool-tests",
                           conf={"spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()
