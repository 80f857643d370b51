import pytest

from coordl._sizes import format_bytes, parse_bytes
from coordl.loader import parse_cache_bytes


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), ("8GiB", 8 * 2**30), ("1.5 GB", 1_500_000_000), ("512mib", 512 * 2**20), ("3k", 3000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1.5 * 2**30) == "1.5 GiB"


@pytest.mark.parametrize("value,expected", [("auto", None), ("AUTO", None), (0, 0), (123, 123), ("2MiB", 2 * 2**20)])
def test_cache_bytes_accepted(value, expected):
    assert parse_cache_bytes(value) == expected


@pytest.mark.parametrize("value,error", [(-1, ValueError), ("lots", ValueError), ("-5GiB", ValueError),
                                         (True, TypeError), (1.5, TypeError), (None, TypeError)])
def test_cache_bytes_refused_with_the_value_named(value, error):
    with pytest.raises(error, match=r"cache_bytes should be .*'auto'.* but got cache_bytes="):
        parse_cache_bytes(value)
