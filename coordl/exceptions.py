"""Errors raised by coordl; each also inherits the builtin a caller would catch."""


class CoordlError(Exception):
    """Base class of every coordl error."""


class ShmCapacityError(CoordlError, MemoryError):
    """/dev/shm has too little free space for the requested cache."""


class CacheMismatchError(CoordlError, RuntimeError):
    """A cache with the requested name holds a different dataset and is still in use."""


class SampleError(CoordlError, OSError):
    """A sample's file is missing, unreadable or cannot be decoded; the message names it."""


class GroupMismatchError(CoordlError, ValueError):
    """A job's data settings differ from those of the live hp_group it asks to join."""


class StagingError(CoordlError, RuntimeError):
    """A staged batch is missing or does not hold what its group's table says."""
