"""Durable writes (sync writes) in the DCP rules of REPLAY.md: the names both engines' SQL takes
them by (replay/rules/plans.py `documents`, `undone`, `history`; replay/rules/history.py).

A prepare is not a document change: it is remembered per document (vbucket,
collection_id, key). A commit is the document change, at the commit's seqno, with the
columns of the last prepare of that document received before it (and not undone by a
rollback): rev_seqno, cas, datatype, item_flags, expiration, value_len. A commit whose
prepare is not in the capture keeps its own columns. An abort never changes a document.
"""

from __future__ import annotations

# ops that change a document (commit: as the prepare it commits)
DOC_CHANGE_OPS = ("mutation", "deletion", "expiration", "commit")
# the columns a commit takes from its prepare
FROM_PREPARE = ("rev_seqno", "cas", "datatype", "item_flags", "expiration", "value_len")
