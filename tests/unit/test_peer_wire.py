"""The peer tier's wire and server on loopback: handshake, frames, tags and stamps, clients that misbehave,
and a relay between a client and a server that alters what it passes on."""

import contextlib
import os
import random
import socket
import struct
import threading
import time

import pytest

from coordl._cache.minio import MinIOCache, cache_segment_name
from coordl._fetch.storage import FileStorage
from coordl._peer import wire
from coordl._peer.server import MAX_CLIENTS, CacheKeeper, ItemDigests, PeerServer, cache_lookup, job_limits, storage_id
from tests._peers import GREETING, Relay, edit, flip

SECRET = b"s3cret-of-this-job"
N_ITEMS = 50
MAX_KEEP = 4096


def _item(i: int) -> bytes:
    return bytes([i % 251]) * (1000 + 37 * i)


class Keeper:
    """Keeps hand-offs of items below 40 of at most ``MAX_KEEP`` bytes (``kept``), says FULL for the others."""

    def __init__(self):
        self.kept = {}

    def admit(self, i, length, stamp):
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
        return (_item(i), None) if i % 2 == 0 else None
    srv = PeerServer(lookup, N_ITEMS, SECRET, "127.0.0.1", keeper=Keeper(), frame_s=0.5).start()
    srv.looked_up = looked_up
    yield srv
    srv.close()


def _client(address, secret=SECRET, storage_id=wire.NO_STORAGE, binding=wire.NO_BINDING) -> wire.Channel:
    conn = socket.create_connection(address, timeout=2)
    return wire.client_handshake(conn, secret, time.monotonic() + 2, storage_id, binding)


def _fetch(channel, ids):
    wire.send_request(channel, ids)
    return {i: data for i, data, _ in wire.read_reply(channel, ids, time.monotonic() + 2)}


def _closed_without_data(conn: socket.socket) -> bool:
    """The server closed ``conn`` having sent nothing more."""
    conn.settimeout(3)
    try:
        return conn.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def _pair(shared=False) -> tuple[wire.Channel, wire.Channel]:
    """Two ends of a connection that share a session key: (server, client)."""
    a, b = socket.socketpair()
    key = os.urandom(32)
    return wire.Channel(a, key, shared, client=False), wire.Channel(b, key, shared, client=True)


def test_an_authenticated_client_gets_cached_items_checked_and_misses_as_absent(server):
    with contextlib.closing(_client(server.address)) as conn:
        got = _fetch(conn, [4, 3, 0, 48])
        assert got == {4: _item(4), 3: None, 0: _item(0), 48: _item(48)}
        assert _fetch(conn, [2]) == {2: _item(2)}  # the connection serves request after request


def test_a_client_with_the_wrong_secret_is_refused_before_any_data(server):
    conn = socket.create_connection(server.address, timeout=2)
    with pytest.raises((wire.PeerProtocolError, ConnectionError)):
        _fetch(wire.client_handshake(conn, b"wrong", time.monotonic() + 2), [0])
    conn.close()
    assert server.looked_up == []


def test_a_client_refuses_a_server_that_does_not_know_the_secret():
    impostor = PeerServer(lambda i: (b"x", None), N_ITEMS, b"other secret", "127.0.0.1").start()
    try:
        conn = socket.create_connection(impostor.address, timeout=2)
        with pytest.raises((wire.PeerProtocolError, ConnectionError)):
            wire.client_handshake(conn, SECRET, time.monotonic() + 2)
        conn.close()
    finally:
        impostor.close()


JOB_A, JOB_B = b"a" * wire.BINDING_BYTES, b"b" * wire.BINDING_BYTES


