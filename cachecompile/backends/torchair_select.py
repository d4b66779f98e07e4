"""What selects the TorchAir adapter without ``backend="torchair"``: a torchair
``CompilerConfig`` as ``config``, ``ge_cache=True``, ``torchair.get_npu_backend(...)``'s
result as ``backend``, or, with nothing named, an NPU this process already set up; and the
options it then runs with.

TorchAir's own knowledge, kept apart from :mod:`cachecompile.backends.torchair` so that the
registry asks it on every ``cache_compile`` (the default backend included) without
importing the adapter (tens of ms): the registry knows only that an adapter may have a
selector (:func:`cachecompile.backends.register`). It imports the adapter's config and
machine modules once TorchAir is selected; nothing of the adapter imports it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

NAME = "torchair"


def is_compiler_config(obj: Any) -> bool:
    """A torchair CompilerConfig, recognised without importing torchair."""
    cls = type(obj)
    return cls.__name__ == "CompilerConfig" and cls.__module__.startswith("torchair")


def is_npu_backend(obj: Any) -> bool:
    """``torchair.get_npu_backend(...)``'s result: a partial carrying compiler_config."""
    return isinstance(obj, functools.partial) and "compiler_config" in (obj.keywords or {})


def npu_device_present() -> bool:
    """An NPU this process already set up (torch_npu imported by the user, a device seen).

    Only looked at when nothing else names a backend; torch_npu is never imported here
    (a failed import of it costs seconds and leaves half-registered state behind).
    """
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        return False
    try:
        return bool(torch_npu.npu.is_available())
    except Exception:  # a broken torch_npu means: no NPU to use
        return False


def selects(backend: Any, config: Any, ge_cache: bool) -> bool:
    """Whether ``cache_compile(backend=..., config=..., ge_cache=...)`` means TorchAir."""
    if backend == NAME or is_npu_backend(backend):
        return True
    if backend is not None:
        return False  # another adapter, named or given; ge_cache / config errors come from it
    return ge_cache or is_compiler_config(config) or (config is None and npu_device_present())


def options(backend: Any, config: Any, ge_cache: bool) -> dict[str, Any]:
    """The TorchAir adapter's options for those arguments (ValueError / TypeError for the
    user, naming what is wrong)."""
    from cachecompile.backends.torchair_config import make_options
    from cachecompile.backends.torchair_machine import unavailable_reason
    from cachecompile.errors import TorchairUnavailableError

    why = unavailable_reason()
    if why is not None:
        raise ValueError("the Ascend torchair backend was selected (backend='torchair', a "
                         "torchair CompilerConfig, ge_cache=True or an NPU device) but it is "
                         f"not usable here: {why}. Install torch-npu with CANN, or use "
                         "backend='inductor'")
    if is_npu_backend(backend):
        backend_config = backend.keywords.get("compiler_config")
        # TorchAir's own check (cache_compile in torchair/inference/_cache_compiler.py).
        if config is not None and backend_config != config:
            raise ValueError("config in current backend is different from the config during "
                             "cache generation.")
        config = backend_config if config is None else config
    if config is not None and not is_compiler_config(config):
        raise TypeError("config for backend 'torchair' must be a torchair.CompilerConfig, got "
                        f"{type(config).__qualname__}")
    try:
        return make_options(config, ge_cache)
    except TorchairUnavailableError as e:
        raise ValueError(str(e)) from None
