"""A TCP proxy on loopback that adds latency, for an object store that is far away (this kernel has no netem).

    with DelayProxy(("127.0.0.1", server_port), delay_s=0.0125) as proxy:   # 25 ms round trip
        endpoint = f"http://127.0.0.1:{proxy.port}"

Every chunk read from either side is handed on ``delay_s`` after it arrived, in order, so each direction
adds ``delay_s`` (a request and its reply: twice that) without limiting throughput: chunks in flight are
not waited for one by one. It runs an asyncio loop in a thread of its own and stops with :meth:`stop` (or
the ``with`` block), closing every connection; :class:`DelayProxyProcess` runs one in a process of its own.
"""

import asyncio
import collections
import os
import subprocess
import sys
import threading
import time

CHUNK = 1 << 16


class DelayProxy:
    """Listen on a free loopback port and forward each connection to ``target`` (host, port), each direction
    ``delay_s`` late."""

    def __init__(self, target: tuple[str, int], delay_s: float):
        self.target, self.delay_s = target, delay_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> "DelayProxy":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, client_reader, client_writer) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        pipes = [asyncio.ensure_future(self._pipe(client_reader, server_writer)),
                 asyncio.ensure_future(self._pipe(server_reader, client_writer))]
        self._tasks.update(pipes)
        await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)  # both ends, or a broken one
        for task in pipes:
            task.cancel()
            self._tasks.discard(task)
        for writer in (client_writer, server_writer):
            writer.close()

    async def _pipe(self, reader, writer) -> None:
        """Forward ``reader`` to ``writer``, each chunk ``delay_s`` after it arrived."""
        due: collections.deque = collections.deque()
        arrived = asyncio.Event()

        async def send() -> None:
            while True:
                while not due:
                    arrived.clear()
                    await arrived.wait()
                at, chunk = due.popleft()
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if chunk is None:
                    writer.write_eof() if writer.can_write_eof() else None
                    return
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                try:
                    chunk = await reader.read(CHUNK)
                except ConnectionError:
                    chunk = b""
                due.append((time.monotonic() + self.delay_s, chunk or None))
                arrived.set()
                if not chunk:
                    break
            await sender
        finally:
            sender.cancel()

    def stop(self) -> None:
        """Close the listener and every connection, then end the loop's thread."""
        if not self._thread.is_alive():
            return

        async def close() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "DelayProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class DelayProxyProcess:
    """A :class:`DelayProxy` in a process of its own (so its forwarding takes no CPU time from the process
    measured), which ends when :meth:`stop` closes its stdin, or when this process dies."""

    def __init__(self, target: tuple[str, int], delay_s: float):
        self.target, self.delay_s, self.port = target, delay_s, 0
        self._proc: subprocess.Popen | None = None

    def start(self) -> "DelayProxyProcess":
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._proc = subprocess.Popen([sys.executable, "-m", "harness.delay_proxy", self.target[0], str(self.target[1]),
                                       repr(self.delay_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root,
                                      text=True)
        line = self._proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the delay proxy did not start (it said {line!r})")
        self.port = int(line)
        return self

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()
        self._proc = None

    def __enter__(self) -> "DelayProxyProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # python -m harness.delay_proxy HOST PORT DELAY_S: serves until stdin closes
    with DelayProxy((sys.argv[1], int(sys.argv[2])), float(sys.argv[3])) as proxy:
        print(proxy.port, flush=True)
        sys.stdin.read()