def test_a_server_of_another_job_or_dataset_with_the_same_secret_is_refused_both_ways():
    """Two jobs' servers share the secret (a site-wide one) but not the binding: a client of job A refuses job
    B's server before it answers its greeting, and job B's server sends nothing to a client that answers with
    job A's binding (a correct MAC over it included); each serves its own job's clients."""
    looked_up = []

    def lookup(i):
        looked_up.append(i)
        return _item(i), None
    servers = {job: PeerServer(lookup, N_ITEMS, SECRET, "127.0.0.1", binding=job).start() for job in (JOB_A, JOB_B)}
    try:
        conn = socket.create_connection(servers[JOB_B].address, timeout=2)
        with pytest.raises(wire.PeerProtocolError, match="serves another job or dataset"):
            wire.client_handshake(conn, SECRET, time.monotonic() + 2, binding=JOB_A)
        conn.close()
        conn = socket.create_connection(servers[JOB_B].address, timeout=2)  # ignores the greeting's binding
        greeting = wire.recv_exact(conn, GREETING)
        mine = os.urandom(wire.NONCE_BYTES) + wire.NO_STORAGE + wire.NO_SAMPLE + JOB_A
        conn.sendall(wire._mac(SECRET, b"client", greeting[len(wire.HELLO):] + mine) + mine)
        assert _closed_without_data(conn)
        conn.close()
        assert looked_up == []
        for job, server in servers.items():
            with contextlib.closing(_client(server.address, binding=job)) as channel:
                assert _fetch(channel, [3]) == {3: _item(3)}
    finally:
        for server in servers.values():
            server.close()


def test_a_relay_that_gives_the_client_its_own_binding_gets_the_handshake_refused():
    """A relay that puts the client's binding in another job's server's greeting: the client answers, and the
    server, seeing another binding, sends it nothing."""
    server = PeerServer(lambda i: (_item(i), None), N_ITEMS, SECRET, "127.0.0.1", binding=JOB_B).start()
    relay = Relay(server.address, forge_greeting=lambda greeting: greeting[:-wire.BINDING_BYTES] + JOB_A)
    try:
        conn = socket.create_connection(relay.address, timeout=2)
        with pytest.raises(ConnectionError):
            wire.client_handshake(conn, SECRET, time.monotonic() + 2, binding=JOB_A)
        conn.close()
    finally:
        relay.close()
        server.close()


def _handshake(server_storage: bytes, client_storage: bytes, server_sample: bytes = wire.NO_SAMPLE,
               client_sample: bytes = wire.NO_SAMPLE) -> tuple:
    """Both ends of a handshake over a socket pair: each a ``Channel``, or the error it raised."""
    a, b = socket.socketpair()
    ends = {}

    def end(name, handshake, sock, storage, sample):
        try:
            ends[name] = handshake(sock, SECRET, time.monotonic() + 2, storage, sample=sample)
        except wire.PeerProtocolError as e:
            ends[name] = e
            sock.close()
    thread = threading.Thread(target=end, args=("server", wire.server_handshake, a, server_storage, server_sample))
    thread.start()
    end("client", wire.client_handshake, b, client_storage, client_sample)
    thread.join()
    return ends["server"], ends["client"]


def test_a_handshake_gives_both_ends_a_key_of_their_own_and_says_whether_their_stamps_compare():
    same, other = b"s" * wire.STORAGE_ID_BYTES, b"o" * wire.STORAGE_ID_BYTES
    first, second = _handshake(same, same), _handshake(same, same)
    assert first[0].key == first[1].key != second[0].key  # per connection
    assert first[0].key not in (SECRET, b"")
    assert [end.shared for end in first] == [True, True]
    assert [end.shared for end in _handshake(same, other)] == [False, False]
    assert [end.shared for end in _handshake(wire.NO_STORAGE, wire.NO_STORAGE)] == [False, False]
    for pair in (first, second):
        for end in pair:
            end.close()


