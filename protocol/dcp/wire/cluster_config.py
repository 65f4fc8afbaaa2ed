"""The bucket config (cluster map) of Couchbase Server 7.x, sans-IO: what GET_CLUSTER_CONFIG
(0xb5) returns and what a NOT_MY_VBUCKET body carries (docs/CLUSTER.md).

`ClusterConfig` holds the facts a DCP client routes by: (revEpoch, rev), the KV nodes in
`serverList` order, and per vbucket [active index, replica indexes...] (-1 for none).
`render(this_node)` writes the "terse" JSON the real server sends; `parse(data, host_used)`
reads one (unknown fields ignored, missing required ones refused with a typed RemoteError),
replacing the `$HOST` placeholder, or a missing hostname, with the address used to reach
the node that answered.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dcptool.protocol.errors import ErrorCode, RemoteError

HOST_PLACEHOLDER = "$HOST"
BUCKET_CAPABILITIES = ("collections", "durableWrite", "tombstonedUserXAttrs", "couchapi",
                       "dcp.IgnorePurgedTombstones", "preserveExpiry", "subdoc.ReplicaRead",
                       "rangeScan", "dcp", "cbhello", "touch", "cccp", "xdcrCheckpointing",
                       "nodesExt", "xattr")


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """One KV node. `hostname` may be HOST_PLACEHOLDER in a rendered config, never after parse."""
    hostname: str
    kv: int
    kv_ssl: int | None = None
    mgmt: int = 8091
    mgmt_ssl: int | None = None

    @property
    def address(self) -> str:
        """"host:kv" as in serverList (IPv6 hosts in brackets)."""
        return f"{_bracket(self.hostname)}:{self.kv}"

    def kv_address(self, tls: bool = False) -> tuple[str, int | None]:
        return self.hostname, (self.kv_ssl if tls else self.kv)


@dataclasses.dataclass(slots=True)
class ClusterConfig:
    rev: int
    rev_epoch: int
    name: str
    uuid: str
    nodes: tuple[Node, ...]                   # the KV nodes, in serverList order
    vbucket_map: tuple[tuple[int, ...], ...]  # per vbucket: (active, replica...), -1 = none
    num_replicas: int = 0
    vbucket_map_forward: tuple[tuple[int, ...], ...] | None = None
    bucket_capabilities: tuple[str, ...] = BUCKET_CAPABILITIES

    # ---- routing
    @property
    def key(self) -> tuple[int, int]:
        return self.rev_epoch, self.rev

    @property
    def server_list(self) -> tuple[str, ...]:
        return tuple(n.address for n in self.nodes)

    @property
    def num_vbuckets(self) -> int:
        return len(self.vbucket_map)

    def kv_nodes(self) -> tuple[Node, ...]:
        return self.nodes

    def active_index(self, vb: int) -> int:
        return self.vbucket_map[vb][0]

    def active_node(self, vb: int) -> Node | None:
        """The node the vbucket is active on, or None when the map says -1."""
        i = self.vbucket_map[vb][0]
        return self.nodes[i] if i >= 0 else None

    def replica_nodes(self, vb: int) -> tuple[Node, ...]:
        return tuple(self.nodes[i] for i in self.vbucket_map[vb][1:] if i >= 0)

    def active_vbuckets(self, node_index: int) -> list[int]:
        return [vb for vb, row in enumerate(self.vbucket_map) if row[0] == node_index]

    def node_index(self, host: str, port: int) -> int | None:
        for i, n in enumerate(self.nodes):
            if n.kv == port and n.hostname == host:
                return i
        return None

    # ---- JSON
    def to_json(self, this_node: int | str | None = None) -> dict[str, Any]:
        """The terse bucket config as a dict. this_node (index, or "host:kv") is the node
        that answers: its entries get `thisNode: true` and the `$HOST` placeholder."""
        me = _this_index(self, this_node)

        def host(i: int) -> str:
            return HOST_PLACEHOLDER if i == me else self.nodes[i].hostname

        nodes: list[dict[str, Any]] = []
        ext: list[dict[str, Any]] = []
        for i, n in enumerate(self.nodes):
            nodes.append({"couchApiBase": f"http://{_bracket(host(i))}:8092/{self.name}%2B{self.uuid}",
                          "hostname": f"{_bracket(host(i))}:{n.mgmt}",
                          "ports": {"direct": n.kv}})
            services = {"mgmt": n.mgmt, "kv": n.kv, "capi": 8092}
            if n.mgmt_ssl is not None:
                services["mgmtSSL"] = n.mgmt_ssl
            if n.kv_ssl is not None:
                services["kvSSL"] = n.kv_ssl
            entry: dict[str, Any] = {"services": services}
            if i == me:
                entry["thisNode"] = True
            else:
                entry["hostname"] = n.hostname
            ext.append(entry)
        vbsm: dict[str, Any] = {"hashAlgorithm": "CRC", "numReplicas": self.num_replicas,
                "serverList": [f"{_bracket(host(i))}:{n.kv}" for i, n in enumerate(self.nodes)],
                "vBucketMap": [list(r) for r in self.vbucket_map]}
        if self.vbucket_map_forward is not None:
            vbsm["vBucketMapForward"] = [list(r) for r in self.vbucket_map_forward]
        return {"rev": self.rev, "revEpoch": self.rev_epoch, "name": self.name, "uuid": self.uuid,
                "nodeLocator": "vbucket", "bucketType": "membase", "storageBackend": "couchstore",
                "ddocs": {"uri": f"/pools/default/buckets/{self.name}/ddocs"},
                "collectionsManifestUid": "0",
                "vBucketServerMap": vbsm, "nodes": nodes, "nodesExt": ext,
                "clusterCapabilitiesVer": [1, 0],
                "clusterCapabilities": {"n1ql": ["enhancedPreparedStatements"]},
                "bucketCapabilitiesVer": "", "bucketCapabilities": list(self.bucket_capabilities)}

    def render(self, this_node: int | str | None = None) -> bytes:
        """The config as the server that is node `this_node` sends it (compact JSON)."""
        return json.dumps(self.to_json(this_node), separators=(",", ":")).encode()

    def render_global(self, this_node: int | str | None = None) -> bytes:
        """What a node answers before a bucket is selected: the cluster part only."""
        d = self.to_json(this_node)
        keep = ("rev", "revEpoch", "nodes", "nodesExt", "clusterCapabilitiesVer", "clusterCapabilities")
        return json.dumps({k: d[k] for k in keep}, separators=(",", ":")).encode()


def newer(a: ClusterConfig | None, b: ClusterConfig | None) -> bool:
    """True when config `a` should replace `b`: b is None, a has rev 0 (always applies,
    as SDKs treat it), or a's (revEpoch, rev) is greater."""
    if a is None:
        return False
    if b is None or a.rev == 0:
        return True
    return a.key > b.key


