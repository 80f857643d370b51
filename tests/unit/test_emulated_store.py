"""The emulated disk: reads at its bandwidth, counts device bytes, keeps a bounded LRU page cache."""

import os
import pickle
import time

import pytest

from coordl._demo.emulated_store import EmulatedStore, StoreClient


@pytest.fixture
def files(tmp_path):
    paths = []
    for i in range(3):
        path = tmp_path / f"f{i}"
        path.write_bytes(bytes([i]) * 100_000)
        paths.append(str(path))
    return paths


@pytest.fixture
def store(tmp_path_factory):
    with EmulatedStore(str(tmp_path_factory.mktemp("s") / "sock"), read_bps=1_000_000, page_cache_bytes=0) as s:
        yield s


def test_misses_take_their_time_at_the_bandwidth_and_are_counted(store, files):
    client = StoreClient(store.socket_path)
    started = time.monotonic()
    data = [client.read(p) for p in files]
    assert time.monotonic() - started >= 0.3  # 300 kB at 1 MB/s
    assert data == [bytes([i]) * 100_000 for i in range(3)]
    assert client.device_read_bytes() == 300_000
    assert store.counters() == (300_000, 3)


def test_page_cache_hits_cost_nothing_and_drop_evicts(store, files):
    store.reset(page_cache_bytes=200_000)  # two of the three files
    client = StoreClient(store.socket_path)
    for path in files[:2] * 2:
        client.read(path)
    assert client.device_read_bytes() == 200_000
    client.read(files[2])  # evicts files[0], the least recently used
    client.read(files[1])
    assert client.device_read_bytes() == 300_000
    client.read(files[0])
    assert client.device_read_bytes() == 400_000
    dropping = StoreClient(store.socket_path, drop_page_cache=True)
    dropping.read(files[0])  # a hit, then out of the page cache (posix_fadvise DONTNEED)
    dropping.read(files[0])
    assert client.device_read_bytes() == 500_000
    assert store.counters().read_files == 5


def test_client_travels_to_other_processes_and_reports_missing_files(store, files):
    client = pickle.loads(pickle.dumps(StoreClient(store.socket_path)))
    pid = os.fork()
    if pid == 0:  # a DataLoader worker: its own connection
        os._exit(0 if client.read(files[0]) == bytes(100_000) else 1)
    assert os.waitpid(pid, 0)[1] == 0
    with pytest.raises(OSError, match="could not read"):
        client.read(files[0] + ".missing")


def test_threads_of_one_process_each_get_their_own_answers(store, files):
    import concurrent.futures

    client = StoreClient(store.socket_path)  # as coordl's DALI backend fetches: threads share the client
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        data = list(pool.map(client.read, files * 3))
    assert data == [bytes([i]) * 100_000 for i in range(3)] * 3


def test_image_loader_decodes_what_it_reads_through_the_store(store, tmp_path):
    from PIL import Image

    from coordl._demo.emulated_store import StoreImageLoader

    path = tmp_path / "gray.png"
    Image.new("L", (4, 3), 7).save(path)
    img = StoreImageLoader(store.socket_path)(str(path))
    assert (img.mode, img.size, img.getpixel((0, 0))) == ("RGB", (4, 3), (7, 7, 7))
    assert store.counters() == (path.stat().st_size, 1)
