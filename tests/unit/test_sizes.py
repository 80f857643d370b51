import numpy as np
import pytest

from coordl._core.sizes import format_bytes, parse_bytes, parse_size_option
from coordl._group.config import check_group_options


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), ("8GiB", 8 * 2**30), ("1.5 GB", 1_500_000_000), ("512mib", 512 * 2**20), ("3k", 3000),
    ("1.1GB", 1_100_000_000), ("1.5 GiB", 3 * 2**29), ("0.3KiB", 307), ("2.0", 2), ("0", 0), ("0 GiB", 0),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1.5 * 2**30) == "1.5 GiB"


@pytest.mark.parametrize("value,expected", [("auto", None), ("AUTO", None), (0, 0), ("0", 0), (123, 123),
                                            ("2MiB", 2 * 2**20), (np.int64(2**30), 2**30), (np.uint32(7), 7),
                                            (1.5e9, 1_500_000_000), (np.float64(4096.0), 4096)])
def test_cache_bytes_accepted(value, expected):
    size = parse_size_option("cache_bytes", value, allow_zero=True)
    assert size == expected and type(size) is type(expected)


@pytest.mark.parametrize("value,error", [(-1, ValueError), ("lots", ValueError), ("-5GiB", ValueError),
                                         (True, TypeError), (1.5, ValueError), (float("inf"), ValueError),
                                         (None, TypeError), ("0%", ValueError), ("150%", ValueError)])
def test_cache_bytes_refused_with_the_value_named(value, error):
    with pytest.raises(error, match=r"cache_bytes should be .*'auto'.* but got cache_bytes="):
        parse_size_option("cache_bytes", value, allow_zero=True)


def test_a_share_of_memory_is_that_share_of_the_memory_available_now(monkeypatch):
    from coordl._core import sizes
    monkeypatch.setattr(sizes, "available_memory_bytes", lambda: 10 * 2**30)
    assert parse_size_option("cache_bytes", "50%", allow_zero=True) == 5 * 2**30
    assert parse_size_option("hp_staging_bytes", " 12.5 % ", allow_zero=False) == 10 * 2**30 // 8
    with pytest.raises(ValueError, match=r"but got cache_bytes='0%': 0% is not a share of memory"):
        parse_size_option("cache_bytes", "0%", allow_zero=True)


@pytest.mark.parametrize("name", ["cache_bytes", "hp_staging_bytes"])
@pytest.mark.parametrize("value,why", [("0.5", "is not a whole number of bytes"),
                                       ("1.5 b", "is not a whole number of bytes"),
                                       ("0.0001KiB", "is less than one byte")])
def test_fractions_of_a_byte_are_refused_not_rounded(name, value, why):
    with pytest.raises(ValueError, match=rf"{name} should be .* but got {name}='{value}': '{value}' {why}"):
        parse_size_option(name, value, allow_zero=True)


@pytest.mark.parametrize("value,expected", [(np.int64(2**20), 2**20), ("1.5 GiB", 3 * 2**29), ("auto", None)])
def test_hp_staging_bytes_accepted(value, expected):
    assert check_group_options("g", None, value, 60, "raise", None) == expected


@pytest.mark.parametrize("value,error", [(0, ValueError), ("0", ValueError), ("0.5", ValueError),
                                         ("1.5 b", ValueError), (2.5, ValueError), ("2.5 apples", ValueError)])
def test_hp_staging_bytes_refused_with_the_value_named(value, error):
    with pytest.raises(error, match=rf"hp_staging_bytes should be a positive .* but got hp_staging_bytes={value!r}"):
        check_group_options("g", None, value, 60, "raise", None)