def test_ends_with_their_own_copies_of_the_dataset_refuse_each_other_where_a_sampled_item_differs():
    """Samples of 1000 items (64 sizes, 4 digests): an item of another size, or a digested one with other bytes,
    fails the handshake at both ends, naming the item; items missing at one end, samples of the same bytes,
    or ends that read the same storage (their stamps compare instead) pass."""
    def sample(size=lambda i: 100 + i, digest=lambda i: i.to_bytes(16, "big")):
        return wire.copy_sample(1000, size, digest)
    own, other, same = b"a" * wire.STORAGE_ID_BYTES, b"b" * wire.STORAGE_ID_BYTES, b"s" * wire.STORAGE_ID_BYTES
    assert wire.sampled(1000)[:3] == [0, 16, 32] and len(wire.sampled(1000)) <= wire.SAMPLE_SIZES
    for theirs, item in ((sample(size=lambda i: 7 if i == 32 else 100 + i), 32),
                         (sample(digest=lambda i: b"x" * 16 if i == 240 else i.to_bytes(16, "big")), 240)):
        ends = _handshake(own, other, sample(), theirs)
        assert all(isinstance(e, wire.PeerProtocolError) and f"sampled item(s) {item} have another size or other bytes"
                   in str(e) for e in ends), ends
        assert all(isinstance(e, wire.Channel) for e in _handshake(same, same, sample(), theirs))
    for theirs in (sample(), sample(size=lambda i: None, digest=lambda i: None), wire.NO_SAMPLE):
        assert all(isinstance(e, wire.Channel) and not e.shared for e in _handshake(own, other, sample(), theirs))


def test_a_reply_item_is_used_only_with_its_own_tag_id_and_place_on_the_connection():
    data = b"payload" * 10
    header = wire._ITEM.pack(7, wire.FOUND, len(data), 0, 0)
    frame = wire._FRAME.pack(wire.REPLY, 1)
    for sent, why in [(header + data[:-1] + b"!", "item 7: bad tag"),  # a byte altered
                      (wire._ITEM.pack(7, wire.FOUND, len(data), 5, 0) + data, "item 7: bad tag"),  # its stamp
                      (wire._ITEM.pack(8, wire.FOUND, len(data), 0, 0) + data, "for id 7")]:  # another id
        server, client = _pair()
        server.sock.sendall(frame + sent + server.tag(header, wire.item_digest(data)))
        with pytest.raises(wire.PeerProtocolError, match=why):
            list(wire.read_reply(client, [7], time.monotonic() + 1))
        server.close()
        client.close()
    server, client = _pair()
    genuine = frame + header + data + server.tag(header, wire.item_digest(data))
    server.sock.sendall(genuine + genuine)  # the same reply again: a replay of the first
    assert list(wire.read_reply(client, [7], time.monotonic() + 1)) == [(7, data, None)]
    with pytest.raises(wire.PeerProtocolError, match="item 7: bad tag"):
        list(wire.read_reply(client, [7], time.monotonic() + 1))
    server.close()
    client.close()


def test_a_cache_s_server_hashes_an_item_once_and_the_client_checks_its_bytes_against_the_digest(monkeypatch):
    """With :class:`ItemDigests` an item served on three connections is hashed once at the server (the
    client hashes what it gets each time). A digest that does not match the bytes sent (a server whose
    memo went wrong) gets the item refused: the client checks the bytes it received, not the server's word."""
    hashed = []
    real = wire.item_digest
    monkeypatch.setattr(wire, "item_digest", lambda data: hashed.append(bytes(data)) or real(data))
    srv = PeerServer(lambda i: (_item(i), None), N_ITEMS, SECRET, "127.0.0.1", digests=ItemDigests(N_ITEMS)).start()
    try:
        for _ in range(3):
            with contextlib.closing(_client(srv.address)) as conn:
                assert _fetch(conn, [5, 9]) == {5: _item(5), 9: _item(9)}
        assert hashed.count(_item(5)) == 1 + 3 and hashed.count(_item(9)) == 1 + 3  # server once, client each time
    finally:
        srv.close()
    wrong = PeerServer(lambda i: (_item(i), None), N_ITEMS, SECRET, "127.0.0.1",
                       digests=lambda i, data, stamp: real(_item(i + 1))).start()
    try:
        with contextlib.closing(_client(wrong.address)) as conn:
            wire.send_request(conn, [5])
            with pytest.raises(wire.PeerProtocolError, match="item 5: bad tag"):
                list(wire.read_reply(conn, [5], time.monotonic() + 2))
    finally:
        wrong.close()


