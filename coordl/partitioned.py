"""Partitioned caching (CoorDL §4.3): the MinIO caches of a multi-server job as one aggregate cache, a local
miss fetched from the server that caches the item before storage. Its machinery is in ``coordl._peer``
(the topology and option, the peers' map exchange and read path, hand-offs, the peer server and its
authenticated wire)."""

from coordl._peer.tier import EXCHANGE_ENV, HANDOFF_DRAIN_S, HOST_ENV, PORT_ENV, SECRET_BYTES, SECRET_ENV, \
    SECRET_FILE_ENV, TIMEOUT_ENV, PeerState, PeerTier, Topology, decode_map, encode_map, job_secret, loader_binding, \
    owners_of, resolve

__all__ = ["EXCHANGE_ENV", "HANDOFF_DRAIN_S", "HOST_ENV", "PORT_ENV", "SECRET_BYTES", "SECRET_ENV", "SECRET_FILE_ENV",
           "TIMEOUT_ENV", "PeerState", "PeerTier", "Topology", "decode_map", "encode_map", "job_secret",
           "loader_binding", "owners_of", "resolve"]
