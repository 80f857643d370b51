"""Turns on coordl's log output from the environment (``COORDL_LOG_LEVEL=INFO``), nothing else."""

import logging

from coordl._core import settings
from coordl._core.settings import LOG_LEVEL_ENV

_configured = False


def configure_from_env() -> None:
    """Give the ``coordl`` logger the level named by COORDL_LOG_LEVEL and a stderr handler, once.

    Does nothing when the variable is unset, so applications keep full control of logging.

    Raises:
        ValueError: the variable names no logging level.
    """
    global _configured
    level_name = settings.get(LOG_LEVEL_ENV)
    if _configured or not level_name:
        return
    level = logging.getLevelName(level_name.strip().upper())
    if not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL_ENV}={level_name!r} is not a logging level; use DEBUG, INFO, WARNING or ERROR")
    logger = logging.getLogger("coordl")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
    _configured = True