def test_an_item_served_with_another_stamp_is_hashed_again():
    """A file that changed (a disk tier's or an exemplar region's copy of its new version) has other bytes under
    the same id: the memo is per stamp."""
    digests = ItemDigests(4)
    assert digests(1, b"old", (7, 0, 3)) == wire.item_digest(b"old") == digests(1, b"old", (7, 0, 3))
    assert digests(1, b"new", (8, 0, 3)) == wire.item_digest(b"new")
    assert digests(2, b"unstamped", None) == wire.item_digest(b"unstamped")


def test_a_reply_of_many_items_past_the_sockets_buffers_arrives_whole_and_in_order():
    """2,000 items (8 MB, some empty or absent) gathered into few writes, each taking what the socket takes
    (partial writes, more buffers than one write holds): the client reads each item's bytes, in order."""
    server, client = _pair()
    items = [(i, None if i % 7 == 3 else (bytes([i % 256]) * (i * 37 % 8000), None)) for i in range(2000)]
    sender = threading.Thread(target=wire.send_reply,
                              args=(server, [(i, f and (*f, wire.item_digest(f[0]))) for i, f in items]))
    sender.start()
    got = list(wire.read_reply(client, [i for i, _ in items], time.monotonic() + 20))
    sender.join()
    assert got == [(i, None if f is None else f[0], None) for i, f in items]
    server.close()
    client.close()


def test_a_hand_off_is_kept_checked_and_answered_between_requests(server):
    with contextlib.closing(_client(server.address)) as conn:
        wire.send_keep(conn, 3, b"three" * 100, None)
        assert wire.read_kept(conn, 3, time.monotonic() + 2) == wire.STORED
        assert _fetch(conn, [4]) == {4: _item(4)}  # requests and hand-offs share a connection
        wire.send_keep(conn, 41, b"x", None)
        assert wire.read_kept(conn, 41, time.monotonic() + 2) == wire.FULL
        wire.send_keep(conn, 5, b"y" * (4 * MAX_KEEP), None)  # more than it would keep: read past, not held
        assert wire.read_kept(conn, 5, time.monotonic() + 2) == wire.DECLINED
        assert _fetch(conn, [6]) == {6: _item(6)}  # the connection is still in step
    assert server.keeper.kept == {3: b"three" * 100}


def _keep_frame(index: int, data: bytes, length: int | None = None) -> bytes:
    """A hand-off of ``data`` with a tag that no session gives."""
    return (wire._FRAME.pack(wire.KEEP, index) + wire._KEEP_TAIL.pack(len(data) if length is None else length, 0, 0)
            + data + bytes(wire.TAG_BYTES))


