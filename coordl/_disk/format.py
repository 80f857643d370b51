"""The disk tier's on-disk format: items in append-only pack files, and the index, an append-only log of
checksummed groups of fixed-size records. Pure functions over bytes; no file is opened here.

NOTE [ Disk format ]
A dataset's folder holds ``index.log`` and ``pack-NNNNNN.dat`` files. An item is written at a 4 KiB-aligned
offset of a pack (so an ``O_DIRECT`` reader can read it whole): a 24-byte header (``ITEM_MAGIC``, the key's
length, the data's length, the data's xxh3-64), the key (UTF-8), the data. The index starts with
``INDEX_MAGIC`` and holds groups: a 16-byte header (``GROUP_MAGIC``, the record count, the xxh3-64 of the
records) and its records, one per item (:data:`RECORD`: the key's xxh3-64, pack, offset, lengths, the source's
stamp of the bytes, their checksum). A group is written only after the items it names were made durable
(``fdatasync`` of the packs), and is itself committed by an ``fdatasync`` of the index. Replaying the index
stops at the first group that is short or whose checksum fails: a crash loses at most the groups not yet
committed, and a record never names bytes that were not written. The latest record of a key wins.
"""

import struct

import numpy as np
import xxhash

ALIGN = 4096
INDEX_MAGIC = b"CDLDISK1" + bytes(8)
GROUP = struct.Struct("<4sIQ")
GROUP_MAGIC = b"CDLG"
ITEM = struct.Struct("<4sIQQ")
ITEM_MAGIC = b"CDLI"
RECORD = np.dtype([("digest", "<u8"), ("pack", "<u4"), ("key_len", "<u4"), ("offset", "<u8"), ("data_len", "<u8"),
                   ("stamp", "<i8", (3,)), ("checksum", "<u8")])
"""An index record: 64 bytes, also an item's entry in memory (so an open cache costs 64 B an item)."""
assert RECORD.itemsize == 64


def key_digest(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def item_bytes(key: str, data) -> bytes:
    """An item as written to a pack: header, key, data."""
    k = key.encode()
    return ITEM.pack(ITEM_MAGIC, len(k), len(data), checksum(data)) + k + bytes(data)


def packed_bytes(key: str, data_len: int) -> int:
    """Bytes an item of ``key`` and ``data_len`` bytes of data takes in its pack, aligned."""
    return aligned(ITEM.size + len(key.encode()) + data_len)


def item_span(record) -> int:
    """Bytes an item of ``record`` takes in its pack, before alignment."""
    return ITEM.size + int(record["key_len"]) + int(record["data_len"])


def item_data(blob: bytes, record, key: str, verify: bool = True):
    """The data of the item ``blob`` (as read at ``record``'s offset) if it is whole and is ``key``'s with the
    record's checksum (``verify``: its bytes' checksum worked out and compared too), else None (torn, corrupt,
    or another key's)."""
    if len(blob) < ITEM.size:
        return None
    magic, key_len, data_len, check = ITEM.unpack_from(blob)
    k = key.encode()
    if (magic != ITEM_MAGIC or key_len != len(k) or key_len != record["key_len"] or data_len != record["data_len"]
            or check != record["checksum"] or len(blob) != ITEM.size + key_len + data_len
            or blob[ITEM.size:ITEM.size + key_len] != k):
        return None
    data = memoryview(blob)[ITEM.size + key_len:]
    return data if not verify or checksum(data) == check else None


def group_bytes(records: np.ndarray) -> bytes:
    """A committed group of ``records`` (of :data:`RECORD`) as appended to the index."""
    body = records.astype(RECORD, copy=False).tobytes()
    return GROUP.pack(GROUP_MAGIC, len(records), checksum(body)) + body


def replay(data: bytes, start: int) -> tuple[np.ndarray, int]:
    """The records of the whole groups in ``data[start:]`` and the offset just past the last one (where a
    torn or corrupt tail, if any, begins)."""
    bodies, at = [], start
    view = memoryview(data)
    while at + GROUP.size <= len(data):
        magic, count, check = GROUP.unpack_from(data, at)
        end = at + GROUP.size + count * RECORD.itemsize
        if magic != GROUP_MAGIC or end > len(data) or checksum(view[at + GROUP.size:end]) != check:
            break
        bodies.append(view[at + GROUP.size:end])
        at = end
    records = np.frombuffer(b"".join(bodies), dtype=RECORD) if bodies else np.zeros(0, dtype=RECORD)
    return records, at


def latest(records: np.ndarray) -> np.ndarray:
    """``records`` with one per key, the latest, sorted by digest (for ``np.searchsorted``)."""
    if not len(records):
        return np.zeros(0, dtype=RECORD)
    newest_first = records[::-1]
    _, first = np.unique(newest_first["digest"], return_index=True)
    return np.ascontiguousarray(newest_first[first])
