"""Plain DALI, as a DALI user writes it, for the benchmarks and tests to compare coordl's DALI backend with."""

import torch

from coordl._dali.pipeline import _int64, _track, require_dali, resolve_pipeline


def file_reader_loader(root: str, *, order: str, batch_size: int, num_threads: int, device: str = "cpu",
                       seed: int = 0, pipeline="image_classification", train: bool = True) -> "FileReaderLoader":
    """Plain DALI over an image folder, as a DALI user writes it: ``fn.readers.file`` reading straight
    from disk through the OS page cache, with the same decode and augmentation as coordl's presets.

    Args:
        root: an ImageFolder-style tree (one folder per class).
        order: ``"seq"``: the reader's own order, sequential reads shuffled in a 1024-sample memory
            buffer (the paper's DALI-seq); ``"shuffle"``: the whole dataset reshuffled every
            epoch (DALI-shuffle).
        batch_size, num_threads, device, seed, pipeline, train: as for the DALI backend.

    Returns:
        A re-iterable: each ``iter()`` is one epoch of ``(images, labels)`` batches (the last one
        partial); ``len()`` is its number of batches.
    """
    if order not in ("seq", "shuffle"):
        raise ValueError(f"order should be 'seq' or 'shuffle', but got order={order!r}")
    return FileReaderLoader(root, order, batch_size, num_threads, device, seed, resolve_pipeline(pipeline), train)


class FileReaderLoader:
    """See :func:`file_reader_loader`."""

    def __init__(self, root, order, batch_size, num_threads, device, seed, pipeline_fn, train):
        require_dali()
        from nvidia.dali import Pipeline, fn
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
        pipe = _track(Pipeline(batch_size=batch_size, num_threads=num_threads, seed=seed,
                               device_id=torch.cuda.current_device() if device == "gpu" else None))
        with pipe:
            shuffle = dict(random_shuffle=True, initial_fill=1024) if order == "seq" else \
                dict(shuffle_after_epoch=True, shuffle_after_epoch_seed=seed)
            # plain reads rather than mmap: a mapped file can fail to map under a memory limit
            encoded, labels = fn.readers.file(file_root=root, name="Reader", dont_use_mmap=True, **shuffle)
            outputs = pipeline_fn(encoded, fn.cast(labels, dtype=_int64()), device=device, train=train)
            pipe.set_outputs(*outputs)
        self._names = [f"out{k}" for k in range(len(outputs))]
        self._iterator = DALIGenericIterator(pipe, self._names, reader_name="Reader",
                                             last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return len(self._iterator)

    def __iter__(self):
        for batch in self._iterator:
            yield tuple(batch[0][name] for name in self._names)
