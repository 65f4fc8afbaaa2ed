"""dcptool.restore: the documents of DCP captures written back into a live bucket with their
metadata (`dcptool restore`), a library call with no click: documents.py selects each key's
last change as of a point in time (the replay engine's `documents` plan, the values cut from
the recorded frames), run.py writes them (protocol/transport/kv_restore.py) and counts."""
