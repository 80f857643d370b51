"""harness.delay_proxy: each direction ``delay_s`` late, bytes intact and in order, chunks in flight together
(the delay is not paid once per chunk), and nothing left open after stop()."""

import socket
import threading
import time

from harness.delay_proxy import DelayProxy


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def _exchange(port: int, payload: bytes) -> tuple[bytes, float]:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        sender = threading.Thread(target=lambda: (conn.sendall(payload), conn.shutdown(socket.SHUT_WR)))
        sender.start()
        got = bytearray()
        while data := conn.recv(1 << 16):
            got += data
        sender.join()
    return bytes(got), time.monotonic() - started


def test_a_round_trip_takes_twice_the_delay_and_a_large_transfer_pays_it_about_once():
    listener, thread = _echo_server()
    delay = 0.05
    try:
        with DelayProxy(listener.getsockname(), delay) as proxy:
            got, took = _exchange(proxy.port, b"ping")
            assert got == b"ping" and took >= 2 * delay
            payload = bytes(range(256)) * (8 << 10)  # 2 MiB, 32 chunks of 64 KiB or more each way
            got, took = _exchange(proxy.port, payload)
            assert got == payload
            assert took < 32 * delay / 2, f"{took:.2f} s: the delay was paid chunk by chunk"
            port = proxy.port
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            refused = False
        except OSError:
            refused = True
        assert refused and not proxy._thread.is_alive()
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        listener.close()
        thread.join(5)
