"""Where a rank is in a torchrun job and whether partitioned caching is on: the ``partitioned=`` option,
torchrun's variables and the peers' settings, each checked where it is read (an error names it and its
range)."""

import dataclasses
import math

import torch
import torch.distributed

from coordl._core import settings
from coordl._core.log import warn_caller

PARTITIONED = ("auto", True, False)
SECRET_ENV = "COORDL_PEER_SECRET"
SECRET_FILE_ENV = "COORDL_PEER_SECRET_FILE"
HOST_ENV = "COORDL_PEER_HOST"
PORT_ENV = "COORDL_PEER_PORT"
TIMEOUT_ENV = "COORDL_PEER_TIMEOUT_S"
PEER_TIMEOUT_S = 1.0
"""Default connect and inactivity timeout of a peer request (``COORDL_PEER_TIMEOUT_S``)."""
EXCHANGE_ENV = "COORDL_PEER_EXCHANGE_S"
EXCHANGE_TIMEOUT_S = 60.0
"""Default of how long, in all, an epoch start waits for the servers' maps (``COORDL_PEER_EXCHANGE_S``;
servers start epochs together in DDP); a server whose peer server refuses connections is not waited for."""
_MAX_NODES = 4096
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this rank is in a torchrun job: ``node`` of ``nodes`` servers, ``local_rank`` of ``local_world``."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    node: int
    nodes: int
    master_addr: str
    master_port: int
    run: str

    @classmethod
    def from_env(cls, environ=None) -> "Topology | None":
        """torchrun's (or torch.distributed's ``env://``) variables, None when they are not all set."""
        environ = settings.environ() if environ is None else environ
        if any(name not in environ for name in _ENV):
            return None
        world = whole_number(environ, "WORLD_SIZE", 1)
        local_world = whole_number(environ, "LOCAL_WORLD_SIZE", 1, world)
        rank, local_rank = whole_number(environ, "RANK", 0, world - 1), whole_number(environ, "LOCAL_RANK", 0, local_world - 1)
        nodes = whole_number(environ, "GROUP_WORLD_SIZE", 1, world, default=max(1, world // local_world))
        node = whole_number(environ, "GROUP_RANK", 0, nodes - 1, default=rank // local_world)
        if not node < nodes:
            raise ValueError(f"RANK {rank} with LOCAL_WORLD_SIZE {local_world} makes server {node}, but "
                             f"GROUP_WORLD_SIZE is {nodes}: set GROUP_RANK (torchrun does)")
        run = f"{environ.get('TORCHELASTIC_RUN_ID', 'none')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return cls(rank, world, local_rank, local_world, node, nodes, environ["MASTER_ADDR"],
                   whole_number(environ, "MASTER_PORT", 1, 65535), run)


def whole_number(environ, name: str, low: int, high: int | None = None, default: int | None = None) -> int:
    """The whole number in the environment variable ``name``, from ``low`` to ``high``, else a ``ValueError``
    naming it; ``default`` where it is not set."""
    given = environ.get(name)
    if given is None and default is not None:
        return default
    try:
        value = int(given)
    except (TypeError, ValueError):
        value = None
    if value is None or value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise ValueError(f"{name} should be a whole number {bounds}, but got {given!r}")
    return value


def resolve(partitioned, cache_on: bool) -> Topology | None:
    """The topology to partition over for ``partitioned=``, or None when partitioned caching is off."""
    if partitioned not in PARTITIONED or not isinstance(partitioned, (str, bool)):
        raise ValueError(f"partitioned should be 'auto', True or False, but got partitioned={partitioned!r}")
    if partitioned is False:
        return None
    topology = Topology.from_env()
    if partitioned is True:
        if topology is None:
            missing = [name for name in _ENV if name not in settings.environ()]
            raise RuntimeError(f"partitioned=True needs torch.distributed's environment (launch with torchrun); "
                               f"{', '.join(missing)} not set")
        if not cache_on:
            raise ValueError("partitioned=True needs the cache: cache_bytes=0 turns it off")
        if topology.nodes > _MAX_NODES:
            raise ValueError(f"partitioned caching supports up to {_MAX_NODES} servers, not {topology.nodes}")
        secret_known(True)
        return topology
    if topology is None or topology.nodes < 2 or not cache_on or topology.nodes > _MAX_NODES:
        return None
    return topology if secret_known(partitioned) else None


def secret_known(partitioned) -> bool:
    """Whether the peers' secret can be had without the rendezvous store (see NOTE [ Security ]): given, or
    agreed over torch.distributed's process group. Without it ``partitioned=True`` fails and "auto" turns
    partitioned caching off, saying why."""
    if settings.get(SECRET_ENV) or settings.get(SECRET_FILE_ENV) or (torch.distributed.is_available() and
                                                                       torch.distributed.is_initialized()):
        return True
    why = (f"partitioned caching needs a secret the rendezvous store does not hold: call "
           f"torch.distributed.init_process_group before building the loader (rank 0 then draws one and sends "
           f"it over the group), or give every server the same one in {SECRET_ENV} or a file named by "
           f"{SECRET_FILE_ENV}")
    if partitioned is True:
        raise RuntimeError(why)
    warn_caller(f"{why}; each server caches on its own")
    return False


def seconds_setting(name: str, default: float) -> float:
    """A positive, finite number of seconds from the environment variable ``name``."""
    try:
        value = float(settings.get(name, default))
    except ValueError:
        raise ValueError(f"{name} should be a number of seconds, but got {settings.get(name)!r}") from None
    if not 0 < value < math.inf:
        raise ValueError(f"{name} should be a positive, finite number of seconds, but got {settings.get(name)!r}")
    return value
