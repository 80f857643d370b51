"""The peers' secret and the loader's binding in their handshakes.

NOTE [ Security ]
Peers authenticate each connection with HMAC challenge-response over a per-job secret, and every
request, reply item, hand-off and answer after it with a tag under the connection's own key (see
``_peer.wire``), so no one without the secret, a relay in the middle included, can alter a byte unseen.
The secret never goes through the rendezvous store, which anyone who can reach it may read and write
(torchrun's ``TCPStore`` has no authentication): it is ``COORDL_PEER_SECRET`` or the file
``COORDL_PEER_SECRET_FILE`` names, the same on every server, else random bytes rank 0 draws and
broadcasts over torch.distributed's default process group once it is initialized (only the job's ranks
are in it). With neither, partitioned caching stays off ("auto", saying why) or fails (True). The
server binds the address this server uses to reach the store
(``MASTER_ADDR``), never every interface, unless ``COORDL_PEER_HOST`` says otherwise.
"""

import hashlib
import os
import secrets

import torch
import torch.distributed

from coordl._core import settings
from coordl._peer import wire
from coordl._peer.topology import SECRET_ENV, SECRET_FILE_ENV, Topology

SECRET_BYTES = 32
"""The length of the secret rank 0 draws when none is given."""


def job_secret(topology: Topology) -> bytes:
    """The peers' secret: ``COORDL_PEER_SECRET``, else the contents of the file ``COORDL_PEER_SECRET_FILE``
    names (readable by its owner only), else :data:`SECRET_BYTES` random bytes rank 0 draws and broadcasts
    over torch.distributed's default process group (which only the job's ranks join; a collective, as every
    rank builds its loaders alike)."""
    given = settings.get(SECRET_ENV)
    if given:
        return given.encode()
    path = settings.get(SECRET_FILE_ENV)
    if path:
        return _secret_from_file(path)
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    drawn = secrets.token_bytes(SECRET_BYTES) if topology.rank == 0 else bytes(SECRET_BYTES)
    secret = torch.frombuffer(bytearray(drawn), dtype=torch.uint8).to(device)
    torch.distributed.broadcast(secret, src=0)
    return bytes(secret.cpu().numpy())


def loader_binding(store, prefix: str) -> bytes:
    """This loader's binding in the peers' handshakes (NOTE [ Security ]): a digest of its store ``prefix``
    and of the nonce under it in ``store`` (drawn here if no rank has yet)."""
    drawn = secrets.token_hex(16)
    nonce = bytes(store.compare_set("binding", "", drawn)).decode()
    return hashlib.blake2b(f"{prefix}\0{nonce}".encode(), digest_size=wire.BINDING_BYTES).digest()


def _secret_from_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_mode & 0o077:
                raise ValueError(f"{SECRET_FILE_ENV}={path!r} can be read or written by others than its owner: "
                                 f"chmod 600 it (the peers' secret must be private to the job)")
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"{SECRET_FILE_ENV}={path!r} cannot be read: {e}") from None
    if not secret:
        raise ValueError(f"{SECRET_FILE_ENV}={path!r} is empty: it should hold the peers' secret")
    return secret
