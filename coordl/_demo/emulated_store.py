"""An emulated slow disk with a bounded page cache, for machines without root or cgroups.

One server thread in the owning process (``coordl demo``, the benchmark's parent) plays the block
device and the OS page cache: files are read at a fixed bandwidth shared by all readers, and a
byte-bounded LRU of whole files stands in for the page cache (a hit costs no device time). Loaders
read through :class:`StoreClient` over a Unix socket, from any process or thread, so the bytes
"read from the device" are counted by the store, not by the loader.
"""

import collections
import io
import os
import socket
import socketserver
import struct
import threading
import time
from typing import NamedTuple

_LEN = struct.Struct("!q")


class DeviceCounters(NamedTuple):
    """What the emulated device has read so far: bytes, and files (page-cache misses)."""

    read_bytes: int
    read_files: int


class _Device:
    """Bandwidth, page cache and counters of the emulated disk (thread-safe)."""

    def __init__(self, read_bps: int, page_cache_bytes: int):
        self.read_bps, self.page_cache_bytes = read_bps, page_cache_bytes
        self.lock = threading.Lock()
        self.pages: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.cached = self.read_bytes = self.read_files = 0
        self.busy_until = 0.0

    def read(self, path: str, keep: bool) -> bytes:
        """The file's bytes; a miss waits its turn at the device's bandwidth. ``keep=False`` is
        ``posix_fadvise(DONTNEED)`` after the read: the file leaves the page cache."""
        with open(path, "rb") as f:
            data = f.read()
        with self.lock:
            hit = path in self.pages
            if hit:
                self.pages.move_to_end(path)
            else:
                self.read_bytes += len(data)
                self.read_files += 1
                start = max(time.monotonic(), self.busy_until)
                self.busy_until = start + len(data) / self.read_bps
                wait_until = self.busy_until
            if keep and not hit and len(data) <= self.page_cache_bytes:
                self.pages[path] = len(data)
                self.cached += len(data)
                while self.cached > self.page_cache_bytes:
                    self.cached -= self.pages.popitem(last=False)[1]
            elif not keep and hit:
                self.cached -= self.pages.pop(path)
        if not hit:
            time.sleep(max(0.0, wait_until - time.monotonic()))
        return data

    def reset(self, page_cache_bytes: int) -> None:
        """Empty the page cache (drop_caches) and give it a new size; counters keep running."""
        with self.lock:
            self.pages.clear()
            self.cached, self.page_cache_bytes = 0, page_cache_bytes


class _Handler(socketserver.StreamRequestHandler):
    """Requests: ``R <path>`` / ``D <path>`` (read, keep / drop from the page cache) → length + bytes;
    ``S`` → device bytes read so far."""

    def handle(self) -> None:
        device: _Device = self.server.device
        for line in self.rfile:
            op, _, path = line.decode().rstrip("\n").partition(" ")
            if op == "S":
                self.wfile.write(_LEN.pack(device.read_bytes))
                continue
            try:
                data = device.read(path, keep=op == "R")
            except OSError:
                self.wfile.write(_LEN.pack(-1))
                continue
            self.wfile.write(_LEN.pack(len(data)) + data)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class EmulatedStore:
    """The store's server: ``with EmulatedStore(socket_path, read_bps, page_cache_bytes) as store``."""

    def __init__(self, socket_path: str, read_bps: int, page_cache_bytes: int):
        self.socket_path = socket_path
        self.device = _Device(read_bps, page_cache_bytes)
        self._server = _Server(socket_path, _Handler)
        self._server.device = self.device
        self._thread = threading.Thread(target=self._server.serve_forever, name="emulated-store", daemon=True)
        self._thread.start()

    def reset(self, page_cache_bytes: int) -> None:
        """Before a system runs: drop the page cache and size it to that system's budget."""
        self.device.reset(page_cache_bytes)

    def counters(self) -> DeviceCounters:
        """What the device has read so far (in the owning process, without a connection)."""
        with self.device.lock:
            return DeviceCounters(self.device.read_bytes, self.device.read_files)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def __enter__(self) -> "EmulatedStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StoreClient:
    """Reads files through the store. Picklable; each process and thread opens its own connection.

    Implements coordl's ``Storage`` protocol (``read(key)``), so it can be a loader's ``storage=``.

    Args:
        drop_page_cache: as coordl's ``FileStorage``: the file leaves the page cache after the read.
    """

    def __init__(self, socket_path: str, drop_page_cache: bool = False):
        self.socket_path, self.drop_page_cache = socket_path, drop_page_cache
        self._conns = {}  # (pid, thread id) -> (socket, its reader)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_conns": {}}

    def _request(self, line: str) -> tuple[int, object]:
        key = (os.getpid(), threading.get_ident())
        if key not in self._conns:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.socket_path)
            self._conns[key] = (sock, sock.makefile("rb"))
        sock, rfile = self._conns[key]
        sock.sendall(line.encode() + b"\n")
        (n,) = _LEN.unpack(rfile.read(_LEN.size))
        return n, rfile

    def read(self, key: str) -> bytes:
        """The bytes of file ``key``. Raises OSError if the store cannot read it."""
        n, rfile = self._request(("D " if self.drop_page_cache else "R ") + key)
        if n < 0:
            raise OSError(f"emulated store could not read {key}")
        return rfile.read(n)

    def device_read_bytes(self) -> int:
        """Bytes the store has read from its emulated device so far."""
        return self._request("S")[0]


class StoreImageLoader:
    """An ImageFolder ``loader=`` that reads files through the store (picklable): how a plain torch
    DataLoader's dataset reads the emulated disk."""

    def __init__(self, socket_path: str):
        self.client = StoreClient(socket_path)

    def __call__(self, path: str):
        from PIL import Image

        with Image.open(io.BytesIO(self.client.read(path))) as img:
            return img.convert("RGB")
