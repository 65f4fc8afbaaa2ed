"""`--metrics HOST:PORT`: a capture's live numbers in the Prometheus text format at /metrics
(docs/CLI.md "Metrics and lag"), served by prometheus_client from a thread of the capture process, bound
where the user said and nowhere else.

Nothing is counted per frame for it: the capture keeps its counters as it already does (per
receive batch: one bincount of the batch's opcodes), and a custom collector reads them when
Prometheus scrapes (`LiveMetrics` is that state; `Collector` turns it into metric families).
The scrape runs on another thread while the event loop mutates the dicts it reads, so every
dict is copied first, and a copy that met a resize is tried again."""

from __future__ import annotations

import errno
from typing import Callable, Mapping

import numpy as np

from dcptool.protocol.dcp.wire.constants import op_name
from dcptool.protocol.errors import LateUsageError

PREFIX = "dcptool"


class MetricsAddressError(LateUsageError):
    """--metrics names an address we cannot listen on (in use, not ours): a usage error."""


def parse_listen(text: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); anything else is a usage error."""
    host, sep, port = (text or "").rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise LateUsageError(f"--metrics {text!r}: use HOST:PORT, e.g. 127.0.0.1:9464")
    return host, int(port)


def _copy(d) -> dict:
    for _ in range(20):
        try:
            return dict(d)
        except RuntimeError:   # resized while we copied: the loop thread is adding a key
            continue
    return {}


def _read(fn) -> int:
    try:
        return int(fn())
    except RuntimeError:   # a dict the loop resized while we read it: 0 this scrape
        return 0


class LiveMetrics:
    """What a scrape reads. The capture sets the callables and bumps the counters; DCP frames
    by opcode (count_batch), Synapse lines by command (count_lines)."""

    def __init__(self, protocol: str):
        self.protocol = protocol
        self.op_frames = np.zeros(256, dtype=np.int64)
        self.op_bytes = np.zeros(256, dtype=np.int64)
        self.command_lines: dict[str, list[int]] = {}    # Synapse: command -> [lines, bytes]
        self.rollbacks = 0
        self.reconnects = 0
        self.gaps = 0
        self.high_seqnos: dict[int, int] = {}            # vbucket -> the last polled high seqno
        self.lags: dict[int, int] = {}                   # vbucket -> high seqno - seqno at that poll
        self.seqnos: Callable[[], Mapping] = dict        # vbucket -> last seqno received
        self.positions: Callable[[], Mapping] = dict     # Synapse: (stream, instance) -> POSITION token
        self.unserved: Callable[[], int] = lambda: 0
        self.segments: Callable[[], int] = lambda: 0
        self.queue_depth: Callable[[], int] = lambda: 0
        self._nodes: dict[str, int] = {}                 # node -> the last connection number seen

    def count_batch(self, opcodes: np.ndarray, lengths: np.ndarray) -> None:
        """One receive batch of DCP frames: per opcode, frames and bytes (vectorised)."""
        self.op_frames += np.bincount(opcodes, minlength=256)[:256]
        self.op_bytes += np.bincount(opcodes, weights=lengths, minlength=256)[:256].astype(np.int64)

    def count_record_batch(self, batch) -> None:
        """One batch of received Synapse lines (replay/store/synapse_batch.py): per command,
        lines and bytes, grouped by Arrow (an undecodable line counts as "unknown")."""
        import pyarrow as pa
        import pyarrow.compute as pc
        cmd = batch.column(batch.schema.get_field_index("command"))
        raw = batch.column(batch.schema.get_field_index("raw"))
        if pa.types.is_dictionary(cmd.type):
            cmd = cmd.dictionary_decode()
        t = pa.table({"c": pc.fill_null(cmd.cast(pa.string()), "unknown"),
                      "n": pc.fill_null(pc.binary_length(raw), 0).cast(pa.int64())})
        for row in t.group_by("c").aggregate([("n", "sum"), ("n", "count")]).to_pylist():
            self.count_lines(row["c"], row["n_count"], row["n_sum"])

    def count_lines(self, command: str, lines: int, nbytes: int) -> None:
        c = self.command_lines.get(command)
        if c is None:
            self.command_lines[command] = [lines, nbytes]
        else:
            c[0] += lines
            c[1] += nbytes

    def connected(self, conn: int, node: str | None) -> None:
        """A connection carries frames: a new connection number to a node seen before is a reconnect."""
        key = node or ""
        last = self._nodes.get(key)
        if last == conn:
            return
        if last is not None and conn > last:
            self.reconnects += 1
        self._nodes[key] = conn


class Collector:
    """The prometheus_client collector of one LiveMetrics (read at scrape time)."""

    def __init__(self, live: LiveMetrics):
        self.live = live

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        live = self.live
        frames = CounterMetricFamily(f"{PREFIX}_received_frames", "Frames (DCP) or lines (Synapse) received, "
                                     "by operation.", labels=["op"])
        nbytes = CounterMetricFamily(f"{PREFIX}_received_bytes", "Bytes received on the wire, by operation.",
                                     labels=["op"])
        if live.protocol == "dcp":
            counts, sizes = live.op_frames.copy(), live.op_bytes.copy()
            for op in np.nonzero(counts)[0]:
                frames.add_metric([op_name(int(op))], float(counts[op]))
                nbytes.add_metric([op_name(int(op))], float(sizes[op]))
        else:
            for command, (lines, size) in sorted(_copy(live.command_lines).items()):
                frames.add_metric([command.lower()], float(lines))
                nbytes.add_metric([command.lower()], float(size))
        yield frames
        yield nbytes
        yield CounterMetricFamily(f"{PREFIX}_reconnects", "Connections opened again after one was lost.",
                                  value=live.reconnects)
        yield CounterMetricFamily(f"{PREFIX}_segments_written", "Capture segments finished.",
                                  value=_read(live.segments))
        yield GaugeMetricFamily(f"{PREFIX}_writer_queue_depth", "Record batches waiting for the writer thread.",
                                value=_read(live.queue_depth))
        yield from (self._dcp() if live.protocol == "dcp" else self._synapse())

    def _dcp(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        live = self.live
        seqnos, highs, lags = _copy(live.seqnos()), _copy(live.high_seqnos), _copy(live.lags)
        seq = GaugeMetricFamily(f"{PREFIX}_dcp_vbucket_seqno", "The last seqno received, per vbucket.",
                                labels=["vbucket"])
        high = GaugeMetricFamily(f"{PREFIX}_dcp_vbucket_high_seqno", "The vbucket's high seqno at the last "
                                 "lag poll (GET_ALL_VB_SEQNOS).", labels=["vbucket"])
        lag = GaugeMetricFamily(f"{PREFIX}_dcp_vbucket_lag_items", "Items behind at the last lag poll: its "
                                "high seqno - the last seqno received when it was answered.", labels=["vbucket"])
        for vb in sorted(seqnos):
            seq.add_metric([str(vb)], float(seqnos[vb]))
        for vb in sorted(highs):
            high.add_metric([str(vb)], float(highs[vb]))
        for vb in sorted(lags):
            lag.add_metric([str(vb)], float(lags[vb]))
        yield seq
        yield high
        yield lag
        yield CounterMetricFamily(f"{PREFIX}_rollbacks", "Rollbacks the server asked for.", value=live.rollbacks)
        yield GaugeMetricFamily(f"{PREFIX}_unserved_vbuckets", "Vbuckets no node serves right now.",
                                value=_read(live.unserved))

    def _synapse(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        live = self.live
        pos = GaugeMetricFamily(f"{PREFIX}_synapse_stream_position", "The last POSITION token, per stream "
                                "and instance.", labels=["stream", "instance"])
        for (stream, instance), token in sorted(_copy(live.positions()).items()):
            pos.add_metric([str(stream), str(instance)], float(token))
        yield pos
        yield CounterMetricFamily(f"{PREFIX}_synapse_gaps", "Token gaps seen in the streams.", value=live.gaps)


class MetricsServer:
    """The /metrics endpoint of one run, on a daemon thread; `close()` stops it."""

    def __init__(self, listen: str, live: LiveMetrics):
        from prometheus_client import CollectorRegistry, start_http_server
        host, port = parse_listen(listen)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(Collector(live))
        try:
            self.httpd, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            why = ("address already in use" if exc.errno == errno.EADDRINUSE else
                   "not an address of this host" if exc.errno == errno.EADDRNOTAVAIL else
                   exc.strerror or str(exc))
            raise MetricsAddressError(f"--metrics {listen}: cannot listen there: {why}") from None
        self.port = self.httpd.server_address[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start(listen: str | None, live: LiveMetrics | None) -> MetricsServer | None:
    """The endpoint when --metrics was given (and with it the live numbers), else None."""
    return MetricsServer(listen, live) if listen and live is not None else None


def wire_synapse(live: LiveMetrics | None, handler, client, *, writer=None, bg=None) -> None:
    """--metrics of a Synapse run (capture or stream): `handler` (capture/synapse_capture.py
    SynapseRun) counts into `live`, read with the client's tokens at scrape time."""
    if live is None:
        return
    handler.metrics = live
    live.positions = client.committed      # the last token (RDATA or POSITION) per stream and instance
    if writer is not None:
        live.segments = lambda: len(writer.segments)
    if bg is not None:
        live.queue_depth = lambda: bg.queue_depth


def serve_synapse(opts, handler, client, say=None) -> MetricsServer | None:
    """--metrics of `stream synapse://...`: served and wired (wire_synapse); `say(text)`
    hears where. None without --metrics."""
    live = LiveMetrics("synapse") if opts.metrics else None
    server = start(opts.metrics, live)
    wire_synapse(live, handler, client)
    if server is not None and say is not None:
        say(f"metrics: {server.url}")
    return server


def stop(server: MetricsServer | None) -> None:
    if server is not None:
        server.close()
