"""The peer tier's wire format: length-prefixed binary frames, an HMAC handshake, and a tag on every message
after it. No pickles.

NOTE [ Peer wire ]
Every connection starts with a mutual challenge-response over the job's secret:
  server -> client  ``HELLO`` magic (8 bytes) + server nonce (32) + server's storage id (16) + sample (324)
                    + binding (16)
  client -> server  HMAC-SHA256(secret, "client" + T) (32) + client nonce (32) + client's storage id (16)
                    + sample (324) + binding (16)
  server -> client  HMAC-SHA256(secret, "server" + T) (32)
where T is the transcript: everything each side sent after the magic and before its MAC, the server's
first. Both sides compare digests with ``hmac.compare_digest``; a wrong one closes
the connection, so neither side sends or accepts a byte of data to or from anyone who does not know the
secret. Both then hold the connection's session key, HMAC-SHA256(secret, "session" + T), which no one
without the secret can derive (a relay that passes the handshake through included).

A binding names "this loader of this job over this dataset", the same on every rank and server of the job
(``_peer.secret`` NOTE [ Security ]). A side refuses one that is not its own before it answers (the client
sends nothing after a greeting with another binding, the server nothing after such an answer): so a job
whose servers share a secret with another job's, one of which took over a dead server's address and port,
never takes a byte from it. Bindings are not secret; the MACs cover them, so a relay cannot change them.

A storage id names the files a side reads: the peer tier's is a digest of its stamp (``storage.Stamp``)
of the dataset's first file as it starts, zeros for a storage that stamps nothing. A stamp names a version
of a file where it is stored (inode, ctime, size), so two sides compare stamps only where their ids are
equal and nonzero (``Channel.shared``): they read the same storage. A server with its own copy of the
dataset (or whose first file changed as the servers started) has another id, and the functions here give
None for the stamps that messages to or from it carry.

Copies are not compared byte for byte, so each side also sends a sample of its copy
(:func:`copy_sample`): the sizes of ``SAMPLE_SIZES`` evenly spaced items and a digest of the bytes of
``SAMPLE_DIGESTS`` of them, each marked missing where its file is not there (a server may hold only some
files). Where the stamps do not compare, a side that finds a sampled item present at both ends with
another size or digest fails the handshake, naming the items (:func:`diverged`): a server whose copy
differs is then marked down and said so once by each rank, as one that does not answer is, and nothing
passes between the two.

Then the client sends requests and the server answers each in order:
  request  ``!4sI`` (``REQUEST`` magic, count) + count x ``!I`` item ids + tag
  reply    ``!4sI`` (``REPLY`` magic, count), then per id, in the request's order: ``!IBIQq`` (id, status,
           length, inode and ctime ns of the stored stamp) + the bytes (``length`` of them when status is
           ``FOUND``, none when ``ABSENT``) + tag
A request holds at most ``MAX_IDS`` ids; an item is at most ``MAX_ITEM_BYTES``. The client checks that
each reply item names the id it asked for, in order, and its tag, before it uses a byte, and reads the
reply by a deadline that each item's header moves on by its length at ``MIN_RATE``.

A client may also hand the server an item to keep (see ``_peer.handoff`` NOTE [ Hand-off ]):
  keep     ``!4sI`` (``KEEP`` magic, id) + ``!IQq`` (length, inode and ctime ns of the stamp of the read
           that produced the bytes) + the bytes + tag
  answer   ``!4sIB`` (``KEPT`` magic, id, outcome) + tag: ``STORED``, ``FULL`` (its cache takes no more) or
           ``DECLINED`` (held already, or its own file is another version)
The server decides from the header whether it would keep the item: only then does it read the bytes
into memory (at most its own file's length); else it reads past them in small chunks. Either way it
checks the tag before it answers. So a hand-off never makes a server hold more than an item it would
cache anyway.

A tag is HMAC-SHA256(session key, direction + number + message) truncated to its first ``TAG_BYTES``
(16: 128 bits), where the direction is ``c>s`` or ``s>c`` and the number counts the tagged messages
sent that way on the connection (8 bytes, from 0), and the message is every byte of the request, hand-off
or answer before the tag; for a reply item, its header and the SHA-256 of its bytes (:func:`item_digest`),
which the client computes from the bytes it received. So a byte altered, dropped, added, reordered or
replayed from another message or connection fails its tag, and the receiver drops the connection (a
``PeerProtocolError``). A server whose items' bytes never change (a cache's) works out each item's digest
once, the first time it serves it (``_peer.server.ItemDigests``), so a later epoch's item is hashed once,
at the rank that uses it, not at both ends. A reply item's stamp is the one the server's copy was stored
with, checked against the server's file as it is served; a hand-off's is the sender's read's.
"""

