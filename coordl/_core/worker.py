"""What coordl does inside DataLoader worker processes beyond fetching samples."""

import os
import threading
import time

_ORPHAN_POLL_S = 0.5
_watching = None
_worker_info = None


def exit_when_orphaned(cleanup) -> None:
    """Once per worker process: if its parent (the training process) dies, run ``cleanup`` and exit.

    torch's own workers notice a dead parent only between tasks and can then hang forever joining
    a result queue nobody reads; a worker left behind would keep its cache registration (and so
    the cache) alive. A daemon thread polls the parent pid and ends the process instead.
    """
    global _watching
    if _watching == os.getpid():
        return
    _watching = os.getpid()
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(_ORPHAN_POLL_S)
        try:
            cleanup()
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="coordl-orphan-watch", daemon=True).start()


def own_row(rows: int) -> int:
    """The row of a per-process counter table of ``rows`` rows this process writes: 0 in the training
    process (or with a single row), 1 + i in DataLoader worker i."""
    global _worker_info
    if _worker_info is None:  # imported here once: the peer server's process needs none of torch
        from torch.utils.data import get_worker_info as _worker_info
    info = _worker_info()
    return 0 if info is None or rows == 1 else 1 + info.id % (rows - 1)


def stop_thread(thread: threading.Thread, stop, join_s: float) -> None:
    """``stop()``, then wait (at most ``join_s``) for ``thread`` to end."""
    stop()
    if thread is not threading.current_thread():
        thread.join(join_s)
