"""What a run of `stream` or `capture` is given, as plain data: the connection and stream
options of a source (LiveOptions) and what a capture adds (CaptureSettings). The CLI builds
them from its options (cli/live.py); a program may build them itself."""

from __future__ import annotations

import dataclasses
import os

from dcptool.capture.sources import Source


def default_name(source: Source) -> str:
    """The connection name of a run given no --name (DCP_OPEN's name, Synapse's NAME): the
    same for `stream` and `capture`, DCP and Synapse."""
    return f"dcptool-{source.host}-{os.getpid()}"


@dataclasses.dataclass
class LiveOptions:
    source: Source
    user: str | None
    password: str | None = dataclasses.field(repr=False, default=None)
    # DCP
    vbuckets: list[int] | None = None
    shard: str | None = None       # capture --shard "K/N": the vbuckets with vb % N == K - 1 (of --vbuckets)
    from_: str = "0"
    to: str = "now"
    name: str | None = None
    no_value: bool = False
    xattrs: bool = False
    collections: bool = False
    buffer_size: int = 20 * 1024 * 1024
    noop_interval: float = 30.0
    timeout: float = 30.0          # DCP: each handshake step, a stream reply, a half frame
    ca_cert: str | None = None
    insecure: bool = False
    sasl_plain: bool = False
    conn_per_node: int = 1         # DCP cluster: connections per KV node
    config_poll: float = 2.5       # DCP cluster: GET_CLUSTER_CONFIG poll interval
    # DCP stream options (issue 13): DCP_CONTROLs and flow control
    compress: bool = False         # force_value_compression
    stream_ids: bool = False       # enable_stream_id: one stream per vbucket per filter group
    sync_writes: bool = False      # enable_sync_writes
    expiry_opcode: bool = True     # enable_expiry_opcode
    change_streams: bool = False   # change_streams (history snapshots: every version of a key)
    oso: bool = False              # enable_out_of_order_snapshots (OSO backfills)
    ack_ratio: float = 0.5         # acknowledge once this share of --buffer-size is unacknowledged
    required_controls: tuple = ()  # the controls given on the command line: a refusal is fatal
    # DCP collection filter (issue 13): names, resolved through GET_COLLECTIONS_MANIFEST
    scopes: tuple = ()             # --scope NAME
    collection_names: tuple = ()   # --collection SCOPE.NAME
    stream_filter: dict | None = None  # already resolved (capture --resume keeps the recorded one)
    stream_groups: tuple = ()      # --stream-ids: (scopes, collections) of sid 1, 2, ...: each
                                   # --collection value, then each --scope
    stream_filters: list | None = None  # --stream-ids, already resolved per stream id (capture --resume)
    # Synapse
    streams: list[str] | None = None
    replicate: bool = True
    # bounds and output
    max_messages: int | None = None
    duration: float | None = None
    values: bool = False
    raw: bool = False
    fmt: str | None = None
    json_summary: bool = False     # stream --json: the summary as JSON (cli/view/run_summary.py)
    verbose: bool = False
    # monitoring (issue 26, docs/CLI.md "Metrics and lag")
    metrics: str | None = None     # --metrics HOST:PORT: Prometheus text at /metrics
    lag_interval: float = 10.0     # DCP: seconds between GET_ALL_VB_SEQNOS lag polls (0: none)

    def safe_dict(self) -> dict:
        """Options as recorded in captures: no password, ever."""
        d = dataclasses.asdict(self)
        d.pop("password", None)
        d["source"] = self.source.url
        return d


@dataclasses.dataclass(frozen=True)
class CaptureSettings:
    """What `capture` adds to the connection options; the one place for its defaults."""
    output: str = "./captures"
    rotate_size: int = 256 * 2**20
    rotate_interval: float = 300.0
    compression: str = "zstd"
    resume: bool = False
    force_new: bool = False     # a new capture next to one of another source (CLI.md `--force-new`)
    quiet: bool = False
    json_summary: bool = False
    # the retention ring (capture/ring.py): None keeps everything
    retain_segments: int | None = None
    retain_size: int | None = None
    retain_age: float | None = None
    # Synapse catch-up (capture/synapse_catchup.py): (instance, replication listener URL) pairs,
    # and the shared secret (from the environment; never recorded)
    catch_up: tuple[tuple[str, str], ...] = ()
    catch_up_secret: str | None = dataclasses.field(default=None, repr=False)