# the bucket's identity: its config's "uuid" (32 hex digits on Couchbase Server)
_UUID_MAX = 64


def bucket_uuid(data: bytes) -> str:
    """The "uuid" of a bucket config's JSON bytes, lower-cased; "" when the body is no
    config or its uuid is missing, not a string, longer than 64 characters or not
    [0-9A-Za-z-] (a server that gives no identity). Never raises: the routing parse
    (`parse`) reports a malformed config."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return ""
    uuid = doc.get("uuid") if isinstance(doc, dict) else None
    if not isinstance(uuid, str) or not 0 < len(uuid) <= _UUID_MAX:
        return ""
    if not all(c.isascii() and (c.isalnum() or c == "-") for c in uuid):
        return ""
    return uuid.lower()


# --------------------------------------------------------------------------- parse

def _bad(what: str) -> RemoteError:
    return RemoteError(ErrorCode.BAD_CLUSTER_CONFIG, f"malformed cluster config: {what}")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _this_index(cfg: ClusterConfig, this_node: int | str | None) -> int | None:
    if this_node is None:
        return None
    if isinstance(this_node, int):
        return this_node if 0 <= this_node < len(cfg.nodes) else None
    for i, n in enumerate(cfg.nodes):
        if n.address == this_node:
            return i
    return None


def _int(d: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        if v is None:
            raise _bad(f"{where}{key} is missing")
        raise _bad(f"{where}{key} is not an integer")
    return v


def _split_hostport(text: str) -> tuple[str, int]:
    if not isinstance(text, str):
        raise _bad("serverList entry is not a string")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise _bad(f"serverList entry {text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    p = int(port)
    if not 0 < p < 65536:
        raise _bad(f"serverList entry {text!r} has a bad port")
    return host, p


def _port(services: dict[str, Any], key: str) -> int | None:
    v = services.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 65536:
        raise _bad(f"nodesExt services.{key} is not a port")
    return v


def _vbmap(rows: object, n_nodes: int, what: str) -> tuple[tuple[int, ...], ...]:
    if not isinstance(rows, list):
        raise _bad(f"{what} is not a list")
    out = []
    for vb, row in enumerate(rows):
        if not isinstance(row, list) or not row:
            raise _bad(f"{what}[{vb}] is not a non-empty list")
        for x in row:
            if isinstance(x, bool) or not isinstance(x, int) or not -1 <= x < n_nodes:
                raise _bad(f"{what}[{vb}] names node {x!r}, serverList has {n_nodes}")
        out.append(tuple(row))
    return tuple(out)


def parse(data: bytes, host_used: str) -> ClusterConfig:
    """A bucket config from its JSON bytes. host_used is the host (no port) the client
    used to reach the node that sent it: it replaces `$HOST` and missing hostnames."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _bad("not a JSON object")
    rev = _int(doc, "rev", "")
    epoch = _int(doc, "revEpoch", "", 0)
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("name is missing (not a bucket config)")
    vbsm = doc.get("vBucketServerMap")
    if not isinstance(vbsm, dict):
        raise _bad("vBucketServerMap is missing")
    servers = vbsm.get("serverList")
    if not isinstance(servers, list):
        raise _bad("vBucketServerMap.serverList is missing")
    ext = doc.get("nodesExt")
    if not isinstance(ext, list):
        raise _bad("nodesExt is missing")
    host_used = host_used[1:-1] if host_used.startswith("[") and host_used.endswith("]") else host_used

    # nodesExt entries with a kv service, keyed by (host, kv port)
    by_addr: dict[tuple[str, int], Node] = {}
    for i, e in enumerate(ext):
        if not isinstance(e, dict) or not isinstance(e.get("services", {}), dict):
            raise _bad(f"nodesExt[{i}] is not an object with services")
        svc = e.get("services", {})
        kv = _port(svc, "kv")
        if kv is None:
            continue
        h = e.get("hostname")
        if h is not None and not isinstance(h, str):
            raise _bad(f"nodesExt[{i}].hostname is not a string")
        if not h or h == HOST_PLACEHOLDER:
            h = host_used
        node = Node(h[1:-1] if h.startswith("[") else h, kv, _port(svc, "kvSSL"),
                    _port(svc, "mgmt") or 8091, _port(svc, "mgmtSSL"))
        by_addr[(node.hostname, kv)] = node
    nodes = []
    for text in servers:
        host, port = _split_hostport(text)
        if host == HOST_PLACEHOLDER:
            host = host_used
        nodes.append(by_addr.get((host, port)) or Node(host, port))
    vbmap = _vbmap(vbsm.get("vBucketMap"), len(nodes), "vBucketMap")
    fwd = vbsm.get("vBucketMapForward")
    forward = _vbmap(fwd, len(nodes), "vBucketMapForward") if fwd is not None else None
    replicas = vbsm.get("numReplicas")
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        replicas = max((len(r) - 1 for r in vbmap), default=0)
    caps = doc.get("bucketCapabilities")
    caps = tuple(c for c in caps if isinstance(c, str)) if isinstance(caps, list) else ()
    uuid = doc.get("uuid")
    return ClusterConfig(rev=rev, rev_epoch=epoch, name=name, uuid=uuid if isinstance(uuid, str) else "",
                         nodes=tuple(nodes), vbucket_map=vbmap, num_replicas=replicas,
                         vbucket_map_forward=forward, bucket_capabilities=caps)
