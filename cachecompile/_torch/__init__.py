"""torch's private names, in one layer.

cachecompile reads and replays what Dynamo and Inductor produce, so it depends on names
torch does not promise to keep. Every such name is used here and nowhere else (ruff's
banned-api rule, TID251, keeps it so; see pyproject.toml), one module per concern:

* :mod:`.versions`         the running torch: version, build, the releases tested on
* :mod:`.runtime`          warm path, ``torch`` only: global state, function modes,
                           SDPBackend, operators, pytree, what is imported
* :mod:`.dynamo_shim`      the stand-in for ``torch._dynamo.utils`` in replayed bytecode
* :mod:`.guard_tree`       warm path: Dynamo's C++ guard tree, built without Dynamo
* :mod:`.frame_hook`       warm path: a stored frame run in place of a called function's
                           code (Dynamo's run-only frame hook), without Dynamo
* :mod:`.inductor_runtime` the stand-ins for the Inductor names that output code imports
* :mod:`.dynamo`           cold path: tracing, guards, the names Dynamo resolves,
                           transformed bytecode, AOTAutograd
* :mod:`.inductor`         cold path: compile_fx, output code, kernels, import rewriting
* :mod:`.passes`           custom Inductor passes as data (pattern rules), Inductor not imported

Each module lists the private names it uses in ``NEEDS``. :func:`probe` checks them, so
a torch that renamed or dropped one turns the cache off for the process (one warning,
then plain ``torch.compile``) instead of raising AttributeError at a user. The warm part
is checked when ``cache_compile`` is called, without importing Dynamo or Inductor; the
Dynamo and Inductor parts when a cold compile first needs them (they import those).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Iterable

from cachecompile._torch import versions

logger = logging.getLogger(__name__)

# Parts of torch's internals, as adapters name the ones their cold path uses.
DYNAMO = "dynamo"
INDUCTOR = "inductor"

# Each part's modules, whose NEEDS it checks. They are imported when their part is first
# probed, not with this package: a warm process never imports the cold ones (~5 ms of its
# start, issue 53).
_PARTS: dict[str, tuple[str, ...]] = {
    "warm": ("runtime", "dynamo_shim", "inductor_runtime", "frame_hook"),
    DYNAMO: ("dynamo", "guard_export", "aot"),
    INDUCTOR: ("inductor", "passes"),
}


def _needs(part: str) -> tuple[tuple[str, str], ...]:
    return tuple(need for name in _PARTS[part]
                 for need in importlib.import_module(f"{__name__}.{name}").NEEDS)


def probe(parts: Iterable[str] = ()) -> str | None:
    """Why the cache cannot run on this torch, or None if it can.

    Always checks the torch release and the warm path's names; ``parts`` adds cold-path
    parts (:data:`DYNAMO`, :data:`INDUCTOR`), whose modules it imports. Never raises.
    """
    why = versions.unsupported()
    if why is not None:
        return why
    for part in ("warm", *parts):
        missing = _missing(part)
        if missing is not None:
            return (f"cachecompile needs {missing}, which torch {versions.version()} lacks; "
                    "cache_compile runs as plain torch.compile")
    return None


@functools.cache
def _missing(part: str) -> str | None:
    """The first name of ``part`` this torch lacks (checked once per process)."""
    for module, attr in _needs(part):
        missing = _lacks(module, attr)
        if missing is not None:
            logger.debug("torch lacks %s (%s part of cachecompile._torch)", missing, part)
            return missing
    return None


def _lacks(module: str, attr: str) -> str | None:
    full = f"{module}.{attr}" if attr else module
    try:
        # find_spec first: a module that is simply gone is told apart from one whose
        # import fails (both count as missing).
        if importlib.util.find_spec(module) is None:
            return module
        obj = importlib.import_module(module)
        for name in attr.split(".") if attr else ():
            obj = getattr(obj, name)
    except Exception:  # AttributeError, ImportError, or anything an import raises
        return full
    return None
