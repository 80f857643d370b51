"""A loopback HTTP proxy before an S3 server that answers the next requests it is told to fail with ``503 Slow
Down`` itself (S3's throttling) and forwards the others, each on a server connection of its own.

    with SlowDownProxy(("127.0.0.1", server.port)) as proxy:
        proxy.fail(2)   # the next two requests get a 503
"""

import asyncio
import threading

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class SlowDownProxy:
    """Listen on a free loopback port before ``target`` (host, port); ``failed`` and ``forwarded`` count the
    requests. A request's head is read whole (GET and HEAD: no body), then answered or forwarded with
    ``Connection: close``, its reply relayed until the server closes, and the client's connection closed."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.port = target, 0
        self.failing, self.failed, self.forwarded = 0, 0, 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slow-down-proxy", daemon=True)
        self._server = None

    def fail(self, requests: int) -> None:
        with self._lock:
            self.failing = requests

    def _should_fail(self) -> bool:
        with self._lock:
            if self.failing > 0:
                self.failing -= 1
                self.failed += 1
                return True
            self.forwarded += 1
            return False

    async def _serve(self, reader, writer) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        if self._should_fail():
            writer.write(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (len(SLOW_DOWN), SLOW_DOWN))
            await writer.drain()
            writer.close()
            return
        lines = [line for line in head.split(b"\r\n")[:-2] if not line.lower().startswith(b"connection:")]
        server_reader, server_writer = await asyncio.open_connection(*self.target)
        server_writer.write(b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n")
        await server_writer.drain()
        try:
            while chunk := await server_reader.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            server_writer.close()
            writer.close()

    def __enter__(self) -> "SlowDownProxy":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        async def close() -> None:
            self._server.close()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
