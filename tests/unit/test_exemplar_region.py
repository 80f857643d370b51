"""The exemplar region's state machine: what is wanted is held once within the bound, freed pages are reused, a
reader never returns bytes freed under its copy, and a region whose users died is reclaimed."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from coordl._core.shm import list_segments, reclaim_dead
from coordl._rehearsal import exemplars
from coordl._rehearsal.exemplars import PAGE, ExemplarRegion, region_name
from coordl.exceptions import ShmCapacityError


def _item(index: int, size: int) -> bytes:
    return bytes([index % 251]) * size


@pytest.fixture
def region():
    region = ExemplarRegion(region_name("test-cache", 0, 1), n_items=16, pages=8)
    yield region
    region.close()


def test_only_wanted_items_are_held_once_and_within_the_bound(region):
    assert not region.wants(0) and not region.put(0, _item(0, 100))
    region.keep([0, 1, 2])
    assert region.put(0, _item(0, 3 * PAGE), (7, 8)) and region.put(1, _item(1, 1))
    assert not region.put(1, _item(1, 1))  # held already
    assert not region.put(2, _item(2, 5 * PAGE))  # 4 + 1 pages are taken: it does not fit
    assert region.get(0) == (_item(0, 3 * PAGE), (7, 8, 3 * PAGE)) and region.get(1)[0] == _item(1, 1)
    assert region.get(2) is None and region.get(3) is None
    assert region.stats() == {"items": 2, "bytes": 3 * PAGE + 1, "bound": 8 * PAGE, "refused": 1}
    assert region.sizes([0, 1, 2]) == [3 * PAGE, 1, None]


def test_keeping_fewer_frees_their_pages_for_others_even_scattered(region):
    region.keep(range(6))
    for index in range(4):
        assert region.put(index, _item(index, 2 * PAGE))  # pages 0-1, 2-3, 4-5, 6-7
    assert region.keep([1, 3, 4, 5]) == 2  # pages 0-1 and 4-5 come free, apart
    assert region.get(0) is None and region.get(2) is None
    assert region.put(4, _item(4, 4 * PAGE - 10))  # across both freed runs
    assert region.get(4)[0] == _item(4, 4 * PAGE - 10)
    assert region.get(1)[0] == _item(1, 2 * PAGE) and region.get(3)[0] == _item(3, 2 * PAGE)
    assert not region.put(5, _item(5, 1))  # every page is held
    assert region.keep([]) == 3 and region.stats()["items"] == 0
    assert region.put(5, _item(5, 1)) is False  # no longer wanted
    region.keep([5])
    assert region.put(5, _item(5, 8 * PAGE)) and region.get(5)[0] == _item(5, 8 * PAGE)


def test_a_reader_whose_item_is_freed_and_reused_under_its_copy_drops_what_it_copied(region, monkeypatch):
    region.keep([0, 1])
    region.put(0, _item(0, 2 * PAGE))
    other = ExemplarRegion(region.name, region.n_items, region.pages)  # another process's handle, in effect
    copy = exemplars.ExemplarRegion._copy

    def copy_then_free_and_reuse(self, views, head, length):
        copied = copy(self, views, head, length)
        monkeypatch.setattr(exemplars.ExemplarRegion, "_copy", copy)
        other.keep([1])  # item 0 leaves; its pages go to item 1
        assert other.put(1, _item(1, 8 * PAGE))
        return copied

    monkeypatch.setattr(exemplars.ExemplarRegion, "_copy", copy_then_free_and_reuse)
    assert region.get(0) is None  # not the bytes item 1 now holds in its pages
    assert region.get(1)[0] == _item(1, 8 * PAGE)
    other.close()


def test_a_reader_that_sees_another_item_freed_under_its_copy_reads_its_own_again(region, monkeypatch):
    region.keep([0, 1])
    region.put(0, _item(0, PAGE))
    region.put(1, _item(1, PAGE))
    copy, copies = exemplars.ExemplarRegion._copy, []

    def copy_while_freeing(self, views, head, length):
        copies.append(head)
        if len(copies) == 1:
            region.keep([0])  # item 1 leaves during item 0's copy
        return copy(self, views, head, length)

    monkeypatch.setattr(exemplars.ExemplarRegion, "_copy", copy_while_freeing)
    assert region.get(0)[0] == _item(0, PAGE) and len(copies) == 2


def test_a_region_whose_users_were_killed_is_removed_by_the_next_coordl_process(tmp_path):
    name = region_name("killed-cache", 0, 1)
    script = textwrap.dedent(f"""
        import os, signal, sys
        from coordl._rehearsal.exemplars import ExemplarRegion
        region = ExemplarRegion({name!r}, n_items=4, pages=4)
        region.keep([0])
        region.put(0, b"x")
        print("held", flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=os.environ.copy())
    assert child.stdout.readline().strip() == b"held"
    assert list_segments("exemplars") == [name]
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert list_segments("exemplars") == [name]  # left behind by the kill
    reclaim_dead()
    assert list_segments("exemplars") == []


def test_a_region_the_shm_file_system_cannot_hold_is_refused_naming_its_size():
    region = ExemplarRegion(region_name("huge-cache", 0, 1), n_items=4, pages=1 << 30)
    with pytest.raises(ShmCapacityError, match=r"exemplar region of 4\.0 TiB .* exemplar_bytes"):
        region.stats()
    assert list_segments("exemplars") == []
