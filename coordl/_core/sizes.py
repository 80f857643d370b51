"""Human-readable byte sizes: ``"8GiB"`` <-> 8589934592, and the size keywords of ``coordl.DataLoader``."""

import math
import numbers
import re
from fractions import Fraction

from coordl._core.sysinfo import available_memory_bytes

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_bytes(text: str) -> int:
    """Parse ``"512MiB"``, ``"1.5 GB"`` or ``"4096"`` into a byte count.

    A fraction of a larger unit is rounded down to whole bytes (``"0.3KiB"`` is 307); a fraction of a
    byte (``"0.5"``, ``"1.5 b"``) is refused rather than rounded, and so is a non-zero size under one byte.

    Raises:
        ValueError: if ``text`` is not a size, or not a whole number of bytes.
    """
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: '512MiB', '8GiB', '1.5GB', '4096')")
    number = Fraction(match.group(1))  # exact: "1.1GB" is 1100000000 bytes, not a float's 1100000000.0000002
    if _UNITS[unit] == 1 and number.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of bytes")
    size = math.floor(number * _UNITS[unit])
    if size == 0 and number != 0:
        raise ValueError(f"{text!r} is less than one byte")
    return size


def parse_size_option(name: str, value, *, allow_zero: bool) -> int | None:
    """Validate a size keyword such as ``cache_bytes=``: a byte count, or None for ``"auto"``.

    Args:
        name: the keyword, for errors.
        value: an integer (numpy integers too, and floats that are whole numbers: ``1.5e9``), a size string
            such as ``"8GiB"`` (see :func:`parse_bytes`), a share of the memory available now such as
            ``"50%"``, or ``"auto"``.
        allow_zero: whether 0 is a valid size (it turns a cache off).

    Raises:
        TypeError: if ``value`` is neither an integer nor a string.
        ValueError: if ``value`` is not a size, negative, zero where that is not allowed, or not a whole
            number of bytes; naming ``name``, the value and what is accepted.
    """
    accepted = (f"{'a non-negative' if allow_zero else 'a positive'} whole number of bytes (an int, a size "
                f"string such as '8GiB', or a share of available memory such as '50%'), or 'auto'")
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"{name} should be {accepted}, but got {name}={value!r}")
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        if isinstance(value, str):
            percent = _PERCENT_RE.match(value)
            size = _share_of_memory(Fraction(percent.group(1))) if percent else parse_bytes(value)
        elif isinstance(value, numbers.Integral):
            size = int(value)
        elif math.isfinite(value) and float(value).is_integer():
            size = int(value)
        else:
            raise ValueError(f"{value!r} is not a whole number of bytes")
    except ValueError as e:
        raise ValueError(f"{name} should be {accepted}, but got {name}={value!r}: {e}") from None
    if size < 0 or (size == 0 and not allow_zero):
        raise ValueError(f"{name} should be {accepted}, but got {name}={value!r}")
    return size


def _share_of_memory(percent: Fraction) -> int:
    """``percent`` (more than 0, at most 100) of the memory available now, in bytes."""
    if not 0 < percent <= 100:
        raise ValueError(f"{float(percent):g}% is not a share of memory (more than 0%, at most 100%)")
    return math.floor(percent / 100 * available_memory_bytes())


def format_bytes(n: float) -> str:
    """Format a byte count with a binary unit, e.g. ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