def _authenticated_frames(rng: random.Random) -> list[bytes]:
    """Frames a broken or hostile client might send after a good handshake: none may be served or kept."""
    good = struct.pack("!4sI", wire.REQUEST, 2) + struct.pack("!2I", 0, 2)
    return [
        _keep_frame(1, b"bytes"),  # a hand-off whose tag is wrong
        _keep_frame(5, b"y" * (4 * MAX_KEEP)),  # one that would be read past, whose tag is wrong
        _keep_frame(1, b"", length=wire.MAX_ITEM_BYTES + 1),  # larger than any item: refused before it is read
        _keep_frame(N_ITEMS, b"bytes"),  # an id out of range
        _keep_frame(1, b"bytes" * 10)[:30],  # truncated, then the client goes quiet
        rng.randbytes(rng.randrange(8, 300)),  # random
        good + rng.randbytes(wire.TAG_BYTES),  # a request whose tag is wrong
        good[:rng.randrange(1, len(good))],  # truncated, then the client goes quiet
        struct.pack("!4sI", wire.REQUEST, wire.MAX_IDS + 1),  # oversized
        struct.pack("!4sI", wire.REQUEST, 0),  # empty
        struct.pack("!4sI", b"XXXX", 1) + struct.pack("!I", 0),  # bad magic
        struct.pack("!4sI", wire.REQUEST, 2) + struct.pack("!2I", 0, N_ITEMS),  # an id out of range
        struct.pack("!4sI", wire.REQUEST, 1) + struct.pack("!I", 2**32 - 1),  # a huge id
    ]


ANSWER = 2 * wire.NONCE_BYTES + wire.STORAGE_ID_BYTES + wire.SAMPLE_BYTES + wire.BINDING_BYTES  # a client's


def test_fuzzed_frames_never_crash_the_server_or_serve_a_byte(server):
    rng = random.Random(12)
    with contextlib.closing(_client(server.address)) as bystander:  # a good client connected all along
        for _ in range(20):  # junk instead of the handshake's answer: the greeting is all it gets
            conn = socket.create_connection(server.address, timeout=2)
            greeting = wire.recv_exact(conn, GREETING)
            assert greeting[:len(wire.HELLO)] == wire.HELLO
            conn.sendall(rng.randbytes(rng.randrange(ANSWER, ANSWER + 100)))
            assert _closed_without_data(conn)
            conn.close()
        assert server.looked_up == []
        for frame in _authenticated_frames(rng):
            conn = _client(server.address)
            conn.sock.sendall(frame)
            assert _closed_without_data(conn.sock), f"served after {frame[:16]!r}"
            conn.close()
        assert server.looked_up == [] and server.keeper.kept == {}  # nothing was looked up, let alone sent, nor kept
        assert _fetch(bystander, [6, 7]) == {6: _item(6), 7: None}
    with contextlib.closing(_client(server.address)) as later:
        assert _fetch(later, [8]) == {8: _item(8)}


def test_a_request_tagged_for_another_connection_is_refused(server):
    with contextlib.closing(_client(server.address)) as first, contextlib.closing(_client(server.address)) as second:
        frame = struct.pack("!4sI", wire.REQUEST, 1) + struct.pack("!I", 0)
        second.sock.sendall(frame + first.tag(frame))  # first's next tag, on second
        assert _closed_without_data(second.sock)
    assert server.looked_up == []


def _restamp(header, data, tag):
    return header[:-16] + struct.pack("!Qq", 12345, 678), data, tag


@pytest.fixture
def relay(server):
    """``relay(**hooks)``: a :class:`Relay` to ``server``, closed after the test."""
    relays = []

    def make(**hooks):
        relays.append(Relay(server.address, **hooks))
        return relays[-1]
    yield make
    for r in relays:
        r.close()


@pytest.mark.parametrize("forge", [flip, _restamp])
def test_a_relay_that_alters_every_reply_item_gets_no_forged_byte_to_the_client(server, relay, forge):
    """The relay passes the handshake through (it never knows the secret), then alters every item of every
    reply (its bytes, as it could recompute any checksum over them, or its stamp): on every connection the
    client refuses the first item it reads before using a byte of it. An honest relay's items arrive."""
    forger = relay(forge_item=forge)
    for ids in ([4, 6, 8], [0], [10, 3]):
        with contextlib.closing(_client(forger.address)) as conn:
            wire.send_request(conn, ids)
            got = []
            with pytest.raises(wire.PeerProtocolError, match=f"item {ids[0]}: bad tag"):
                for item in wire.read_reply(conn, ids, time.monotonic() + 2):
                    got.append(item)
            assert got == []
    assert forger.seen["items"] >= 3
    with contextlib.closing(_client(relay().address)) as conn:
        assert _fetch(conn, [4, 3]) == {4: _item(4), 3: None}


