"""What a cluster capture must hold, computed two ways: `survivors` of the rows a consumer
received (the items left after every rollback) and `final_state` of the producer's own model;
a correct consumer makes them equal."""

from __future__ import annotations

ROLLBACK = 0x23
ITEM_OPS = ("mutation", "deletion", "expiration")


def survivors(rows) -> dict[int, dict[bytes, int]]:
    """Per vbucket, key -> seqno of the items that survive every rollback, in frame order.
    Asserts that each vbucket's surviving seqnos only rise (no duplicate, no going back)."""
    kept: dict[int, list[tuple[int, str]]] = {}
    rewound: set[int] = set()
    for r in rows:
        if r["direction"] != "in" or r["vbucket"] is None:
            continue
        vb = r["vbucket"]
        if r["op"] == "stream_req" and r["status"] == ROLLBACK:
            kept[vb] = [x for x in kept.get(vb, []) if x[0] <= r["rollback_seqno"]]
            rewound.add(vb)
        elif r["op"] in ITEM_OPS and r["status"] is None:
            lst = kept.setdefault(vb, [])
            if vb in rewound:    # restreamed from a whole snapshot's end below the rollback seqno
                rewound.discard(vb)
                lst[:] = [x for x in lst if x[0] < r["by_seqno"]]
            assert not lst or r["by_seqno"] > lst[-1][0], (vb, r["by_seqno"], lst[-1])
            lst.append((r["by_seqno"], r["key"]))
    return {vb: {key: seq for seq, key in lst} for vb, lst in kept.items()}


def final_state(model) -> dict[int, dict[str, int]]:
    return {vb.vbid: {key.decode(): it.seqno for key, it in vb.latest().items()}
            for vb in model.buckets["default"].vbuckets}