import collections
import hashlib
import hmac
import secrets
import socket
import struct
import time

HELLO = b"CDLPEER5"
REQUEST = b"CDLQ"
REPLY = b"CDLR"
KEEP = b"CDLK"
KEPT = b"CDLA"
NONCE_BYTES = 32
STORAGE_ID_BYTES = 16
NO_STORAGE = bytes(STORAGE_ID_BYTES)
"""The storage id of a side whose stamps compare with no one's."""
SAMPLE_SIZES = 64
SAMPLE_DIGESTS = 4
_SAMPLE_DIGEST_BYTES = 16
_MISSING = 0xFFFFFFFF
_SAMPLE_HEAD = struct.Struct(f"!I{SAMPLE_SIZES}I")  # items in the dataset, sampled sizes
_NO_DIGEST = bytes(_SAMPLE_DIGEST_BYTES)
SAMPLE_BYTES = _SAMPLE_HEAD.size + _SAMPLE_DIGEST_BYTES * SAMPLE_DIGESTS
NO_SAMPLE = bytes(SAMPLE_BYTES)
"""The sample of a side that says nothing of its copy (a dataset of no items)."""
BINDING_BYTES = 16
NO_BINDING = bytes(BINDING_BYTES)
"""The binding of a side that names no job (a server or client outside a partitioned job)."""
TAG_BYTES = 16
FOUND, ABSENT = 0, 1
STORED, FULL, DECLINED = 0, 1, 2
MAX_IDS = 8192
"""Ids per request (a minibatch's misses for one owner come in one request)."""
MAX_ITEM_BYTES = 1 << 30
"""Largest item a reply may carry."""

_FRAME = struct.Struct("!4sI")
_ITEM = struct.Struct("!IBIQq")  # id, status, length, inode, ctime ns
_KEEP_TAIL = struct.Struct("!IQq")  # after _FRAME(KEEP, id): length, inode, ctime ns
_KEPT = struct.Struct("!4sIB")
_SEQ = struct.Struct("!Q")
_MAC_BYTES = 32
_SENDS = {True: b"c>s", False: b"s>c"}  # by whether the sender is the client
_SEND_CHUNK = 1 << 20
_SKIP_CHUNK = 1 << 16
MIN_RATE = 10**7
"""Bytes per second a hand-off's bytes (on top of the server's ``frame_s``) and a reply's items (on top of
the client's deadline) must at least arrive at."""

Handoff = collections.namedtuple("Handoff", "index length stamp mac")
"""A hand-off's header: its ``stamp`` (None where the two sides' stamps do not compare) and the ``mac`` of
its message so far; its bytes and tag follow on the connection (:func:`read_handoff`)."""


class PeerProtocolError(ConnectionError):
    """The other side broke the protocol (bad magic, wrong id, bad tag, oversized frame) or failed the
    handshake; the connection is closed."""


class Channel:
    """An authenticated connection (from :func:`server_handshake` or :func:`client_handshake`): its
    ``sock``, its session ``key``, whether both ends read the same storage (``shared``), and the number of
    the next tagged message each way (see NOTE [ Peer wire ]). One thread uses it at a time."""

    def __init__(self, sock: socket.socket, key: bytes, shared: bool, client: bool):
        self.sock, self.key, self.shared = sock, key, shared
        self._labels = (_SENDS[client], _SENDS[not client])  # (sent, received)
        self._counts = [0, 0]

    def close(self) -> None:
        self.sock.close()

    def tag(self, *parts) -> bytes:
        """The tag of the next message this end sends: ``parts`` are its bytes before the tag."""
        return self._mac(0, parts).digest()[:TAG_BYTES]

    def receiving(self, *parts):
        """The MAC of the next message this end receives, fed ``parts`` (its first bytes): feed it the rest
        (``update``), then :meth:`check` it."""
        return self._mac(1, parts)

    def check(self, mac, deadline: float | None, what: str) -> None:
        """Read the tag that ends a received message and compare it with ``mac``'s; ``PeerProtocolError``
        if they differ."""
        if not hmac.compare_digest(recv_exact(self.sock, TAG_BYTES, deadline), mac.digest()[:TAG_BYTES]):
            raise PeerProtocolError(f"{what}: bad tag (altered on the way, or not from this connection's peer)")

    def _mac(self, way: int, parts):
        mac = hmac.new(self.key, self._labels[way] + _SEQ.pack(self._counts[way]), "sha256")
        self._counts[way] += 1
        for part in parts:
            mac.update(part)
        return mac


