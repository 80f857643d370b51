"""Errors raised by coordl; each also inherits the builtin a caller would catch."""


class CoordlError(Exception):
    """Base class of every coordl error."""


class ShmCapacityError(CoordlError, MemoryError):
    """/dev/shm has too little free space for the requested cache."""


class CacheMismatchError(CoordlError, RuntimeError):
    """A cache with the requested name holds a different dataset and is still in use."""


class SampleError(CoordlError, OSError):
    """A sample's file is missing, unreadable or cannot be decoded; the message names it."""
