"""Compile-path adapters, by name: the built-in ones and those a vendor package brings.

A backend plugs in as an *adapter* (:class:`cachecompile.backends.base.Adapter`: compile
a Dynamo graph into a program, load a program in a fresh process, name its key
factors). The built-in adapters are registered below through :func:`register`, the same
call a vendor package makes; a package that is installed can instead declare an entry
point in the group ``cachecompile.backends`` (``name = "package.module:ADAPTER"``), read
only when a name is not registered already. Each adapter module holds what is particular
to its backend; torch's private names, and their differences between releases, live in
``cachecompile._torch`` (docs/design.md). A bare backend callable (``backend=fn``, any
``torch.compile`` backend) gets :mod:`cachecompile.backends.bare`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from collections.abc import Mapping
from typing import Any

from cachecompile.backends.base import Adapter
from cachecompile.key import identity

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "cachecompile.backends"

# name -> the adapter, or "module:attribute" (module alone: its ADAPTER), imported lazily:
# a warm process imports only its own adapter.
_REGISTRY: dict[str, Adapter | str] = {}
_lock = threading.Lock()
_scanned = False


def register(name: str, adapter: Adapter | str) -> None:
    """Make ``backend=name`` mean ``adapter``: an object implementing
    :class:`~cachecompile.backends.base.Adapter`, or where to import it from
    (``"package.module:ADAPTER"``; a module alone means its ``ADAPTER``). A vendor package
    calls this on import, or declares the same string as an entry point in the group
    ``cachecompile.backends``. Registering a name again replaces it."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a backend name must be a non-empty str, got {name!r}")
    if not isinstance(adapter, str):
        _check(name, adapter, f"backend {name!r}")
    with _lock:
        _REGISTRY[name] = adapter


def _check(name: str, obj: Any, what: str) -> None:
    """TypeError unless ``obj`` is an adapter that calls itself ``name``."""
    problem = _not_an_adapter(obj)
    if problem:
        raise TypeError(f"{what}: {problem}")
    if obj.name != name:
        raise TypeError(f"{what} calls itself {obj.name!r}: an entry names its adapter, so "
                        "the two must agree")


def _not_an_adapter(obj: Any) -> str | None:
    missing = [a for a in ("name", "shares_graphs", "torch_parts", "factors", "compile",
                           "load", "plain_backend") if not hasattr(obj, a)]
    if missing:
        return (f"{type(obj).__qualname__} is not an adapter: it lacks {', '.join(missing)} "
                "(cachecompile.backends.base.Adapter)")
    return None


def _scan_entry_points() -> None:
    """Add the installed packages' entry points (never over a registered name)."""
    global _scanned
    with _lock:
        if _scanned:
            return
        _scanned = True
        try:
            eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        except Exception:  # broken metadata elsewhere must not break us
            logger.warning("reading the %s entry points failed", ENTRY_POINT_GROUP,
                           exc_info=True)
            return
        for ep in eps:
            _REGISTRY.setdefault(ep.name, ep.value)


def names() -> list[str]:
    _scan_entry_points()
    return sorted(_REGISTRY)


def get(name: str) -> Adapter:
    """The adapter registered as ``name`` (KeyError if none; TypeError if what is
    registered is not an adapter, naming where it came from)."""
    ref = _REGISTRY.get(name)
    if ref is None:
        _scan_entry_points()
        ref = _REGISTRY.get(name)
    if ref is None:
        raise KeyError(name)
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    obj = identity.import_attr(module.strip(), attr.strip() or "ADAPTER")
    _check(name, obj, f"backend {name!r} ({ref})")
    with _lock:
        _REGISTRY[name] = obj
    adapter: Adapter = obj
    return adapter


register("inductor", "cachecompile.backends.inductor:ADAPTER")
register("aot_eager", "cachecompile.backends.aot_eager:ADAPTER")
register("torchair", "cachecompile.backends.torchair:ADAPTER")