def test_a_relay_that_replays_an_item_of_another_connection_gets_it_refused(server, relay):
    recorded = []

    def replay(*item):
        recorded.append(item)
        return recorded[0]  # the first item it saw, for every later one
    forger = relay(forge_item=replay)
    with contextlib.closing(_client(forger.address)) as conn:
        assert _fetch(conn, [4]) == {4: _item(4)}
    with contextlib.closing(_client(forger.address)) as conn:
        wire.send_request(conn, [4])
        with pytest.raises(wire.PeerProtocolError, match="item 4: bad tag"):
            list(wire.read_reply(conn, [4], time.monotonic() + 2))


def test_a_relay_that_alters_the_storage_id_in_the_greeting_fails_the_handshake(server, relay):
    """Stamps compare only where both sides' storage ids match: a relay that put the client's id in the server's
    greeting would make the client take the server's stamps for its own; the handshake covers the ids."""
    ours = b"s" * wire.STORAGE_ID_BYTES
    at = len(wire.HELLO) + wire.NONCE_BYTES  # where the server's storage id is
    forger = relay(forge_greeting=lambda greeting: greeting[:at] + ours + greeting[at + wire.STORAGE_ID_BYTES:])
    conn = socket.create_connection(forger.address, timeout=2)
    with pytest.raises((wire.PeerProtocolError, ConnectionError)):
        wire.client_handshake(conn, SECRET, time.monotonic() + 2, ours)
    conn.close()
    with contextlib.closing(_client(relay().address)) as honest:
        assert _fetch(honest, [4]) == {4: _item(4)} and not honest.shared
    assert server.looked_up == [4]


def test_a_relay_that_alters_a_request_or_a_hand_off_gets_nothing_served_or_kept(server, relay):
    def alter(header, data, tag):
        if header[:4] != wire.REQUEST:
            return flip(header, data, tag)
        ids = struct.unpack(f"!{len(data) // 4}I", data)
        return header, struct.pack(f"!{len(ids)}I", *(i + 2 for i in ids)), tag  # other items, still even
    forger = relay(forge_sent=alter)
    with contextlib.closing(_client(forger.address)) as conn:
        wire.send_request(conn, [4])  # asks for 4, the server would get 6
        with pytest.raises(ConnectionError):
            list(wire.read_reply(conn, [4], time.monotonic() + 2))
    with contextlib.closing(_client(forger.address)) as conn:
        wire.send_keep(conn, 3, b"three" * 100, None)
        with pytest.raises(ConnectionError):
            wire.read_kept(conn, 3, time.monotonic() + 2)
    assert forger.seen["sent"] == 2
    assert server.looked_up == [] and server.keeper.kept == {}


def test_a_slow_client_is_dropped_and_others_are_served_meanwhile(server):
    slow = _client(server.address)
    slow.sock.sendall(struct.pack("!4sI", wire.REQUEST, 2)[:5])  # begins a frame, then stalls
    with contextlib.closing(_client(server.address)) as other:
        assert _fetch(other, [10]) == {10: _item(10)}
    started = time.monotonic()
    assert _closed_without_data(slow.sock)
    assert time.monotonic() - started < 2  # frame_s = 0.5
    slow.close()


