"""Host-side paging: chained block hashes, ref counts, LRU eviction of cached pages, snapshot slots."""

import pytest

from djax.paging import PageAllocator, SnapshotCache, block_hashes


def test_block_hashes_chain():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # only full blocks
    b = block_hashes([99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # a change in block 0 renames every later block
    assert block_hashes(list(range(40)), 16, upto=16) == a[:1]
    assert block_hashes(list(range(40)) + [7], 16) == a


def test_ref_counts_and_lru_eviction():
    pa = PageAllocator(3)
    p0, p1, p2 = pa.allocate(), pa.allocate(), pa.allocate()
    with pytest.raises(MemoryError):
        pa.allocate()
    pa.register(p0, b"h0")
    pa.register(p1, b"h1")
    pa.release([p0, p1, p2])  # the unhashed page is handed out first; then the tail block (p1) before p0
    assert pa.num_free == 3 and pa.lookup(b"h0") == p0
    pa.share(p0)  # a prefix hit revives a cached page
    assert pa.num_free == 2
    assert pa.allocate() == p2
    assert pa.allocate() == p1 and pa.lookup(b"h1") is None  # evicted
    with pytest.raises(MemoryError):
        pa.allocate()
    pa.release([p0])
    assert pa.lookup(b"h0") == p0


def test_snapshot_lru_and_protection():
    sc = SnapshotCache(2)
    a, b = sc.put(b"a"), sc.put(b"b")
    assert sc.put(b"a") is None  # already stored
    assert sc.get(b"a") == a  # a is now the most recent
    c = sc.put(b"c")
    assert c == b and sc.get(b"b") is None
    assert sc.put(b"d", protect={a, c}) is None
