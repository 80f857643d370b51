"""What PyTorch's own DataLoader tests check, where coordl's layer could change it: iterator lifetime and
worker shutdown, iterable-style datasets, worker errors, in_order=False, torch's argument checks, samplers
given as plain iterables, worker-side dataset copies, context objects. Each compares with torch or with what
torch documents. (``tools/torch_dataloader_suite.py`` runs torch's file itself.)"""

import gc
import multiprocessing as mp
import os
import pickle
import time
import warnings

import pytest
import torch
import torch.utils.data as tud

import coordl
from tests._signals import FileEvent

pytestmark = pytest.mark.filterwarnings("ignore:coordl cannot cache")


def _files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def _sizes(root: str) -> coordl.FileDataset:
    """A cacheable dataset whose samples are (file size, index)."""
    files = _files(root)
    return coordl.FileDataset(files, targets=list(range(len(files))), decode=len)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _coordl(dataset, **kwargs) -> coordl.DataLoader:
    return coordl.DataLoader(dataset, cache_bytes="4MiB", **kwargs)


# -- iterators and their workers ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("cached", [True, False])
def test_dropping_a_partly_read_iterator_stops_its_workers_without_gc(image_root, cached, persistent):
    """``it = iter(DataLoader(...))``, a few batches, ``del it``: torch's workers exit at once (the loader,
    holding persistent workers, goes with the iterator), and the cache is given back, with no garbage
    collection needed."""
    dataset = _sizes(image_root) if cached else tud.TensorDataset(torch.arange(96))
    shm = os.environ["COORDL_SHM_DIR"]
    gc.collect()
    gc.disable()
    try:
        it = iter(_coordl(dataset, batch_size=2, num_workers=2, persistent_workers=persistent))
        for _ in range(3):
            next(it)
        workers = list(it._workers)
        assert len(workers) == 2 and all(w.is_alive() for w in workers)
        del it
        for w in workers:
            w.join(20)
        assert [(w.is_alive(), w.exitcode) for w in workers] == [(False, 0), (False, 0)]
        deadline = time.monotonic() + 10
        while os.listdir(shm) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.listdir(shm) == []
    finally:
        gc.enable()


def test_torchs_iterator_attributes_and_shutdown_are_reachable(image_root):
    with _coordl(_sizes(image_root), batch_size=4, num_workers=1, persistent_workers=True) as loader:
        it = iter(loader)
        next(it)
        assert it._workers == loader._iterator._workers and it._num_workers == 1
        it._shutdown_workers()  # what callers of torch's iterator (and torch's own tests) do
        assert not it._workers[0].is_alive()
        with pytest.raises(AttributeError):
            it.no_such_attribute


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_iterator_is_a_torch_dataloader_iterator_and_still_times_the_loop(image_root, num_workers):
    with _coordl(_sizes(image_root), batch_size=4, num_workers=num_workers) as loader:
        it = iter(loader)
        assert isinstance(it, tud.dataloader._BaseDataLoaderIter)  # what frameworks check
        batches = list(it)
        assert len(batches) == len(loader)
        assert it._num_yielded == len(loader)  # the inner iterator's state
        epoch = loader.stats().epochs[-1]
        assert epoch.samples == len(loader.dataset) and epoch.stall_s > 0


