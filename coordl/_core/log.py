"""Turns on coordl's log output from the environment (``COORDL_LOG_LEVEL=INFO``); warnings that point at the
caller's line."""

import logging
import os
import sys
import warnings

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


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_caller(message: str, category=UserWarning) -> None:
    """``warnings.warn(message)`` attributed to the first frame outside coordl: the line of the user's (or a
    framework's) code that built the loader, whatever depth coordl called from."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)

