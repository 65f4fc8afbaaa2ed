"""protocol/dcp/wire/cluster_config.py: the bucket config of Couchbase Server 7.x."""

import json

import pytest

from dcptool.protocol.dcp.wire.cluster_config import ClusterConfig, Node, newer, parse
from dcptool.protocol.errors import ErrorCode, RemoteError

# The shape Couchbase Server 7.x returns over GET_CLUSTER_CONFIG (terse bucket config) for a
# 3-node cluster asked on node 0: thisNode without a hostname, "$HOST" in nodes/serverList.
REAL_7X = b"""{"rev":1098,"revEpoch":1,"name":"travel-sample","nodeLocator":"vbucket",
"uuid":"3b2c4a5e8a0e4f9a8b1c9d2e7f6a5b4c","ddocs":{"uri":"/pools/default/buckets/travel-sample/ddocs"},
"collectionsManifestUid":"7","bucketType":"membase","storageBackend":"magma",
"vBucketServerMap":{"hashAlgorithm":"CRC","numReplicas":1,
 "serverList":["$HOST:11210","10.0.0.12:11210","10.0.0.13:11210"],
 "vBucketMap":[[0,1],[1,2],[2,0],[0,-1]]},
"nodes":[{"couchApiBase":"http://$HOST:8092/travel-sample%2B3b2c","hostname":"$HOST:8091","ports":{"direct":11210}},
 {"couchApiBase":"http://10.0.0.12:8092/travel-sample%2B3b2c","hostname":"10.0.0.12:8091","ports":{"direct":11210}},
 {"couchApiBase":"http://10.0.0.13:8092/travel-sample%2B3b2c","hostname":"10.0.0.13:8091","ports":{"direct":11210}}],
"nodesExt":[{"services":{"mgmt":8091,"mgmtSSL":18091,"kv":11210,"kvSSL":11207,"capi":8092,"capiSSL":18092,
  "projector":9999},"thisNode":true},
 {"services":{"mgmt":8091,"mgmtSSL":18091,"kv":11210,"kvSSL":11207,"n1ql":8093},"hostname":"10.0.0.12"},
 {"services":{"mgmt":8091,"mgmtSSL":18091,"kv":11210,"kvSSL":11207},"hostname":"10.0.0.13"},
 {"services":{"mgmt":8091,"n1ql":8093},"hostname":"10.0.0.14"}],
"clusterCapabilitiesVer":[1,0],"clusterCapabilities":{"n1ql":["enhancedPreparedStatements"]},
"bucketCapabilitiesVer":"","bucketCapabilities":["collections","durableWrite","dcp","cccp","nodesExt","xattr"],
"someFutureField":{"x":1}}"""


def sample(rev=5, epoch=0):
    nodes = tuple(Node("127.0.0.1", 12000 + i, mgmt=9000 + i) for i in range(3))
    vbmap = tuple((vb % 3, (vb + 1) % 3) for vb in range(8))
    return ClusterConfig(rev=rev, rev_epoch=epoch, name="default", uuid="abc", nodes=nodes,
                         vbucket_map=vbmap, num_replicas=1)


def test_round_trip_keeps_every_routing_fact():
    cfg = sample()
    back = parse(cfg.render(), "127.0.0.1")
    assert back.key == (0, 5) and back.name == "default" and back.uuid == "abc"
    assert back.nodes == cfg.nodes
    assert back.vbucket_map == cfg.vbucket_map and back.num_replicas == 1
    assert back.server_list == ("127.0.0.1:12000", "127.0.0.1:12001", "127.0.0.1:12002")


def test_render_has_the_7x_fields():
    d = json.loads(sample().render(1))
    assert d["nodeLocator"] == "vbucket" and d["vBucketServerMap"]["hashAlgorithm"] == "CRC"
    assert {"rev", "revEpoch", "name", "uuid", "nodes", "nodesExt", "bucketCapabilities"} <= set(d)
    assert "dcp" in d["bucketCapabilities"] and "cccp" in d["bucketCapabilities"]
    ext = d["nodesExt"]
    assert [e.get("thisNode", False) for e in ext] == [False, True, False]
    assert "hostname" not in ext[1] and ext[0]["hostname"] == "127.0.0.1"
    assert all({"kv", "mgmt"} <= set(e["services"]) for e in ext)
    assert d["vBucketServerMap"]["serverList"][1] == "$HOST:12001"
    assert d["nodes"][1]["hostname"] == "$HOST:9001" and d["nodes"][1]["ports"]["direct"] == 12001
    # the same node named by its address
    assert json.loads(sample().render("127.0.0.1:12001")) == d