def _mac(secret: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, role + transcript, "sha256").digest()


_SENT_BYTES = NONCE_BYTES + STORAGE_ID_BYTES + SAMPLE_BYTES + BINDING_BYTES  # each side's part of the transcript


def _channel(sock: socket.socket, secret: bytes, transcript: bytes, ours: bytes, theirs: bytes,
             client: bool) -> Channel:
    """The authenticated connection, once each side's sent part (``ours``, ``theirs``: nonce, storage id,
    sample, binding) is checked for the same copy of the dataset where their stamps do not compare."""
    ids = [part[NONCE_BYTES:NONCE_BYTES + STORAGE_ID_BYTES] for part in (ours, theirs)]
    samples = [part[NONCE_BYTES + STORAGE_ID_BYTES:-BINDING_BYTES] for part in (ours, theirs)]
    shared = ids[0] == ids[1] != NO_STORAGE
    if not shared:
        differ = diverged(*samples)
        if differ:
            shown = ", ".join(map(str, differ[:5])) + (", ..." if len(differ) > 5 else "")
            raise PeerProtocolError(f"its copy of the dataset differs from this server's: sampled item(s) {shown} "
                                    f"have another size or other bytes (every server must hold the same files)")
    return Channel(sock, _mac(secret, b"session", transcript), shared, client)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes from ``sock``, or ``ConnectionError``/``TimeoutError``; ``deadline`` is a
    ``time.monotonic()`` by which they must have arrived (None: the socket's own timeout, which a deadline
    leaves as it found it)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    timeout = sock.gettimeout() if deadline is not None else None
    try:
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {got} of {n} bytes")
                sock.settimeout(left)
            k = sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError(f"connection closed after {got} of {n} bytes")
            got += k
    finally:
        if deadline is not None:
            sock.settimeout(timeout)
    return bytes(buf)


def server_handshake(sock: socket.socket, secret: bytes, deadline: float, storage_id: bytes = NO_STORAGE,
                     binding: bytes = NO_BINDING, sample: bytes = NO_SAMPLE) -> Channel:
    """Authenticate a client that connected (see NOTE [ Peer wire ]; ``storage_id``, ``binding`` and
    ``sample``: this side's); raises ``PeerProtocolError``, also for a client of another job or dataset, or
    with another copy of the dataset."""
    ours = secrets.token_bytes(NONCE_BYTES) + storage_id + sample + binding
    sock.sendall(HELLO + ours)
    answer = recv_exact(sock, _MAC_BYTES + _SENT_BYTES, deadline)
    if answer[-BINDING_BYTES:] != binding:
        raise PeerProtocolError("the client is of another job or dataset (its handshake has another binding)")
    transcript = ours + answer[_MAC_BYTES:]
    if not hmac.compare_digest(answer[:_MAC_BYTES], _mac(secret, b"client", transcript)):
        raise PeerProtocolError("client failed the handshake (wrong secret)")
    sock.sendall(_mac(secret, b"server", transcript))
    return _channel(sock, secret, transcript, ours, answer[_MAC_BYTES:], client=False)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float, storage_id: bytes = NO_STORAGE,
                     binding: bytes = NO_BINDING, sample: bytes = NO_SAMPLE) -> Channel:
    """Authenticate to a server and check that it knows the secret too, serves this ``binding`` and holds the
    same copy of the dataset (see NOTE [ Peer wire ]; ``storage_id`` and ``sample``: this side's); raises
    ``PeerProtocolError``."""
    hello = recv_exact(sock, len(HELLO) + _SENT_BYTES, deadline)
    if hello[:len(HELLO)] != HELLO:
        raise PeerProtocolError("not a coordl peer server of this version (bad greeting)")
    if hello[-BINDING_BYTES:] != binding:
        raise PeerProtocolError("the server serves another job or dataset (its handshake has another binding)")
    ours = secrets.token_bytes(NONCE_BYTES) + storage_id + sample + binding
    transcript = hello[len(HELLO):] + ours
    sock.sendall(_mac(secret, b"client", transcript) + ours)
    if not hmac.compare_digest(recv_exact(sock, _MAC_BYTES, deadline), _mac(secret, b"server", transcript)):
        raise PeerProtocolError("server failed the handshake (wrong secret)")
    return _channel(sock, secret, transcript, ours, hello[len(HELLO):], client=True)


