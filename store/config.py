"""What the environment and the command line say: sizes, numbers and switches.

One parser of each, shared by the store, ``cachectl`` and ``cachecompile``, so that
``CACHECOMPILE_MAX_SIZE=10G``, ``--max-size 10G`` and a remote's ``chunk=4M`` mean the
same thing, and a mistyped number is reported the same way wherever it is read.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

from . import errors

logger = logging.getLogger(__name__)

__all__ = ["env_flag", "env_float", "env_int", "is_true", "parse_bool", "parse_size"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*")

N = TypeVar("N", int, float)


def parse_size(text: str | int) -> int:
    """``"10G"``, ``"512M"``, ``"1.5GiB"``, ``"4K"`` or a byte count -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(text.upper())
    if not m:
        raise errors.StoreInputError(f"not a size: {text!r} (try 10G, 512M, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def is_true(text: str | None) -> bool:
    """Whether a switch's value turns it on: 1, true, yes or on (any case)."""
    return (text or "").strip().lower() in _TRUE


def parse_bool(text: str) -> bool:
    """A switch's value: 1, true, yes, on (any case) are on; 0, false, no, off and the
    empty string off; anything else is a ValueError (a typo must not read as "off")."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("not a switch (1, true, yes, on / 0, false, no, off)")


def env_flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``$name`` is set to a true value (see :func:`is_true`)."""
    return is_true((os.environ if env is None else env).get(name))


def _env_number(name: str, cast: Callable[[str], N], default: N | None, what: str,
                lenient: bool) -> N | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        problem = f"environment variable {name}={raw!r} is not {what}"
        if not lenient:
            raise errors.StoreInputError(problem) from None
        logger.warning("%s; using %s", problem, default)
        return default


def env_int(name: str, default: int | None = None, *, lenient: bool = False) -> int | None:
    """``$name`` as an integer; ``default`` when it is unset or empty.

    A value that is not an integer raises ValueError naming the variable; with
    ``lenient`` (a tuning knob, not an identity) it is logged and ``default`` is used.
    """
    return _env_number(name, int, default, "an integer", lenient)


def env_float(name: str, default: float, *, lenient: bool = True) -> float:
    """``$name`` as a number (seconds, mostly); ``default`` when unset, empty or, with
    ``lenient`` (the default: these are tuning knobs), not a number (logged)."""
    value = _env_number(name, float, default, "a number", lenient)
    return default if value is None else value
