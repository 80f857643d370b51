"""Partitioned caching (CoorDL §4.3): the MinIO caches of a multi-server job as one aggregate cache, a local
miss fetched from the server that caches the item before storage. Its machinery is in ``coordl._peer``:
the topology and option (``topology``), the peers' secret (``secret``), their maps (``maps``) and shared
state (``state``), the map exchange (``tier``), the read path and hand-offs in any process (``client``,
``handoff``), the peer server (``launch``, ``server``) and its authenticated wire (``wire``)."""

from coordl._peer.handoff import HANDOFF_DRAIN_S
from coordl._peer.maps import decode_map, encode_map, owners_of
from coordl._peer.secret import SECRET_BYTES, job_secret, loader_binding
from coordl._peer.state import PeerState
from coordl._peer.tier import PeerTier
from coordl._peer.topology import EXCHANGE_ENV, HOST_ENV, PORT_ENV, SECRET_ENV, SECRET_FILE_ENV, TIMEOUT_ENV, \
    Topology, resolve

__all__ = ["EXCHANGE_ENV", "HANDOFF_DRAIN_S", "HOST_ENV", "PORT_ENV", "SECRET_BYTES", "SECRET_ENV", "SECRET_FILE_ENV",
           "TIMEOUT_ENV", "PeerState", "PeerTier", "Topology", "decode_map", "encode_map", "job_secret",
           "loader_binding", "owners_of", "resolve"]