class Shards(tud.IterableDataset):
    """Each worker yields ``range(sizes[worker id])`` (the training process, ``range(sizes[0])``); no
    ``__len__``."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __iter__(self):
        worker = tud.get_worker_info()
        return iter(range(self.sizes[worker.id if worker is not None else 0]))


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_an_iterable_dataset_sharded_by_worker_info_loads_as_with_torch(progress):
    for batch_size in (None, 4):
        options = dict(batch_size=batch_size, num_workers=3)
        expected = list(tud.DataLoader(Shards([0, 4, 9]), **options))
        dataset = Shards([0, 4, 9])
        loader = coordl.DataLoader(dataset, progress=progress, **options)
        assert loader.dataset is dataset
        got = list(loader)
        key = repr if batch_size is None else (lambda t: t.tolist())
        assert sorted(map(key, got)) == sorted(map(key, expected))
        assert all(type(g) is int for g in got) if batch_size is None else len(got) == 4  # 0 + 1 + 3 batches


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_datasets_stats_count_the_samples_and_batches_the_loop_received(num_workers):
    """Not the index lists torch hands out (placeholders, drawn ahead and past the dataset's end): 300 samples
    over 2 shards of 150 are 10 batches of at most 32, and 300 unbatched samples."""
    for batch_size in (32, None):
        loader = coordl.DataLoader(Shards([150, 150] if num_workers else [300]), batch_size=batch_size,
                                   num_workers=num_workers)
        for epoch in (1, 2):
            received = list(loader)
            epochs = loader.stats().epochs
            assert len(epochs) == epoch and epochs[-1].complete
            samples = len(received) if batch_size is None else sum(len(b) for b in received)
            assert (epochs[-1].samples, epochs[-1].batches) == (samples, len(received)) and samples == 300
        assert sum(len(b) if batch_size else 1 for b in pickle.loads(pickle.dumps(loader))) == 300

class Counting(tud.IterableDataset):
    """Every worker yields all of ``range(n)`` (not sharded), so 2 workers yield twice ``len``."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


def _len_warnings(make_loader) -> tuple[list[int], int, list[int]]:
    """The samples after which torch warns that more than ``len`` came: reading 2 x len before
    ``len(loader)`` is asked, the length, then reading 2 x len again."""
    loader = make_loader(Counting(10), num_workers=2, batch_size=None)

    def read():
        warned, it = [], iter(loader)
        for n in range(1, 21):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                next(it)
            warned += [n for w in caught if "samples have been fetched" in str(w.message)]
        del it
        return warned

    before = read()
    length = len(loader)
    return before, length, read()


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_an_iterable_datasets_len_warning_comes_only_once_len_was_asked(progress):
    expected = _len_warnings(tud.DataLoader)
    assert expected == ([], 10, list(range(11, 21)))  # what torch does
    assert _len_warnings(lambda ds, **kw: coordl.DataLoader(ds, progress=progress, **kw)) == expected


# -- errors in workers ----------------------------------------------------------------------------------

class FailsOnSome(coordl.FileDataset):
    """Cacheable; samples whose index is 1 mod 4 fail to decode with a LookupError."""

    def decode_raw(self, index, raw):
        if index % 4 == 1:
            raise LookupError(f"no label for sample {index}")
        return len(raw)


def _outcomes(loader) -> list:
    """Each ``next()`` of one pass: the batch, or the error's type and whether it shows the worker's
    traceback (torch's ``Original Traceback`` through ``decode_raw``)."""
    out, it = [], iter(loader)
    while True:
        try:
            out.append(next(it))
        except StopIteration:
            return out
        except LookupError as e:
            out.append((type(e), "Original Traceback" in str(e) and "decode_raw" in str(e)))


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_worker_error_is_torchs_and_the_pass_goes_on(image_root, num_workers):
    """Each failing batch raises the dataset's own exception type (from workers: with the worker's
    traceback), and iteration goes on to the end of the pass, as with torch."""
    dataset = FailsOnSome(_files(image_root)[:24])
    expected = _outcomes(tud.DataLoader(dataset, batch_size=2, num_workers=num_workers))
    with _coordl(dataset, batch_size=2, num_workers=num_workers) as loader:
        got = _outcomes(loader)
    assert len(got) == len(expected) == 12
    assert all(_same(g, e) for g, e in zip(got, expected))
    assert got[0] == (LookupError, num_workers > 0) and torch.is_tensor(got[1])


def raise_in_init(worker_id):
    raise OSError(f"worker {worker_id} cannot open its database")


def test_an_error_in_worker_init_fn_is_raised_as_torch_raises_it(image_root):
    with _coordl(_sizes(image_root), batch_size=4, num_workers=1, worker_init_fn=raise_in_init) as loader:
        with pytest.raises(OSError, match=r"(?s)Caught OSError in DataLoader worker process 0.*cannot open its"):
            next(iter(loader))


# -- in_order=False ---------------------------------------------------------------------------------------

class WaitsOnZero(coordl.FileDataset):
    """Cacheable; sample 0 waits (up to 30 s) until ``released`` is set."""

    released: FileEvent = None

    def decode_raw(self, index, raw):
        if index == 0:
            self.released.wait(30)
        return index


@pytest.mark.slow
def test_in_order_false_hands_out_ready_batches_first_and_ends_the_epoch(image_root, tmp_path):
    dataset = WaitsOnZero(_files(image_root)[:12])
    with _coordl(dataset, batch_size=2, num_workers=2, in_order=False) as loader:
        for epoch in range(2):
            dataset.released = FileEvent(tmp_path)  # workers (not persistent) take a fresh copy each pass
            order = []
            for batch in loader:
                order.append(batch.tolist())
                dataset.released.set()  # the batch of sample 0 can come only now
            assert order[0] != [0, 1] and sorted(order) == [[i, i + 1] for i in range(0, 12, 2)]
            stats = loader.stats().epochs[epoch]
            assert stats.complete and stats.samples == 12


# -- torch's argument checks and attributes -------------------------------------------------------------

def _sequential(n=6):
    return tud.SequentialSampler(range(n))


BAD_ARGUMENTS = [
    dict(num_workers=-1),
    dict(timeout=-1),
    dict(batch_size=None, drop_last=True),
    dict(num_workers=0, multiprocessing_context="spawn"),
    dict(num_workers=1, multiprocessing_context="bad"),
    dict(num_workers=1, multiprocessing_context=object()),
    dict(batch_size=11, sampler=_sequential(), shuffle=True),
    dict(batch_sampler=tud.BatchSampler(_sequential(), 3, False), sampler=_sequential(), shuffle=True),
    dict(batch_size=11, batch_sampler=tud.BatchSampler(_sequential(), 3, False)),
    dict(drop_last=True, batch_sampler=tud.BatchSampler(_sequential(), 3, False)),
    dict(shuffle=True, batch_sampler=tud.BatchSampler(_sequential(), 3, False)),
    dict(num_workers=2, prefetch_factor=-1),
    dict(num_workers=0, prefetch_factor=2),
    dict(persistent_workers=True),
]


@pytest.mark.parametrize("kwargs", BAD_ARGUMENTS, ids=lambda kw: ",".join(kw))
@pytest.mark.parametrize("cached", [True, False])
def test_torchs_argument_errors_come_unchanged(image_root, kwargs, cached):
    """coordl looks at the arguments (and, cached, opens the cache) before torch does: torch's own error,
    word for word, must still be what the user sees."""
    dataset = _sizes(image_root) if cached else tud.TensorDataset(torch.arange(6))
    with pytest.raises(Exception) as torchs:
        tud.DataLoader(dataset, **kwargs)
    with pytest.raises(torchs.type) as coordls:
        _coordl(dataset, **kwargs)
    assert str(coordls.value) == str(torchs.value)


@pytest.mark.parametrize("kwargs", [dict(shuffle=True), dict(sampler=_sequential()), dict(sampler=3),
                                    dict(batch_sampler=tud.BatchSampler(_sequential(), 3, False))],
                         ids=lambda kw: ",".join(kw))
def test_torchs_argument_errors_for_an_iterable_dataset_come_unchanged(kwargs):
    with pytest.raises(ValueError) as torchs:
        tud.DataLoader(Counting(6), **kwargs)
    with pytest.raises(ValueError, match="DataLoader with IterableDataset: expected unspecified") as coordls:
        coordl.DataLoader(Counting(6), **kwargs)
    assert str(coordls.value) == str(torchs.value)


@pytest.mark.parametrize("cached", [True, False])
def test_settings_cannot_be_assigned_after_init(image_root, cached):
    dataset = _sizes(image_root) if cached else tud.TensorDataset(torch.arange(6))
    with _coordl(dataset, batch_size=4) as loader:
        for attr in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset"):
            with pytest.raises(ValueError, match=f"{attr} attribute should not be set"):
                setattr(loader, attr, {})


# -- samplers given as plain iterables -----------------------------------------------------------------

SAMPLERS = {
    "sampler_range": lambda n: dict(sampler=range(2, 12), batch_size=2),
    "batch_sampler_list": lambda n: dict(batch_sampler=[b for s in range(0, 20, 5)
                                                        for b in ((s, s + 1), (s + 2, s + 3, s + 4))]),
    "with_replacement": lambda n: dict(sampler=tud.RandomSampler(range(n), replacement=True, num_samples=n + 5,
                                                                 generator=torch.Generator().manual_seed(3)),
                                       batch_size=6),
}


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", sorted(SAMPLERS))
def test_samplers_given_as_plain_iterables_give_torchs_batches_and_len(image_root, case, num_workers):
    files = _files(image_root)[:24]
    dataset = coordl.FileDataset(files, targets=list(range(len(files))), decode=len)
    expected = tud.DataLoader(dataset, **SAMPLERS[case](len(files)), num_workers=num_workers)
    with _coordl(dataset, **SAMPLERS[case](len(files)), num_workers=num_workers) as loader:
        assert len(loader) == len(expected)
        got = list(loader)
    assert _same(got, list(expected)) and len(got) == len(expected)


# -- worker-side copies of the dataset, context objects -------------------------------------------------

class Tagged(tud.Dataset):
    """Not cacheable: each sample tells the worker's id, the tag its ``worker_init_fn`` set on its copy, and
    whether ``get_worker_info().dataset`` is that copy."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        info = tud.get_worker_info()
        return torch.tensor([info.id, self.tag, info.dataset is self, isinstance(info.dataset, Tagged)])


class TaggedFiles(coordl.FileDataset):
    """Cacheable: the worker's id and the tag its ``worker_init_fn`` set on its copy."""

    def decode_raw(self, index, raw):
        return torch.tensor([tud.get_worker_info().id, self.tag])


def tag_copy(worker_id):
    info = tud.get_worker_info()
    assert info.id == worker_id and info.seed == torch.initial_seed()
    info.dataset.tag = 100 + worker_id


@pytest.mark.slow
@pytest.mark.parametrize("cached", [False, True])
def test_worker_init_fn_state_stays_in_the_workers_copy(image_root, cached):
    dataset = TaggedFiles(_files(image_root)[:8]) if cached else Tagged()
    with _coordl(dataset, batch_size=2, num_workers=2, worker_init_fn=tag_copy) as loader:
        assert tud.get_worker_info() is None
        rows = torch.cat(list(loader)).tolist()
        assert tud.get_worker_info() is None
    assert sorted({(row[0], row[1]) for row in rows}) == [(0, 100), (1, 101)]
    if not cached:  # an uncached dataset is handed to torch as it is
        assert all(row[2:] == [1, 1] for row in rows)
    assert not hasattr(dataset, "tag")  # set on the workers' copies only


@pytest.mark.slow
def test_a_multiprocessing_context_object_gives_torchs_batches(image_root):
    dataset = _sizes(image_root)
    kwargs = dict(batch_size=8, shuffle=True, num_workers=2, multiprocessing_context=mp.get_context("forkserver"))
    expected = list(tud.DataLoader(dataset, generator=torch.Generator().manual_seed(1), **kwargs))
    with _coordl(dataset, generator=torch.Generator().manual_seed(1), **kwargs) as loader:
        got = list(loader)
    assert _same(got, expected)
