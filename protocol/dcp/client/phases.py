"""The phases of the DCP consumer and the moves between them, kept as data (as h11's
`_state.py` keeps its transitions): one enum for the connection (handshake.py), one for each
stream (streams.py), each with its one table from a phase to the phases it may move to. A move
the table does not hold is a bug of ours or a caller's, never something a server can cause
(answers reach only the handler of their own request): it raises IllegalTransition."""

from __future__ import annotations

import enum
from typing import TypeVar

from dcptool.protocol.errors import ErrorCode, ProtocolError, Side


class ConnPhase(enum.Enum):
    """Where the connection's handshake is: each phase waits for the answer to its request."""
    HELLO = "hello"             # HELLO sent
    SASL = "sasl"               # SASL mechanisms, then authentication rounds
    SELECT = "select"           # SELECT_BUCKET (then GET_ALL_VB_SEQNOS when the vbuckets are not given)
    CONFIG = "config"           # GET_CLUSTER_CONFIG of a cluster session's bootstrap
    ROUTING = "routing"         # the config emitted: waits for Consumer.route()
    MANIFEST = "manifest"       # GET_COLLECTIONS_MANIFEST for --scope / --collection (stays on unknown names)
    OPEN = "open"               # DCP_OPEN
    CONTROL = "control"         # the DCP_CONTROLs
    STREAMING = "streaming"     # the handshake is complete: the streams run


class StreamPhase(enum.Enum):
    """Where one stream (a vbucket, or a vbucket and stream id) is."""
    WAIT = "wait"                   # waiting for its turn (or, handed off, for the caller to take it)
    FLOG = "failover_log"           # GET_FAILOVER_LOG for a start seqno
    REQ = "requested"               # STREAM_REQ sent (again after each rollback)
    OPEN = "open"                   # streaming: its opaque is the stream's
    DONE = "done"                   # ended or failed


CONN_MOVES: dict[ConnPhase, frozenset[ConnPhase]] = {
    ConnPhase.HELLO: frozenset({ConnPhase.SASL, ConnPhase.SELECT}),
    ConnPhase.SASL: frozenset({ConnPhase.SELECT}),
    ConnPhase.SELECT: frozenset({ConnPhase.CONFIG, ConnPhase.MANIFEST, ConnPhase.OPEN}),
    ConnPhase.CONFIG: frozenset({ConnPhase.ROUTING}),
    ConnPhase.ROUTING: frozenset({ConnPhase.MANIFEST, ConnPhase.OPEN}),
    ConnPhase.MANIFEST: frozenset({ConnPhase.OPEN}),
    ConnPhase.OPEN: frozenset({ConnPhase.CONTROL}),
    ConnPhase.CONTROL: frozenset({ConnPhase.STREAMING}),
    ConnPhase.STREAMING: frozenset(),
}

STREAM_MOVES: dict[StreamPhase, frozenset[StreamPhase]] = {
    # a start at or above the end seqno is done without a request
    StreamPhase.WAIT: frozenset({StreamPhase.FLOG, StreamPhase.REQ, StreamPhase.DONE}),
    # answered: the request; NOT_MY_VBUCKET (handoff): back to wait; refused: failed
    StreamPhase.FLOG: frozenset({StreamPhase.REQ, StreamPhase.WAIT, StreamPhase.DONE}),
    # a rollback asks again; NOT_MY_VBUCKET: wait; refused or already at the end: done
    StreamPhase.REQ: frozenset({StreamPhase.REQ, StreamPhase.OPEN, StreamPhase.WAIT, StreamPhase.DONE}),
    # ended: reopened or handed off (wait), or for good
    StreamPhase.OPEN: frozenset({StreamPhase.WAIT, StreamPhase.DONE}),
    # the vbucket given to this connection again (Consumer.add_vbuckets)
    StreamPhase.DONE: frozenset({StreamPhase.WAIT}),
}


class IllegalTransition(ProtocolError):
    """A move between phases that the transition table does not hold."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNEXPECTED_MESSAGE, message, Side.LOCAL)


P = TypeVar("P", ConnPhase, StreamPhase)


def move(table: dict[P, frozenset[P]], now: P, to: P, what: str) -> P:
    """`to` when the table lets `now` move there, else IllegalTransition naming `what`."""
    if to not in table[now]:
        raise IllegalTransition(f"{what}: no move from phase {now.value!r} to {to.value!r}")
    return to
