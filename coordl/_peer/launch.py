"""This node's peer server as its local rank 0 starts and stops it: a forked child listening where the other
servers reach this one."""

import ipaddress
import logging
import multiprocessing
import multiprocessing.util
import socket

from coordl._core import settings
from coordl._peer import server as peer_server
from coordl._peer.topology import HOST_ENV, PORT_ENV, Topology, whole_number

logger = logging.getLogger(__name__)


def local_address(topology: Topology) -> str:
    """The address this server uses to reach the rendezvous store (a UDP connect sends nothing)."""
    host = settings.get(HOST_ENV)
    if host:
        try:
            wildcard = ipaddress.ip_address(host).is_unspecified
        except ValueError:  # a host name
            wildcard = False
        if wildcard:
            raise ValueError(f"{HOST_ENV} should be an address the other servers can reach this one at, but got "
                             f"{host!r}, which names none (unset it to use the one this server reaches MASTER_ADDR "
                             f"from)")
        return host
    family = socket.AF_INET6 if ":" in topology.master_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((topology.master_addr, topology.master_port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class ServerProcess:
    """This node's peer server (``peer_server.serve``), a child forked as torch forks DataLoader workers."""

    def __init__(self, cache, source, storage, secret: bytes, copy: tuple[bytes, bytes], binding: bytes,
                 limits: tuple[int, int], host: str, port: int):
        ctx = multiprocessing.get_context("fork")
        self.control, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=peer_server.serve,
                                args=(cache, source, storage, secret, copy, binding, limits, host, port, theirs),
                                name="coordl-peer-server", daemon=True)
        self.proc.start()
        theirs.close()
        try:
            kind, value = self.control.recv() if self.control.poll(60) else ("error", "no answer in 60 s")
        except EOFError:
            kind, value = "error", f"it exited with status {self.proc.exitcode}"
        if kind != "port":
            self.stop()
            raise RuntimeError(f"coordl partitioned caching: the peer server could not listen on {host}:{port}: "
                               f"{value} (set {HOST_ENV} / {PORT_ENV} to choose where)")
        self.address = (host, value)

    def serve_exemplars(self, region) -> None:
        """Have the server serve ``region`` (an ``ExemplarRegion``, pickled by name: it attaches there)."""
        self.control.send(("exemplars", region))

    def stop(self) -> None:
        try:
            self.control.send("stop")
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.control.close()


def start_server(cache, source, storage, secret: bytes, copy: tuple[bytes, bytes], binding: bytes,
                  limits: tuple[int, int], topology: Topology, ordinal: int) -> ServerProcess:
    host = local_address(topology)
    port = whole_number(settings.environ(), PORT_ENV, 0, 65535, default=0) if settings.get(PORT_ENV) else 0
    if port and port + ordinal > 65535:
        raise ValueError(f"{PORT_ENV}={port}: this process's partitioned loader {ordinal + 1} of the dataset would "
                         f"serve at port {port + ordinal}, past 65535")
    server = ServerProcess(cache, source, storage, secret, copy, binding, limits, host, port + ordinal if port else 0)
    logger.info("coordl partitioned caching: server %d of %d serves its cache at %s:%d", topology.node,
                topology.nodes, *server.address)
    return server