def resolve(backend: Any, config: Any, *, ge_cache: bool = False) -> tuple[Adapter, dict[str, Any]]:
    """Pick the adapter for ``cache_compile(backend=..., config=..., ge_cache=...)``.

    Returns the adapter and its options (the ``config`` part of the key). Raises
    TypeError / ValueError with a message for the user on bad input.
    """
    if _wants_torchair(backend, config, ge_cache):
        return _resolve_torchair(backend, config, ge_cache)
    if backend is None:
        adapter = get("inductor")
    elif isinstance(backend, str):
        try:
            adapter = get(backend)
        except KeyError:
            raise ValueError(f"unknown backend {backend!r}; known: {', '.join(names())} (a "
                             "vendor's backend registers itself: cachecompile.backends."
                             "register, or the 'cachecompile.backends' entry-point "
                             "group)") from None
    elif _not_an_adapter(backend) is None:
        adapter = backend  # an adapter object, given directly
        if adapter.name in _REGISTRY and get(adapter.name) is not adapter:
            # Entries name their adapter: two adapters under one name would load each
            # other's programs.
            raise ValueError(f"an adapter named {adapter.name!r} is registered already, "
                             "and this is another one; give it a name of its own")
    elif callable(backend):
        from cachecompile.backends.bare import BareAdapter

        adapter = BareAdapter(backend)  # any torch.compile backend: its Dynamo half
    else:
        raise TypeError(f"backend must be an adapter name ({', '.join(names())}), an "
                        "adapter, a torch.compile backend callable or a torchair npu "
                        f"backend, got {type(backend).__qualname__}")
    if ge_cache:
        raise ValueError(f"ge_cache=True is an option of the Ascend torchair backend, not of "
                         f"{adapter.name!r}; use backend='torchair' (or leave backend unset)")
    make_options = getattr(adapter, "make_options", None)
    if make_options is not None:
        return adapter, dict(make_options(config))  # the adapter reads its own config
    if config is None:
        options: dict[str, Any] = {}
    elif isinstance(config, Mapping):
        options = dict(config)
    else:
        raise TypeError(f"config for backend {adapter.name!r} must be a dict of options, got "
                        f"{type(config).__qualname__}")
    return adapter, options


def _looks_like_compiler_config(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ == "CompilerConfig" and cls.__module__.startswith("torchair")


def _looks_like_npu_backend(obj: Any) -> bool:
    import functools

    return isinstance(obj, functools.partial) and "compiler_config" in (obj.keywords or {})


def _npu_device_present() -> bool:
    """An NPU this process already set up (torch_npu imported by the user, a device seen).

    Only looked at when nothing else names a backend; torch_npu is never imported here
    (a failed import of it costs seconds and leaves half-registered state behind).
    """
    import sys

    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        return False
    try:
        return bool(torch_npu.npu.is_available())
    except Exception:  # a broken torch_npu means: no NPU to use
        return False


def _wants_torchair(backend: Any, config: Any, ge_cache: bool) -> bool:
    if backend == "torchair" or _looks_like_npu_backend(backend):
        return True
    if isinstance(backend, str):
        return False  # another named adapter; ge_cache / config errors come from it
    if backend is not None:
        return False
    return ge_cache or _looks_like_compiler_config(config) or (
        config is None and _npu_device_present())


def _resolve_torchair(backend: Any, config: Any, ge_cache: bool) -> tuple[Adapter, dict[str, Any]]:
    from cachecompile.backends import torchair

    why = torchair.unavailable_reason()
    if why is not None:
        raise ValueError("the Ascend torchair backend was selected (backend='torchair', a "
                         "torchair CompilerConfig, ge_cache=True or an NPU device) but it is "
                         f"not usable here: {why}. Install torch-npu with CANN, or use "
                         "backend='inductor'")
    if _looks_like_npu_backend(backend):
        backend_config = backend.keywords.get("compiler_config")
        # TorchAir's own check (cache_compile in torchair/inference/_cache_compiler.py).
        if config is not None and backend_config != config:
            raise ValueError("config in current backend is different from the config during "
                             "cache generation.")
        config = backend_config if config is None else config
    if config is not None and not torchair.is_compiler_config(config):
        raise TypeError("config for backend 'torchair' must be a torchair.CompilerConfig, got "
                        f"{type(config).__qualname__}")
    try:
        options = torchair.make_options(config, ge_cache)
    except torchair.TorchairUnavailableError as e:
        raise ValueError(str(e)) from None
    return get("torchair"), options
