"""The benches' one bootstrap. A bench runs as a script (`make bench`: `python
tests/bench/bench_x.py`, its folder first on sys.path), where the repository root is not on
sys.path; `import _repo` puts it there, so the bench then takes every path from
tests/support/paths.py (ROOT, FIXTURES, DCPTOOL) and imports its sibling benches as
tests.bench.bench_y. This is the only place under tests/ besides paths.py that looks at
__file__ to find the repository."""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
