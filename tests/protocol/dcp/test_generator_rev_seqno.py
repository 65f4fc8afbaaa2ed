"""Issue 39, finding 9: the built-in generator gives each change of a key the rev seqno
kv_engine gives it (was 1 for every change): 1 for a key the vbucket never held, else the
previous version's + 1, deletions and expirations included; a sync write's prepare and commit
carry the same rev, an abort leaves the document's as it was; a failover's lost versions take
their revs with them. Checked against an independent model of the whole history."""

from __future__ import annotations

import random

import pytest

from dcptool.protocol.dcp.server.bucket import Bucket
from dcptool.protocol.dcp.server.manifest import Manifest


def _expected_revs(items):
    """The rev seqno each item must carry, computed from the history alone."""
    last: dict[tuple[int, bytes], int] = {}
    pending: dict[tuple[int, bytes], int] = {}
    out = []
    for it in items:
        key = (it.cid, it.key)
        if it.kind in ("sc", "sd"):
            out.append(it.rev)             # collection events: no document
            continue
        if it.kind == "p":
            pending[key] = last.get(key, 0) + 1
            out.append(pending[key])
            continue
        if it.kind in ("c", "a"):
            rev = pending.pop(key)
            if it.kind == "c":
                last[key] = rev
            out.append(rev)
            continue
        last[key] = last.get(key, 0) + 1
        out.append(last[key])
    return out


@pytest.mark.parametrize("seed, scopes, sync", [(1, 0, 0.0), (7, 2, 0.0), (3, 0, 0.4), (11, 2, 0.3)])
def test_every_change_of_a_key_increments_its_rev(seed, scopes, sync):
    b = Bucket(num_vbuckets=4, items=40, seed=seed, manifest=Manifest(scopes, 2) if scopes else None)
    b.sync_ratio = sync
    b.mutate_random(600)
    updated = 0
    for vb in b.vbuckets:
        items = list(vb.items())
        assert [it.rev for it in items] == _expected_revs(items), vb.vbid
        updated += sum(1 for it in items if it.rev > 1)
    assert updated > 300                   # most live changes touch a key that exists


def test_update_then_delete_then_recreate():
    b = Bucket(num_vbuckets=1, items=1, seed=0)
    vb = b.vbuckets[0]
    key = vb.disk_item(1).key
    assert vb.disk_item(1).rev == 1
    assert vb.append(key, b'{"a":1}', "m", b.next_cas()).rev == 2
    assert vb.append(key, b"", "d", b.next_cas()).rev == 3
    assert vb.append(key, b'{"a":2}', "m", b.next_cas()).rev == 4       # the tombstone's + 1
    assert vb.append(b"new-key", b"{}", "m", b.next_cas()).rev == 1
    vb.append_sync(key, b'{"a":3}', b.next_cas(), commit=False)
    assert [it.rev for it in vb.mem[-2:]] == [5, 5]
    assert vb.append(key, b"", "x", b.next_cas()).rev == 5               # the abort changed nothing


def test_failover_forgets_the_lost_versions():
    b = Bucket(num_vbuckets=1, items=3, seed=2)
    vb = b.vbuckets[0]
    key = vb.disk_item(1).key
    for _ in range(4):
        vb.append(key, b"{}", "m", b.next_cas())        # revs 2..5 at seqnos 4..7
    r = vb.fail_over(99, 5, random.Random(0), b.next_cas())   # keeps seqnos 1..5: key at rev 3
    assert r == 5
    items = list(vb.items())
    assert [it.rev for it in items] == _expected_revs(items)
    # each lost change is rewritten (two here), following rev 3
    assert [it.rev for it in items if it.key == key] == [1, 2, 3, 4, 5]
