"""Partitioned caching's machinery: the topology, the peers' map exchange and read path, hand-offs, the peer server and its wire."""
