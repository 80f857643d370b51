"""For the peer tier's tests: a man in the middle (a relay that passes the handshake through untouched, never
knowing the secret, then parses every frame each way and forwards what its hooks make of it), and an edit
that gives a file another version of the same length."""

import os
import socket
import threading
import time

from coordl._peer import wire

GREETING = len(wire.HELLO) + wire.NONCE_BYTES + wire.STORAGE_ID_BYTES + wire.SAMPLE_BYTES + wire.BINDING_BYTES
_ANSWER = 2 * wire.NONCE_BYTES + wire.STORAGE_ID_BYTES + wire.SAMPLE_BYTES + wire.BINDING_BYTES
_PROOF = wire.NONCE_BYTES


def keep_as_is(*message):
    return message


def flip(header, data, tag):
    """A message with every bit of its bytes flipped (as a forger would, recomputing any checksum)."""
    return header, bytes(b ^ 0xFF for b in data), tag


def edit(path) -> None:
    """Give the file ``path`` other bytes of the same length: a new file put in its place, so its stamp
    changes whatever the file system's timestamp granularity."""
    edited = path.with_name(path.name + ".new")
    edited.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))
    os.replace(edited, path)


class Relay:
    """Listens on loopback (:attr:`address`) and relays each connection to ``server``: the server's greeting
    as ``forge_greeting(greeting)`` makes it, the rest of the handshake as it is. After it,
    ``forge_item(header, data, tag)`` gets every reply item and ``forge_sent(header, data, tag)`` every request
    (``data``: its ids) or hand-off (``data``: its bytes) the client sends; each returns the (header, data,
    tag) to forward. :attr:`seen` counts the messages each hook was given. With ``trickle_s``, replies reach
    the client a byte every ``trickle_s`` seconds (a slow but live link)."""

    def __init__(self, server, forge_item=keep_as_is, forge_sent=keep_as_is, forge_greeting=lambda greeting: greeting,
                 trickle_s: float = 0.0):
        self.server, self.forge_item, self.forge_sent = server, forge_item, forge_sent
        self.forge_greeting, self.trickle_s = forge_greeting, trickle_s
        self.seen = {"items": 0, "sent": 0}
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = self._sock.getsockname()[:2]
        self._conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._sock.close()
        for conn in self._conns:
            conn.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.server)
            self._conns += (client, upstream)
            threading.Thread(target=self._relay, args=(upstream, client, self._replies, GREETING, _PROOF),
                             daemon=True).start()
            threading.Thread(target=self._relay, args=(client, upstream, self._requests, _ANSWER),
                             daemon=True).start()

    def _relay(self, src, dst, frames, first: int, then: int = 0) -> None:
        """Pass the handshake's bytes from ``src`` to ``dst`` (the ``first`` of them, the server's greeting
        or the client's answer, through ``forge_greeting`` for the greeting), then ``frames``; a closed end
        closes the other."""
        try:
            head = wire.recv_exact(src, first)
            dst.sendall(self.forge_greeting(head) if first == GREETING else head)
            dst.sendall(wire.recv_exact(src, then))
            while True:
                frames(src, dst)
        except OSError:
            pass
        finally:
            for end in (src, dst):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _replies(self, src, dst) -> None:
        head = wire.recv_exact(src, wire._FRAME.size)
        magic, count = wire._FRAME.unpack(head)
        if magic != wire.REPLY:  # a hand-off's answer: the rest of its frame and its tag
            self._to_client(dst, head + wire.recv_exact(src, wire._KEPT.size - len(head) + wire.TAG_BYTES))
            return
        self._to_client(dst, head)
        for _ in range(count):
            header = wire.recv_exact(src, wire._ITEM.size)
            data = wire.recv_exact(src, wire._ITEM.unpack(header)[2])
            self.seen["items"] += 1
            self._to_client(dst, b"".join(self.forge_item(header, data, wire.recv_exact(src, wire.TAG_BYTES))))

    def _to_client(self, dst, data: bytes) -> None:
        if not self.trickle_s:
            dst.sendall(data)
            return
        for k in range(len(data)):
            time.sleep(self.trickle_s)
            dst.sendall(data[k:k + 1])

    def _requests(self, src, dst) -> None:
        header = wire.recv_exact(src, wire._FRAME.size)
        magic, count = wire._FRAME.unpack(header)
        if magic == wire.KEEP:
            header += wire.recv_exact(src, wire._KEEP_TAIL.size)
            size = wire._KEEP_TAIL.unpack(header[wire._FRAME.size:])[0]
        else:
            size = 4 * count
        data = wire.recv_exact(src, size)
        self.seen["sent"] += 1
        dst.sendall(b"".join(self.forge_sent(header, data, wire.recv_exact(src, wire.TAG_BYTES))))