def test_silent_connections_from_one_address_never_keep_out_a_peer_at_another():
    """NOTE [ Peer server limits ]: 127.0.0.2 opens silent connections; the server holds ``pending_per_source``
    of them (each got its greeting), closes the next before greeting it, and serves a client from 127.0.0.1
    meanwhile; a silent one is dropped after ``handshake_s``."""
    srv = PeerServer(lambda i: (_item(i), None), N_ITEMS, SECRET, "127.0.0.1", handshake_s=1.0,
                     pending_per_source=4).start()
    silent = []
    try:
        for _ in range(5):
            conn = socket.socket()
            conn.bind(("127.0.0.2", 0))
            conn.connect(srv.address)
            silent.append(conn)
        for conn in silent[:4]:  # greeted: held
            conn.settimeout(3)
            assert wire.recv_exact(conn, GREETING)[:len(wire.HELLO)] == wire.HELLO
        assert _closed_without_data(silent[4])
        with contextlib.closing(_client(srv.address)) as peer:
            assert _fetch(peer, [4]) == {4: _item(4)}
        started = time.monotonic()
        assert _closed_without_data(silent[0])  # at handshake_s
        assert time.monotonic() - started < 2.5
    finally:
        for conn in silent:
            conn.close()
        srv.close()


def test_an_idle_client_is_dropped_after_idle_s_and_a_new_connection_is_served():
    srv = PeerServer(lambda i: (_item(i), None), N_ITEMS, SECRET, "127.0.0.1", idle_s=0.2).start()
    try:
        with contextlib.closing(_client(srv.address)) as conn:
            assert _fetch(conn, [4]) == {4: _item(4)}
            assert _closed_without_data(conn.sock)
        with contextlib.closing(_client(srv.address)) as conn:
            assert _fetch(conn, [6]) == {6: _item(6)}
    finally:
        srv.close()


def test_the_limits_are_sized_from_the_job():
    """Every other server's processes, a fetching thread and a hand-off sender each, and headroom."""
    max_clients, per_source = job_limits(nodes=64, local_world=8, processes=9)
    assert max_clients >= 63 * 8 * 9 * 2 + 1 and max_clients > MAX_CLIENTS
    assert per_source >= 8 * 9 * 2


def test_many_clients_at_once_each_get_their_own_items(server):
    errors = []

    def client(k):
        try:
            with contextlib.closing(_client(server.address)) as conn:
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


def _files(tmp_path, n: int):
    """Files ``f0``... holding ``_item(i)``, and a source whose raw keys they are."""
    files = [tmp_path / f"f{i}" for i in range(n)]
    for i, f in enumerate(files):
        f.write_bytes(_item(i))

    class Source:
        def raw_key(self, i):
            return str(files[i])
    return files, Source()


@contextlib.contextmanager
def _cache_server(tmp_path, n: int = 4):
    """A peer server of a MinIO cache of the files ``f0``... (``_item(i)``), serving and keeping as ``serve``
    does, with the storage id of those files."""
    files, source = _files(tmp_path, n)
    storage = FileStorage(drop_page_cache=False)
    with MinIOCache(cache_segment_name(f"stamps-{time.monotonic_ns()}"), n_items=n, capacity_bytes=1 << 20,
                    fingerprint=bytes(32)) as cache:
        ours = storage_id(storage, str(files[0]))
        srv = PeerServer(cache_lookup(cache, source, storage), n, SECRET, "127.0.0.1",
                         keeper=CacheKeeper(cache, source, storage), storage_id=ours).start()
        try:
            yield files, storage, cache, srv, ours
        finally:
            srv.close()


def test_a_hand_off_is_kept_only_while_the_receivers_file_has_the_stamp_of_the_read_that_produced_it(tmp_path):
    """Both servers read the same files. The sender reads items 1 and 2; item 1's file is then edited (same
    length) before the hand-off reaches the receiver: declined, nothing kept, nothing served. Item 2 is kept
    with the read's stamp and served with it."""
    with _cache_server(tmp_path) as (files, storage, cache, srv, ours):
        read = {i: storage.read_stamped(str(files[i])) for i in (1, 2)}
        edit(files[1])  # between the sender's read and the admission
        with contextlib.closing(_client(srv.address, storage_id=ours)) as conn:
            assert conn.shared
            outcomes = []
            for i in (1, 2):
                wire.send_keep(conn, i, *read[i])
                outcomes.append(wire.read_kept(conn, i, time.monotonic() + 2))
            assert outcomes == [wire.DECLINED, wire.STORED]
            assert cache.get(1) is None
            assert cache.get(2) == read[2][0] and cache.stamp(2) == read[2][1]
            wire.send_request(conn, [1, 2])
            assert list(wire.read_reply(conn, [1, 2], time.monotonic() + 2)) == [(1, None, None),
                                                                                 (2, read[2][0], read[2][1])]


