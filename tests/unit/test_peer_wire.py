"""The peer tier's wire and server on loopback: handshake, frames, checksums, and clients that misbehave."""

import random
import socket
import struct
import threading
import time
import zlib

import pytest

from coordl import _peer_wire as wire
from coordl.minio_cache import MinIOCache, cache_segment_name
from coordl.peer_server import CacheKeeper, PeerServer
from coordl.storage import FileStorage

SECRET = b"s3cret-of-this-job"
N_ITEMS = 50
MAX_KEEP = 4096


def _item(i: int) -> bytes:
    return bytes([i % 251]) * (1000 + 37 * i)


class Keeper:
    """Keeps hand-offs of items below 40 of at most ``MAX_KEEP`` bytes (``kept``), says FULL for the others."""

    def __init__(self):
        self.kept = {}

    def admit(self, i, length):
        return (wire.FULL if i >= 40 else wire.STORED if length <= MAX_KEEP else wire.DECLINED), None

    def keep(self, i, data, stamp):
        self.kept[i] = bytes(data)
        return wire.STORED


@pytest.fixture
def server():
    """A peer server on loopback holding every even item; records every item it was asked for, and keeps
    hand-offs with a :class:`Keeper` (``srv.keeper``)."""
    looked_up = []

    def lookup(i):
        looked_up.append(i)
        return _item(i) if i % 2 == 0 else None
    srv = PeerServer(lookup, N_ITEMS, SECRET, "127.0.0.1", keeper=Keeper(), frame_s=0.5).start()
    srv.looked_up = looked_up
    yield srv
    srv.close()


def _client(srv, secret=SECRET) -> socket.socket:
    conn = socket.create_connection(srv.address, timeout=2)
    wire.client_handshake(conn, secret, time.monotonic() + 2)
    return conn


def _fetch(conn, ids):
    conn.sendall(wire.encode_request(ids))
    return dict(wire.read_reply(conn, ids, time.monotonic() + 2))


def _closed_without_data(conn: socket.socket) -> bool:
    """The server closed ``conn`` having sent nothing more."""
    conn.settimeout(3)
    try:
        return conn.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def test_an_authenticated_client_gets_cached_items_checked_and_misses_as_absent(server):
    with _client(server) as conn:
        got = _fetch(conn, [4, 3, 0, 48])
        assert got == {4: _item(4), 3: None, 0: _item(0), 48: _item(48)}
        assert _fetch(conn, [2]) == {2: _item(2)}  # the connection serves request after request


def test_a_client_with_the_wrong_secret_is_refused_before_any_data(server):
    conn = socket.create_connection(server.address, timeout=2)
    with pytest.raises((wire.PeerProtocolError, ConnectionError)):
        wire.client_handshake(conn, b"wrong", time.monotonic() + 2)
        _fetch(conn, [0])
    conn.close()
    assert server.looked_up == []


def test_a_client_refuses_a_server_that_does_not_know_the_secret():
    impostor = PeerServer(lambda i: b"x", N_ITEMS, b"other secret", "127.0.0.1").start()
    try:
        conn = socket.create_connection(impostor.address, timeout=2)
        with pytest.raises((wire.PeerProtocolError, ConnectionError)):
            wire.client_handshake(conn, SECRET, time.monotonic() + 2)
        conn.close()
    finally:
        impostor.close()


def test_a_reply_whose_bytes_do_not_match_their_checksum_is_refused():
    a, b = socket.socketpair()
    data = b"payload" * 10
    a.sendall(struct.pack("!4sI", wire.REPLY, 1) + struct.pack("!IBII", 7, wire.FOUND, len(data), zlib.crc32(data) ^ 1)
              + data)
    with pytest.raises(wire.PeerProtocolError, match="checksum"):
        list(wire.read_reply(b, [7], time.monotonic() + 1))
    a.sendall(struct.pack("!4sI", wire.REPLY, 1) + struct.pack("!IBII", 8, wire.FOUND, len(data), zlib.crc32(data)) + data)
    with pytest.raises(wire.PeerProtocolError, match="for id 7"):
        list(wire.read_reply(b, [7], time.monotonic() + 1))
    a.close()
    b.close()


def test_a_hand_off_is_kept_checked_and_answered_between_requests(server):
    with _client(server) as conn:
        wire.send_keep(conn, 3, b"three" * 100)
        assert wire.read_kept(conn, 3, time.monotonic() + 2) == wire.STORED
        assert _fetch(conn, [4]) == {4: _item(4)}  # requests and hand-offs share a connection
        wire.send_keep(conn, 41, b"x")
        assert wire.read_kept(conn, 41, time.monotonic() + 2) == wire.FULL
        wire.send_keep(conn, 5, b"y" * (4 * MAX_KEEP))  # more than it would keep: read past, not held
        assert wire.read_kept(conn, 5, time.monotonic() + 2) == wire.DECLINED
        assert _fetch(conn, [6]) == {6: _item(6)}  # the connection is still in step
    assert server.keeper.kept == {3: b"three" * 100}


def _keep_frame(index: int, data: bytes, crc: int | None = None, length: int | None = None) -> bytes:
    return struct.pack("!4sIII", wire.KEEP, index, len(data) if length is None else length,
                       zlib.crc32(data) if crc is None else crc) + data


