"""What a rank's processes share about the peers, in shared memory."""

import numpy as np
import torch

_ADDR_BYTES = 64
(C_ITEMS, C_BYTES, C_REQUESTS, C_WAIT_NS, C_HANDED, C_HANDED_BYTES) = range(6)
PEER_COUNTERS = ("items", "bytes", "requests", "wait_ns", "handed_off", "handed_off_bytes")


class PeerState:
    """What a rank's processes share about the peers: ``owner`` int16[N], ``lender`` int16[N] (the server whose
    exemplar region holds a rehearsal member no cache holds: ``_rehearsal.exemplars``), ``meta`` (map version, final),
    ``down`` flags per node (this epoch) and ``warned`` (said so), ``full`` (its cache takes no more), their
    ``addresses``, and per-process, per-node counters (:data:`PEER_COUNTERS`). Torch shared tensors underneath,
    so it travels to DataLoader workers (forked or spawned); each field is a numpy view of its tensor, made
    when the state is built or unpickled, so that the background threads never call into torch (NOTE [ Threads
    at exit ])."""

    def __init__(self, n_items: int, nodes: int, processes: int):
        self._shared = {
            "owner": torch.full((n_items,), -1, dtype=torch.int16),
            "lender": torch.full((n_items,), -1, dtype=torch.int16),
            "meta": torch.zeros(2, dtype=torch.int64),
            "down": torch.zeros(nodes, dtype=torch.int32),
            "warned": torch.zeros(nodes, dtype=torch.int32),
            "full": torch.zeros(nodes, dtype=torch.int32),
            "addresses": torch.zeros((nodes, _ADDR_BYTES), dtype=torch.uint8),
            "counters": torch.zeros((max(processes, 1), nodes, len(PEER_COUNTERS)), dtype=torch.int64),
        }
        for tensor in self._shared.values():
            tensor.share_memory_()
        self._view()

    def __getstate__(self) -> dict:
        return self._shared

    def __setstate__(self, shared: dict) -> None:
        self._shared = shared
        self._view()

    def _view(self) -> None:
        for name, tensor in self._shared.items():
            setattr(self, name, tensor.numpy())

    def address(self, node: int) -> tuple[str, int] | None:
        row = self.addresses[node]
        length = int(row[0])  # written last (see set_address): nonzero means the text is all there
        if not length:
            return None
        host, port = bytes(row[1:1 + length]).decode().rsplit(":", 1)
        return host, int(port)

    def set_address(self, node: int, text: str) -> None:
        """Record ``node``'s address (once: a peer server keeps its address for the run). The text goes in
        first and its length last, so a process reading meanwhile sees no address or all of it."""
        raw = text.encode()
        if len(raw) >= _ADDR_BYTES:
            raise ValueError(f"server {node}'s address {text!r} is longer than {_ADDR_BYTES - 1} bytes")
        row = self.addresses[node]
        row[1:1 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        row[0] = len(raw)
