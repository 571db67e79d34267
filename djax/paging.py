"""Host-side paging: a page allocator with ref counts, chained block hashes, an LRU prefix cache, snapshot slots.

A page holds the compressed state of one block of `block_size` tokens on every compressed layer
(block_size / m pool entries of a ratio-m layer, and the indexer keys of CSA layers), so one page id
serves all layers. A request's page table lists its pages in position order.

Prefix cache: a full block is named by the hash of (previous block's hash, its token ids), so equal
hashes mean equal prefixes. Pages of finished or preempted requests keep their hash while no one
references them and are evicted least recently used first. A hit also needs the per-sequence state
that does not live in pages (sliding-window rings, pending compressor windows) as it was at the
end of the hit: `SnapshotCache` keeps those, per block hash, in a separate fixed-size device store.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def block_hashes(tokens: Sequence[int], block_size: int, upto: int | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of tokens[:upto]: h_i = sha1(h_{i-1} || tokens of block i)."""
    n = (len(tokens) if upto is None else upto) // block_size
    out, prev = [], b""
    arr = np.asarray(tokens[: n * block_size], np.int64)
    for i in range(n):
        prev = hashlib.sha1(prev + arr[i * block_size : (i + 1) * block_size].tobytes()).digest()
        out.append(prev)
    return out


class PageAllocator:
    """Pages 0..num_pages-1 with reference counts; unreferenced hashed pages stay reusable until evicted (LRU)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref = np.zeros(num_pages, np.int32)
        self.hash_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))  # LRU first

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (never used, or cached but unreferenced)."""
        return len(self.free)

    def allocate(self) -> int:
        """A fresh page (evicting the least recently freed cached page); raises MemoryError when none is left."""
        if not self.free:
            raise MemoryError("no free pages")
        page, _ = self.free.popitem(last=False)
        h = self.hash_of.pop(page, None)
        if h is not None and self.page_of.get(h) == page:
            del self.page_of[h]
        self.ref[page] = 1
        return page

    def lookup(self, h: bytes) -> int | None:
        return self.page_of.get(h)

    def share(self, page: int) -> None:
        """Take one more reference on a (cached) page."""
        if self.ref[page] == 0:
            del self.free[page]
        self.ref[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference per page; a page at zero becomes free (kept in the cache if hashed), newest last."""
        for page in reversed(pages):  # tail blocks are evicted before the prefix they extend
            self.ref[page] -= 1
            assert self.ref[page] >= 0, f"page {page} released twice"
            if self.ref[page] == 0:
                self.free[page] = None
                if page not in self.hash_of:  # nothing to keep: hand it out before cached pages
                    self.free.move_to_end(page, last=False)

    def register(self, page: int, h: bytes) -> None:
        """Name a full, computed page by its block hash (a page already holding that hash stays the one found)."""
        if page in self.hash_of or h in self.page_of:
            return
        self.hash_of[page] = h
        self.page_of[h] = page


class SnapshotCache:
    """Slots of a device store of per-sequence ring state, one per block hash, evicted least recently used."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(capacity))[::-1]

    def get(self, h: bytes) -> int | None:
        slot = self.slot_of.get(h)
        if slot is not None:
            self.slot_of.move_to_end(h)
        return slot

    def put(self, h: bytes, protect: set[int] = frozenset()) -> int | None:
        """A slot to write h's snapshot into (None: already stored, or nothing evictable)."""
        if h in self.slot_of or not self.capacity:
            return None
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((k for k, s in self.slot_of.items() if s not in protect), None)
            if victim is None:
                return None
            slot = self.slot_of.pop(victim)
        self.slot_of[h] = slot
        return slot
