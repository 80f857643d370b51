"""The cache's crash rows as a state machine on an anonymous mapping: milliseconds, no /dev/shm, no processes.

A stand-in segment says which liveness slots are held, so each row of NOTE [ Concurrency and crashes ]
(a live writer, a dead one, a dead one whose slot was reused, a frozen cache, a full file system) is
driven step by step.
"""

import mmap

import pytest

from coordl._cache import minio as minio_cache
from coordl._cache.minio import MinIOCache, _Views, index_bytes

N, CAPACITY = 6, 1000


class _Slots:
    """The liveness and allocation answers of a segment, chosen by the test."""

    def __init__(self, live=(), allocates=True):
        self.live, self.allocates, self.allocations = set(live), allocates, []

    def slot_alive(self, slot: int) -> bool:
        return slot in self.live

    def allocate(self, offset: int, length: int) -> bool:
        self.allocations.append((offset, length))
        return self.allocates


def _cache(slot=0, live=(), keep_free=0, allocates=True):
    """A cache handle in ``slot`` over a fresh anonymous mapping, and its views."""
    cache = MinIOCache("unit", n_items=N, capacity_bytes=CAPACITY, fingerprint=bytes(32),
                       keep_free_bytes=keep_free)
    buf = mmap.mmap(-1, index_bytes(N) + CAPACITY)
    cache._initialize(buf)
    cache._segment, cache._slot = _Slots({slot, *live}, allocates), slot
    return cache, _Views(buf, N)


def _write(cache, views, index, size):
    """A put's reservation, as the writer in ``cache._slot`` makes it (the copy is left pending)."""
    offset = cache._reserve(views, index, size)
    if offset is not None:
        views.status[index] = -(cache._slot + 1)
    return offset


def test_a_live_writers_item_is_left_to_it():
    cache, views = _cache(slot=0, live={1})
    writer, _ = _cache(slot=1)
    writer._reserve(views, 2, 100)
    views.status[2] = -2  # slot 1 is copying item 2
    assert cache._reserve(views, 2, 100) is None
    assert int(views.header[minio_cache._H_CURSOR]) == 100  # nothing reserved twice


def test_a_dead_writers_item_is_rewritten_in_place_even_once_frozen():
    cache, views = _cache(slot=0)
    other, _ = _cache(slot=1)
    other._segment = cache._segment
    assert _write(other, views, 2, 100) == 0
    assert _write(other, views, 3, 900) == 100
    assert cache._reserve(views, 4, 1) is None and views.header[minio_cache._H_FROZEN]  # full: frozen
    # slot 1 died mid-copy of items 2 and 3: its items are orphaned, and rewritten where they were.
    assert cache._reserve(views, 2, 100) == 0
    assert views.status[3] == minio_cache._ORPHANED
    assert cache._reserve(views, 3, 900) == 100
    assert int(views.header[minio_cache._H_CURSOR]) == 1000  # no space lost to the dead writer


def test_a_reused_slot_never_inherits_its_dead_predecessors_items():
    cache, views = _cache(slot=0)
    views.status[1] = -3  # slot 2 died while writing item 1
    views.offsets[1], views.lengths[1] = 0, 10
    views.header[minio_cache._H_CURSOR] = 10
    views.users[2] = (12345, 1)
    views.reap_dead(live=[0])  # a new process registers: slot 2 is free again
    assert views.status[1] == minio_cache._ORPHANED and not views.users[2].any()
    cache._segment.live.add(2)  # and the new process takes slot 2
    assert cache._reserve(views, 1, 10) == 0


def test_an_orphan_of_another_length_gets_new_space():
    cache, views = _cache(slot=0)
    views.status[1], views.offsets[1], views.lengths[1] = minio_cache._ORPHANED, 0, 10
    views.header[minio_cache._H_CURSOR] = 10
    assert cache._reserve(views, 1, 20) == 10


def test_a_writer_killed_after_moving_the_cursor_leaks_only_that_space():
    cache, views = _cache(slot=0)
    views.header[minio_cache._H_CURSOR] = 50  # a writer died between moving the cursor and marking the item
    assert _write(cache, views, 0, 10) == 50 and views.status[0] == -1


def test_a_growing_cache_allocates_in_chunks_and_freezes_when_the_file_system_is_short(monkeypatch):
    monkeypatch.setattr(minio_cache, "_CHUNK", 4096)
    monkeypatch.setattr(minio_cache, "free_shm_bytes", lambda: 10_000)
    cache, views = _cache(slot=0, keep_free=1000)
    assert _write(cache, views, 0, 100) == 0
    assert cache._segment.allocations == [(views.data_at, 1000)]  # chunk capped at the capacity
    cache, views = _cache(slot=0, keep_free=9500)
    assert _write(cache, views, 0, 100) is None  # growing would leave less than keep_free
    assert views.header[minio_cache._H_FROZEN] == minio_cache._SHM_SHORT
    cache, views = _cache(slot=0, allocates=False)
    assert _write(cache, views, 0, 100) is None and views.header[minio_cache._H_FROZEN]  # ENOSPC: frozen


@pytest.mark.parametrize("state", [minio_cache._EMPTY, minio_cache._READY])
def test_a_frozen_cache_takes_nothing_new(state):
    cache, views = _cache(slot=0)
    views.header[minio_cache._H_FROZEN] = minio_cache._FULL
    views.status[0] = state
    assert cache._reserve(views, 0, 10) is None