def copy_sample(n_items: int, size, digest) -> bytes:
    """This side's sample of its copy of a dataset of ``n_items`` (NOTE [ Peer wire ]): the count, then
    ``size(i)`` of the sampled items and ``digest(i)`` (bytes) of some of them, each None where the item's
    file is missing."""
    ids = sampled(n_items)
    words = [_MISSING if s is None else min(s, _MISSING - 1) for s in map(size, ids)]
    digests = [digest(i) for i in _digested(ids)]
    return (_SAMPLE_HEAD.pack(n_items, *words, *[_MISSING] * (SAMPLE_SIZES - len(words)))
            + b"".join((d or _NO_DIGEST)[:_SAMPLE_DIGEST_BYTES].ljust(_SAMPLE_DIGEST_BYTES, b"\0") for d in digests)
            + _NO_DIGEST * (SAMPLE_DIGESTS - len(digests)))


def sampled(n_items: int) -> list[int]:
    """The items a sample describes: up to ``SAMPLE_SIZES`` evenly spaced ids, the same at every side."""
    return list(range(0, n_items, max(1, -(-n_items // SAMPLE_SIZES))))[:SAMPLE_SIZES]


def _digested(ids: list[int]) -> list[int]:
    return ids[::max(1, len(ids) // SAMPLE_DIGESTS)][:SAMPLE_DIGESTS]


def diverged(ours: bytes, theirs: bytes) -> list[int]:
    """The items of two samples of the same dataset that are present in both with another size or digest
    (none where the samples are of datasets of different lengths: the binding tells those apart)."""
    (n, *mine), (m, *other) = _SAMPLE_HEAD.unpack_from(ours), _SAMPLE_HEAD.unpack_from(theirs)
    if n != m:
        return []
    ids = sampled(n)
    out = {i for i, a, b in zip(ids, mine, other) if _MISSING not in (a, b) and a != b}
    for k, i in enumerate(_digested(ids)):
        at = _SAMPLE_HEAD.size + k * _SAMPLE_DIGEST_BYTES
        a, b = ours[at:at + _SAMPLE_DIGEST_BYTES], theirs[at:at + _SAMPLE_DIGEST_BYTES]
        if _NO_DIGEST not in (a, b) and a != b:
            out.add(i)
    return sorted(out)


def send_request(channel: Channel, ids) -> None:
    """Ask for ``ids`` (1 to ``MAX_IDS`` of them)."""
    ids = list(ids)
    if not 0 < len(ids) <= MAX_IDS:
        raise ValueError(f"a request holds 1 to {MAX_IDS} ids, not {len(ids)}")
    frame = _FRAME.pack(REQUEST, len(ids)) + struct.pack(f"!{len(ids)}I", *ids)
    channel.sock.sendall(frame + channel.tag(frame))


def read_request(channel: Channel, n_items: int, first_byte_deadline: float | None,
                 frame_s: float) -> list[int] | Handoff | None:
    """The next request: its ids (a list), or a hand-off's header (its bytes not read yet: see
    :func:`read_handoff`), or None when the client closed between requests. Raises ``PeerProtocolError``
    for a bad frame or tag or an id out of ``range(n_items)``, ``TimeoutError`` when a started frame takes
    more than ``frame_s`` (a slow client)."""
    sock = channel.sock
    try:
        first = recv_exact(sock, 1, first_byte_deadline)
    except ConnectionError:
        return None
    deadline = time.monotonic() + frame_s
    header = first + recv_exact(sock, _FRAME.size - 1, deadline)
    magic, count = _FRAME.unpack(header)
    if magic == KEEP:
        tail = recv_exact(sock, _KEEP_TAIL.size, deadline)
        length, inode, ctime = _KEEP_TAIL.unpack(tail)
        if count >= n_items or length > MAX_ITEM_BYTES:
            raise PeerProtocolError(f"hand-off of item {count} ({length} bytes) out of range")
        return Handoff(count, length, _stamp(channel, inode, ctime, length), channel.receiving(header, tail))
    if magic != REQUEST:
        raise PeerProtocolError(f"bad request magic {magic!r}")
    if not 0 < count <= MAX_IDS:
        raise PeerProtocolError(f"request of {count} ids (1 to {MAX_IDS} allowed)")
    body = recv_exact(sock, 4 * count, deadline)
    channel.check(channel.receiving(header, body), deadline, "request")
    ids = struct.unpack(f"!{count}I", body)
    if max(ids) >= n_items:
        raise PeerProtocolError(f"item id {max(ids)} out of range (the dataset has {n_items})")
    return list(ids)


def read_handoff(channel: Channel, handoff: Handoff, frame_s: float, keep: bool) -> bytes | None:
    """The bytes of ``handoff`` (``keep``), or None after reading past them in small chunks; either way
    their tag is checked (else ``PeerProtocolError``)."""
    deadline = time.monotonic() + frame_s + handoff.length / MIN_RATE
    sock, mac = channel.sock, handoff.mac
    if keep:
        data = recv_exact(sock, handoff.length, deadline)
        mac.update(data)
    else:
        data, left = None, handoff.length
        while left:
            chunk = recv_exact(sock, min(left, _SKIP_CHUNK), deadline)
            mac.update(chunk)
            left -= len(chunk)
    channel.check(mac, deadline, f"hand-off of item {handoff.index}")
    return data


def send_keep(channel: Channel, index: int, data, stamp: tuple | None) -> None:
    """Hand item ``index`` to the server to keep: ``data``, read with ``stamp`` (None: unstamped)."""
    header = _FRAME.pack(KEEP, index) + _KEEP_TAIL.pack(len(data), *_version(stamp))
    tag = channel.tag(header, data)
    channel.sock.sendall(header)
    channel.sock.sendall(data)
    channel.sock.sendall(tag)


def send_kept(channel: Channel, index: int, outcome: int) -> None:
    frame = _KEPT.pack(KEPT, index, outcome)
    channel.sock.sendall(frame + channel.tag(frame))


def read_kept(channel: Channel, index: int, deadline: float | None) -> int:
    """The server's answer to handing it ``index``: ``STORED``, ``FULL`` or ``DECLINED``."""
    frame = recv_exact(channel.sock, _KEPT.size, deadline)
    channel.check(channel.receiving(frame), deadline, f"hand-off answer for id {index}")
    magic, got, outcome = _KEPT.unpack(frame)
    if magic != KEPT or got != index or outcome not in (STORED, FULL, DECLINED):
        raise PeerProtocolError(f"bad hand-off answer {magic!r} (id {got}, outcome {outcome}) for id {index}")
    return outcome


def item_digest(data) -> bytes:
    """The digest of a reply item's bytes that its tag covers (NOTE [ Peer wire ])."""
    return hashlib.sha256(data).digest()


_NO_BYTES_DIGEST = item_digest(b"")


def send_reply(channel: Channel, items: list[tuple[int, tuple | None]]) -> None:
    """Answer a request: ``items`` are (id, (bytes-like, stamp or None, :func:`item_digest` of the bytes) or
    None), in the request's order (sent in writes of about ``_SEND_CHUNK`` bytes)."""
    parts, size = [_FRAME.pack(REPLY, len(items))], 0
    for index, found in items:
        data, stamp, digest = (b"", None, _NO_BYTES_DIGEST) if found is None else found
        header = _ITEM.pack(index, ABSENT if found is None else FOUND, len(data), *_version(stamp))
        parts += (header, data, channel.tag(header, digest))
        size += len(data)
        if size >= _SEND_CHUNK:
            channel.sock.sendall(b"".join(parts))
            parts, size = [], 0
    if parts:
        channel.sock.sendall(b"".join(parts))


def read_reply(channel: Channel, ids: list[int], deadline: float | None):
    """Yield (id, bytes or None, stamp) for each of ``ids`` as its reply arrives, checked (id, length, tag);
    the stamp is the server's (None where stamps do not compare: see NOTE [ Peer wire ]). Raises
    ``PeerProtocolError`` on anything else, ``TimeoutError`` past ``deadline``, which each item's header
    moves on by its length at ``MIN_RATE``."""
    sock = channel.sock
    magic, count = _FRAME.unpack(recv_exact(sock, _FRAME.size, deadline))
    if magic != REPLY or count != len(ids):
        raise PeerProtocolError(f"bad reply header {magic!r} for {count} items ({len(ids)} asked)")
    for expected in ids:
        header = recv_exact(sock, _ITEM.size, deadline)
        index, status, length, inode, ctime = _ITEM.unpack(header)
        if index != expected or status not in (FOUND, ABSENT) or length > MAX_ITEM_BYTES or (status == ABSENT
                                                                                             and length):
            raise PeerProtocolError(f"bad reply item (id {index}, status {status}, {length} bytes) for id {expected}")
        if deadline is not None:
            deadline += length / MIN_RATE
        data = recv_exact(sock, length, deadline)
        channel.check(channel.receiving(header, item_digest(data)), deadline, f"item {index}")
        yield (index, None, None) if status == ABSENT else (index, data, _stamp(channel, inode, ctime, length))


def _version(stamp: tuple | None) -> tuple[int, int]:
    """A stamp's inode and ctime for the wire (zeros: none)."""
    return (0, 0) if stamp is None else (stamp[0], stamp[1])


def _stamp(channel: Channel, inode: int, ctime: int, length: int) -> tuple | None:
    """The stamp a message carries, where this connection's stamps compare."""
    return (inode, ctime, length) if channel.shared else None