def _authenticated_frames(rng: random.Random) -> list[bytes]:
    """Frames a broken or hostile client might send after a good handshake: none may be served or kept."""
    good = wire.encode_request([0, 2])
    return [
        _keep_frame(1, b"bytes", crc=zlib.crc32(b"bytes") ^ 1),  # a hand-off whose checksum is wrong
        _keep_frame(1, b"", length=wire.MAX_ITEM_BYTES + 1),  # larger than any item: refused before it is read
        _keep_frame(N_ITEMS, b"bytes"),  # an id out of range
        _keep_frame(1, b"bytes" * 10)[:30],  # truncated, then the client goes quiet
        rng.randbytes(rng.randrange(8, 300)),  # random
        good[:rng.randrange(1, len(good))],  # truncated, then the client goes quiet
        struct.pack("!4sI", wire.REQUEST, wire.MAX_IDS + 1),  # oversized
        struct.pack("!4sI", wire.REQUEST, 0),  # empty
        struct.pack("!4sI", b"XXXX", 1) + struct.pack("!I", 0),  # bad magic
        struct.pack("!4sI", wire.REQUEST, 2) + struct.pack("!2I", 0, N_ITEMS),  # an id out of range
        struct.pack("!4sI", wire.REQUEST, 1) + struct.pack("!I", 2**32 - 1),  # a huge id
    ]


def test_fuzzed_frames_never_crash_the_server_or_serve_a_byte(server):
    rng = random.Random(12)
    with _client(server) as bystander:  # a good client connected all along
        for _ in range(20):  # junk instead of the handshake's answer: the greeting is all it gets
            conn = socket.create_connection(server.address, timeout=2)
            assert wire.recv_exact(conn, len(wire.HELLO) + wire.NONCE_BYTES)[:len(wire.HELLO)] == wire.HELLO
            conn.sendall(rng.randbytes(rng.randrange(2 * wire.NONCE_BYTES, 300)))
            assert _closed_without_data(conn)
            conn.close()
        assert server.looked_up == []
        for frame in _authenticated_frames(rng):
            conn = _client(server)
            conn.sendall(frame)
            assert _closed_without_data(conn), f"served after {frame[:16]!r}"
            conn.close()
        assert server.looked_up == [] and server.keeper.kept == {}  # nothing was looked up, let alone sent, nor kept
        assert _fetch(bystander, [6, 7]) == {6: _item(6), 7: None}
    with _client(server) as later:
        assert _fetch(later, [8]) == {8: _item(8)}


def test_a_slow_client_is_dropped_and_others_are_served_meanwhile(server):
    slow = _client(server)
    slow.sendall(wire.encode_request([0, 2])[:5])  # begins a frame, then stalls
    with _client(server) as other:
        assert _fetch(other, [10]) == {10: _item(10)}
    started = time.monotonic()
    assert _closed_without_data(slow)
    assert time.monotonic() - started < 2  # frame_s = 0.5
    slow.close()


def test_many_clients_at_once_each_get_their_own_items(server):
    errors = []

    def client(k):
        try:
            with _client(server) as conn:
                for _ in range(20):
                    ids = [(k * 2 + j * 2) % N_ITEMS for j in range(5)]
                    assert _fetch(conn, ids) == {i: _item(i) for i in ids}
        except Exception as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_server_keeps_a_hand_off_stamped_with_its_own_file_and_declines_what_it_cannot_vouch_for(tmp_path):
    """``CacheKeeper``: the bytes go in the cache with the stamp of this server's file, as its own read would
    put them; a file it lacks or holds in another length, an item it holds, and a full cache are refused,
    from the header alone (before any byte is read)."""
    files = [tmp_path / f"f{i}" for i in range(4)]
    for i, f in enumerate(files):
        f.write_bytes(_item(i))

    class Source:
        def raw_key(self, i):
            return str(files[i])
    storage = FileStorage(drop_page_cache=False)
    capacity = len(_item(0)) + len(_item(1))
    with MinIOCache(cache_segment_name(f"keep-{time.monotonic_ns()}"), n_items=4, capacity_bytes=capacity,
                    fingerprint=bytes(32)) as cache:
        keeper = CacheKeeper(cache, Source(), storage)
        outcome, stamp = keeper.admit(0, len(_item(0)))
        assert outcome == wire.STORED
        assert keeper.keep(0, _item(0), stamp) == wire.STORED
        assert bytes(cache.get(0)) == _item(0) and cache.stamp(0) == storage.stamp(str(files[0]))
        assert keeper.admit(0, len(_item(0)))[0] == wire.DECLINED  # held already
        assert keeper.admit(1, len(_item(1)) + 4)[0] == wire.DECLINED  # this server's file is another version
        files[3].unlink()
        assert keeper.admit(3, len(_item(3)))[0] == wire.DECLINED  # not on this server
        outcome, stamp = keeper.admit(2, len(_item(2)))
        assert outcome == wire.STORED and not cache.full
        assert keeper.keep(2, _item(2), stamp) == wire.FULL  # does not fit: the cache freezes
        assert cache.full and cache.get(2) is None and cache.get(1) is None
        assert keeper.admit(1, len(_item(1)))[0] == wire.FULL
