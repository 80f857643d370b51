"""harness.delay_proxy: each direction ``delay_s`` late, bytes intact and in order, chunks in flight together
(the delay is not paid once per chunk), and nothing left open after stop(); in a process of its own, the same,
ending when its parent does."""

import socket
import subprocess
import sys
import threading
import time

from harness.delay_proxy import DelayProxy, DelayProxyProcess


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


def test_a_proxy_in_its_own_process_delays_alike_and_ends_with_its_stdin_or_its_parent():
    listener, thread = _echo_server()
    delay = 0.05
    try:
        proxy = DelayProxyProcess(listener.getsockname(), delay).start()
        child = proxy._proc
        got, took = _exchange(proxy.port, b"ping")
        assert got == b"ping" and took >= 2 * delay
        proxy.stop()
        assert child.returncode == 0
        orphan = subprocess.Popen([sys.executable, "-c", ORPHANING, *map(str, listener.getsockname())],
                                  stdout=subprocess.PIPE, text=True)
        pid = int(orphan.stdout.readline())
        orphan.wait(30)  # its parent is gone: its stdin closes, so it ends
        deadline = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < deadline, "the orphaned proxy kept running"
            time.sleep(0.05)
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)


ORPHANING = """
import sys
from harness.delay_proxy import DelayProxyProcess
proxy = DelayProxyProcess((sys.argv[1], int(sys.argv[2])), 0.01).start()
print(proxy._proc.pid, flush=True)
"""  # exits at once, leaving its proxy behind


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
