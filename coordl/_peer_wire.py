"""The peer tier's wire format: length-prefixed binary frames and the HMAC handshake. No pickles.

NOTE [ Peer wire ]
Every connection starts with a mutual challenge-response over the job's secret:
  server -> client  ``HELLO`` magic (8 bytes) + server nonce (32)
  client -> server  HMAC-SHA256(secret, "client" + server nonce) (32) + client nonce (32)
  server -> client  HMAC-SHA256(secret, "server" + client nonce) (32)
Both sides compare digests with ``hmac.compare_digest``; a wrong one closes the connection, so neither
side sends or accepts a byte of data to or from anyone who does not know the secret.

Then the client sends requests and the server answers each in order:
  request  ``!4sI`` (``REQUEST`` magic, count) + count x ``!I`` item ids
  reply    ``!4sI`` (``REPLY`` magic, count) + per id, in the request's order: ``!IBII`` (id, status,
           length, crc32 of the bytes) + the bytes (``length`` of them when status is ``FOUND``, none
           when ``ABSENT``)
A request holds at most ``MAX_IDS`` ids; an item is at most ``MAX_ITEM_BYTES``. The client checks that
each reply names the id it asked for, in order, and that the bytes match their checksum before use.

A client may also hand the server an item to keep (see ``partitioned`` NOTE [ Hand-off ]):
  keep     ``!4sIII`` (``KEEP`` magic, id, length, crc32) + the bytes
  answer   ``!4sIB`` (``KEPT`` magic, id, outcome): ``STORED``, ``FULL`` (its cache takes no more) or
           ``DECLINED`` (held already, or its own copy of the file has another length)
The server decides from the header whether it would keep the item: only then does it read the bytes
into memory (at most its own file's length) and check their checksum; else it reads past them in small
chunks. So a hand-off never makes a server hold more than an item it would cache anyway.
"""

import collections
import hashlib
import hmac
import secrets
import socket
import struct
import time
import zlib

HELLO = b"CDLPEER1"
REQUEST = b"CDLQ"
REPLY = b"CDLR"
KEEP = b"CDLK"
KEPT = b"CDLA"
NONCE_BYTES = 32
FOUND, ABSENT = 0, 1
STORED, FULL, DECLINED = 0, 1, 2
MAX_IDS = 8192
"""Ids per request (a minibatch's misses for one owner come in one request)."""
MAX_ITEM_BYTES = 1 << 30
"""Largest item a reply may carry."""

_FRAME = struct.Struct("!4sI")
_ID = struct.Struct("!I")
_ITEM = struct.Struct("!IBII")
_KEEP_TAIL = struct.Struct("!II")  # after _FRAME(KEEP, id): length, crc32
_KEPT = struct.Struct("!4sIB")
_SEND_CHUNK = 1 << 20
_SKIP_CHUNK = 1 << 16
MIN_RATE = 10**7
"""Bytes per second a client must at least keep up within a frame's body (on top of ``frame_s``)."""

Handoff = collections.namedtuple("Handoff", "index length crc")
"""A hand-off's header; its bytes follow on the connection (:func:`read_handoff`)."""


class PeerProtocolError(ConnectionError):
    """The other side broke the protocol (bad magic, wrong id, bad checksum, oversized frame) or failed the
    handshake; the connection is closed."""


