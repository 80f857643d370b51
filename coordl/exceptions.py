"""Errors raised by coordl; each also inherits the builtin a caller would catch."""


class CoordlError(Exception):
    """Base class of every coordl error."""


class ShmCapacityError(CoordlError, MemoryError):
    """/dev/shm has too little free space for the requested cache."""


class CacheMismatchError(CoordlError, RuntimeError):
    """A cache with the requested name holds a different dataset and is still in use."""


class SampleError(CoordlError, OSError):
    """A sample's file is missing, unreadable or cannot be decoded; the message names it. A file that cannot
    be read raises the subclass that is also the builtin error torch would raise (:func:`reading_failed`)."""


class SampleNotFoundError(SampleError, FileNotFoundError):
    """A sample's file is missing."""


class SamplePermissionError(SampleError, PermissionError):
    """A sample's file cannot be read by this process."""


class SampleIsADirectoryError(SampleError, IsADirectoryError):
    """A sample's key names a directory."""


_AS_READ = ((FileNotFoundError, SampleNotFoundError), (PermissionError, SamplePermissionError),
            (IsADirectoryError, SampleIsADirectoryError))


def reading_failed(error: OSError, message: str) -> SampleError:
    """The :class:`SampleError` saying ``message`` for a read that raised ``error``: one that is also
    ``error``'s builtin class where that is one of those above (so ``except FileNotFoundError`` still
    catches a missing file, as with torch's DataLoader); ``error`` itself is its cause."""
    return next((ours for builtin, ours in _AS_READ if isinstance(error, builtin)), SampleError)(message)


class GroupMismatchError(CoordlError, ValueError):
    """A job's data settings differ from those of the live hp_group it asks to join."""


class StagingError(CoordlError, RuntimeError):
    """A staged batch is missing or does not hold what its group's table says."""
