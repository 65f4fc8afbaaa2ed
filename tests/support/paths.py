"""Where things are, computed once: the repository root, the recorded fixtures, and the
`dcptool` entry point installed beside the running interpreter (the one the tests exercise)."""

from __future__ import annotations

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
DCPTOOL = os.path.join(os.path.dirname(sys.executable), "dcptool")
