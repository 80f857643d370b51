"""A TCP proxy on loopback that adds latency, for an object store that is far away (this kernel has no netem).

    with DelayProxy(("127.0.0.1", server_port), delay_s=0.0125) as proxy:   # 25 ms round trip
        endpoint = f"http://127.0.0.1:{proxy.port}"

Every chunk read from either side is handed on ``delay_s`` after it arrived, in order, so each direction
adds ``delay_s`` (a request and its reply: twice that) without limiting throughput: chunks in flight are
not waited for one by one. It runs an asyncio loop in a thread of its own and stops with :meth:`stop` (or
the ``with`` block), closing every connection.
"""

import asyncio
import collections
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