def test_a_server_serves_an_item_with_its_stored_stamp_and_not_once_its_file_has_another(tmp_path):
    """A reply carries the stamp the server's copy was stored with, to a client that reads the same files
    (None to one with its own copy: its stamps do not compare); once the file has another stamp the server
    serves that item to no one."""
    with _cache_server(tmp_path) as (files, storage, cache, srv, ours):
        stamps = {}
        for i in (0, 1):
            data, stamps[i] = storage.read_stamped(str(files[i]))
            assert cache.put(i, data, stamps[i])
        edit(files[1])
        for theirs, stamp in ((ours, stamps[0]), (b"own copy".ljust(wire.STORAGE_ID_BYTES), None)):
            with contextlib.closing(_client(srv.address, storage_id=theirs)) as conn:
                wire.send_request(conn, [0, 1])
                assert list(wire.read_reply(conn, [0, 1], time.monotonic() + 2)) == [(0, _item(0), stamp),
                                                                                     (1, None, None)]


def test_a_server_keeps_a_hand_off_stamped_with_its_own_file_and_declines_what_it_cannot_vouch_for(tmp_path):
    """``CacheKeeper``: the bytes go in the cache with the stamp of this server's file, as its own read would
    put them; a hand-off whose stamp compares here (the sender reads the same files) only if it is that
    stamp. A file it lacks or holds in another length or version, an item it holds, and a full cache are
    refused, from the header alone (before any byte is read)."""
    files, source = _files(tmp_path, 4)
    storage = FileStorage(drop_page_cache=False)
    capacity = len(_item(0)) + len(_item(1))
    with MinIOCache(cache_segment_name(f"keep-{time.monotonic_ns()}"), n_items=4, capacity_bytes=capacity,
                    fingerprint=bytes(32)) as cache:
        keeper = CacheKeeper(cache, source, storage)
        outcome, stamp = keeper.admit(0, len(_item(0)), None)  # from a server with its own copy
        assert outcome == wire.STORED
        assert keeper.keep(0, _item(0), stamp) == wire.STORED
        assert bytes(cache.get(0)) == _item(0) and cache.stamp(0) == storage.stamp(str(files[0]))
        assert keeper.admit(0, len(_item(0)), None)[0] == wire.DECLINED  # held already
        assert keeper.admit(1, len(_item(1)) + 4, None)[0] == wire.DECLINED  # this server's file is another version
        other = storage.stamp(str(files[1]))[:2] + (len(_item(1)) + 4,)
        assert keeper.admit(1, len(_item(1)) + 4, other)[0] == wire.DECLINED  # so is the sender's read
        ino, ctime, length = storage.stamp(str(files[1]))
        assert keeper.admit(1, length, (ino, ctime + 1, length))[0] == wire.DECLINED  # same length, other version
        files[3].unlink()
        assert keeper.admit(3, len(_item(3)), None)[0] == wire.DECLINED  # not on this server
        outcome, stamp = keeper.admit(2, len(_item(2)), storage.stamp(str(files[2])))  # the same files
        assert outcome == wire.STORED and stamp == storage.stamp(str(files[2])) and not cache.full
        assert keeper.keep(2, _item(2), stamp) == wire.FULL  # does not fit: the cache freezes
        assert cache.full and cache.get(2) is None and cache.get(1) is None
        assert keeper.admit(1, len(_item(1)), None)[0] == wire.FULL