def test_host_placeholder_becomes_the_address_used():
    cfg = parse(sample().render(2), "192.168.5.5")
    assert cfg.nodes[2].hostname == "192.168.5.5" and cfg.nodes[2].kv == 12002
    assert cfg.nodes[0].hostname == "127.0.0.1"
    assert cfg.nodes[2].mgmt == 9002


def test_real_7x_config():
    cfg = parse(REAL_7X, "db1.example.com")
    assert cfg.key == (1, 1098) and cfg.name == "travel-sample"
    assert cfg.server_list == ("db1.example.com:11210", "10.0.0.12:11210", "10.0.0.13:11210")
    assert cfg.nodes[0] == Node("db1.example.com", 11210, 11207, 8091, 18091)
    assert cfg.active_node(1).hostname == "10.0.0.12"
    assert [n.hostname for n in cfg.replica_nodes(2)] == ["db1.example.com"]
    assert cfg.replica_nodes(3) == ()
    assert len(cfg.kv_nodes()) == 3            # the query-only node is not a KV node
    assert cfg.active_vbuckets(0) == [0, 3]
    assert cfg.node_index("10.0.0.13", 11210) == 2


def test_uncovered_vbucket():
    d = json.loads(sample().render())
    d["vBucketServerMap"]["vBucketMap"][3] = [-1, -1]
    cfg = parse(json.dumps(d).encode(), "h")
    assert cfg.active_node(3) is None


def test_ordering_by_epoch_then_rev():
    assert newer(sample(6), sample(5))
    assert not newer(sample(5), sample(5))
    assert not newer(sample(4), sample(5))
    assert newer(sample(1, epoch=1), sample(99, epoch=0))
    assert not newer(sample(99, epoch=0), sample(1, epoch=1))
    assert newer(sample(5), None) and not newer(None, sample(5))
    assert newer(sample(0), sample(50))        # rev 0 always applies


def _broken(mutate):
    d = json.loads(sample().render())
    mutate(d)
    return json.dumps(d).encode()


@pytest.mark.parametrize("data, what", [
    (b"not json", "not JSON"),
    (b"[1,2]", "not a JSON object"),
    (_broken(lambda d: d.pop("rev")), "rev is missing"),
    (_broken(lambda d: d.update(rev="7")), "rev is not an integer"),
    (_broken(lambda d: d.pop("name")), "name is missing"),
    (_broken(lambda d: d.pop("vBucketServerMap")), "vBucketServerMap is missing"),
    (_broken(lambda d: d["vBucketServerMap"].pop("serverList")), "serverList is missing"),
    (_broken(lambda d: d.pop("nodesExt")), "nodesExt is missing"),
    (_broken(lambda d: d["vBucketServerMap"]["vBucketMap"].__setitem__(0, [5, 0])), "names node 5"),
    (_broken(lambda d: d["vBucketServerMap"]["vBucketMap"].__setitem__(0, [])), "non-empty"),
    (_broken(lambda d: d["vBucketServerMap"].__setitem__("serverList", ["nohost"])), "HOST:PORT"),
    (_broken(lambda d: d["nodesExt"][0]["services"].__setitem__("kv", "x")), "not a port"),
])
def test_malformed_configs_are_typed_errors(data, what):
    with pytest.raises(RemoteError) as ei:
        parse(data, "127.0.0.1")
    assert ei.value.code == ErrorCode.BAD_CLUSTER_CONFIG
    assert what in ei.value.message and "\n" not in ei.value.message


def test_global_config_is_not_a_bucket_config():
    data = sample().render_global(0)
    assert set(json.loads(data)) >= {"rev", "nodesExt"}
    with pytest.raises(RemoteError):
        parse(data, "127.0.0.1")
