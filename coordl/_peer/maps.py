"""The servers' cache maps as they travel through the rendezvous store, and the ownership they give (``tier``
NOTE [ Ownership ])."""

import struct
import zlib

import numpy as np


def owners_of(maps: list[np.ndarray | None], n_items: int) -> np.ndarray:
    """``owner[i]``: the lowest node whose bool map holds item ``i``, -1 where none does (None: a node
    whose map is unknown holds nothing; with none known, every item comes from storage)."""
    owner = np.full(n_items, -1, dtype=np.int16)
    for node in range(len(maps) - 1, -1, -1):
        if maps[node] is not None:
            owner[maps[node]] = node
    return owner


def encode_map(ready: np.ndarray, frozen: bool) -> bytes:
    """A node's map for the store: frozen flag, item count, zlib of its ready bitmap."""
    return struct.pack("!BQ", int(frozen), len(ready)) + zlib.compress(np.packbits(ready).tobytes(), 1)


def decode_map(blob: bytes, n_items: int) -> tuple[np.ndarray, bool]:
    frozen, n = struct.unpack_from("!BQ", blob)
    if n != n_items:
        raise RuntimeError(f"coordl partitioned caching: a server's dataset has {n} items, this one {n_items}; "
                           "every server must load the same dataset")
    bits = np.frombuffer(zlib.decompress(blob[9:]), dtype=np.uint8)
    return np.unpackbits(bits, count=n).astype(bool), bool(frozen)