def _mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes from ``sock``, or ``ConnectionError``/``TimeoutError``; ``deadline`` is a
    ``time.monotonic()`` by which they must have arrived (None: the socket's own timeout)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
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
    return bytes(buf)


def server_handshake(sock: socket.socket, secret: bytes, deadline: float) -> None:
    """Authenticate a client that connected (see NOTE [ Peer wire ]); raises ``PeerProtocolError``."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(HELLO + nonce)
    answer = recv_exact(sock, 2 * NONCE_BYTES, deadline)
    if not hmac.compare_digest(answer[:NONCE_BYTES], _mac(secret, b"client", nonce)):
        raise PeerProtocolError("client failed the handshake (wrong secret)")
    sock.sendall(_mac(secret, b"server", answer[NONCE_BYTES:]))


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> None:
    """Authenticate to a server and check that it knows the secret too; raises ``PeerProtocolError``."""
    hello = recv_exact(sock, len(HELLO) + NONCE_BYTES, deadline)
    if hello[:len(HELLO)] != HELLO:
        raise PeerProtocolError("not a coordl peer server (bad greeting)")
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(_mac(secret, b"client", hello[len(HELLO):]) + nonce)
    if not hmac.compare_digest(recv_exact(sock, NONCE_BYTES, deadline), _mac(secret, b"server", nonce)):
        raise PeerProtocolError("server failed the handshake (wrong secret)")


def encode_request(ids) -> bytes:
    ids = list(ids)
    if not 0 < len(ids) <= MAX_IDS:
        raise ValueError(f"a request holds 1 to {MAX_IDS} ids, not {len(ids)}")
    return _FRAME.pack(REQUEST, len(ids)) + struct.pack(f"!{len(ids)}I", *ids)


def read_request(sock: socket.socket, n_items: int, first_byte_deadline: float | None,
                 frame_s: float) -> list[int] | Handoff | None:
    """The next request: its ids (a list), or a hand-off's header (its bytes not read yet: see
    :func:`read_handoff`), or None when the client closed between requests. Raises ``PeerProtocolError``
    for a bad frame or an id out of ``range(n_items)``, ``TimeoutError`` when a started frame takes more
    than ``frame_s`` (a slow client)."""
    try:
        first = recv_exact(sock, 1, first_byte_deadline)
    except ConnectionError:
        return None
    deadline = time.monotonic() + frame_s
    magic, count = _FRAME.unpack(first + recv_exact(sock, _FRAME.size - 1, deadline))
    if magic == KEEP:
        length, crc = _KEEP_TAIL.unpack(recv_exact(sock, _KEEP_TAIL.size, deadline))
        if count >= n_items or length > MAX_ITEM_BYTES:
            raise PeerProtocolError(f"hand-off of item {count} ({length} bytes) out of range")
        return Handoff(count, length, crc)
    if magic != REQUEST:
        raise PeerProtocolError(f"bad request magic {magic!r}")
    if not 0 < count <= MAX_IDS:
        raise PeerProtocolError(f"request of {count} ids (1 to {MAX_IDS} allowed)")
    ids = struct.unpack(f"!{count}I", recv_exact(sock, 4 * count, deadline))
    if max(ids) >= n_items:
        raise PeerProtocolError(f"item id {max(ids)} out of range (the dataset has {n_items})")
    return list(ids)


def read_handoff(sock: socket.socket, handoff: Handoff, frame_s: float, keep: bool) -> bytes | None:
    """The bytes of ``handoff`` (``keep``: read and checked against its checksum, else ``PeerProtocolError``),
    or None after reading past them in small chunks (``keep=False``)."""
    deadline = time.monotonic() + frame_s + handoff.length / MIN_RATE
    if keep:
        data = recv_exact(sock, handoff.length, deadline)
        if zlib.crc32(data) != handoff.crc:
            raise PeerProtocolError(f"hand-off of item {handoff.index}: checksum mismatch ({handoff.length} bytes)")
        return data
    left = handoff.length
    while left:
        left -= len(recv_exact(sock, min(left, _SKIP_CHUNK), deadline))
    return None


def send_keep(sock: socket.socket, index: int, data) -> None:
    """Hand item ``index`` to the server to keep."""
    sock.sendall(_FRAME.pack(KEEP, index) + _KEEP_TAIL.pack(len(data), zlib.crc32(data)))
    sock.sendall(data)


def send_kept(sock: socket.socket, index: int, outcome: int) -> None:
    sock.sendall(_KEPT.pack(KEPT, index, outcome))


def read_kept(sock: socket.socket, index: int, deadline: float | None) -> int:
    """The server's answer to handing it ``index``: ``STORED``, ``FULL`` or ``DECLINED``."""
    magic, got, outcome = _KEPT.unpack(recv_exact(sock, _KEPT.size, deadline))
    if magic != KEPT or got != index or outcome not in (STORED, FULL, DECLINED):
        raise PeerProtocolError(f"bad hand-off answer {magic!r} (id {got}, outcome {outcome}) for id {index}")
    return outcome


def send_reply(sock: socket.socket, items: list[tuple[int, object]]) -> None:
    """Answer a request: ``items`` are (id, bytes-like or None), in the request's order (sent in writes of
    about ``_SEND_CHUNK`` bytes)."""
    parts, size = [_FRAME.pack(REPLY, len(items))], 0
    for index, data in items:
        if data is None:
            parts.append(_ITEM.pack(index, ABSENT, 0, 0))
        else:
            parts += (_ITEM.pack(index, FOUND, len(data), zlib.crc32(data)), data)
            size += len(data)
        if size >= _SEND_CHUNK:
            sock.sendall(b"".join(parts))
            parts, size = [], 0
    if parts:
        sock.sendall(b"".join(parts))


def read_reply(sock: socket.socket, ids: list[int], deadline: float):
    """Yield (id, bytes or None) for each of ``ids`` as its reply arrives, checked (id, length, checksum);
    raises ``PeerProtocolError`` on anything else, ``TimeoutError`` past ``deadline``."""
    magic, count = _FRAME.unpack(recv_exact(sock, _FRAME.size, deadline))
    if magic != REPLY or count != len(ids):
        raise PeerProtocolError(f"bad reply header {magic!r} for {count} items ({len(ids)} asked)")
    for expected in ids:
        index, status, length, crc = _ITEM.unpack(recv_exact(sock, _ITEM.size, deadline))
        if index != expected or status not in (FOUND, ABSENT) or length > MAX_ITEM_BYTES:
            raise PeerProtocolError(f"bad reply item (id {index}, status {status}, {length} bytes) for id {expected}")
        if status == ABSENT:
            yield index, None
            continue
        data = recv_exact(sock, length, deadline)
        if zlib.crc32(data) != crc:
            raise PeerProtocolError(f"item {index}: checksum mismatch ({length} bytes)")
        yield index, data
