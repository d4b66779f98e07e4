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
from typing import Any

from cachecompile.backends import base
from cachecompile.backends.base import Adapter
from cachecompile.key import identity

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "cachecompile.backends"

# name -> the adapter, or "module:attribute" (module alone: its ADAPTER), imported lazily:
# a warm process imports only its own adapter.
_REGISTRY: dict[str, Adapter | str] = {}
# name -> what selects that adapter without its name (a module or object with
# ``selects(backend, config, ge_cache)`` and ``options(backend, config, ge_cache)``), or
# where to import it from; asked in order on every resolve, so it must be light to import.
_SELECTORS: dict[str, Any] = {}
_lock = threading.Lock()
_scanned = False


def register(name: str, adapter: Adapter | str, *, selector: Any = None) -> None:
    """Make ``backend=name`` mean ``adapter``: an object implementing
    :class:`~cachecompile.backends.base.Adapter`, or where to import it from
    (``"package.module:ADAPTER"``; a module alone means its ``ADAPTER``). A vendor package
    calls this on import, or declares the same string as an entry point in the group
    ``cachecompile.backends``. Registering a name again replaces it.

    ``selector`` (optional): what picks this adapter when ``backend=`` does not name it
    (TorchAir's ``CompilerConfig`` as ``config``): an object or module with
    ``selects(backend, config, ge_cache) -> bool`` and ``options(backend, config,
    ge_cache) -> dict``, or a module path to import it from."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a backend name must be a non-empty str, got {name!r}")
    if not isinstance(adapter, str):
        _check(name, adapter, f"backend {name!r}")
    with _lock:
        _REGISTRY[name] = adapter
        if selector is not None:
            _SELECTORS[name] = selector
        else:
            _SELECTORS.pop(name, None)


def _check(name: str, obj: Any, what: str) -> None:
    """TypeError unless ``obj`` is an adapter that calls itself ``name``."""
    problem = _not_an_adapter(obj)
    if problem:
        raise TypeError(f"{what}: {problem}")
    if obj.name != name:
        raise TypeError(f"{what} calls itself {obj.name!r}: an entry names its adapter, so "
                        "the two must agree")


def _not_an_adapter(obj: Any) -> str | None:
    missing = base.missing(obj)
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
register("torchair", "cachecompile.backends.torchair:ADAPTER",
         selector="cachecompile.backends.torchair_select")


def resolve(backend: Any, config: Any, *, ge_cache: bool = False) -> tuple[Adapter, dict[str, Any]]:
    """Pick the adapter for ``cache_compile(backend=..., config=..., ge_cache=...)``.

    Returns the adapter and its options (the ``config`` part of the key). Raises
    TypeError / ValueError with a message for the user on bad input.
    """
    for name in list(_SELECTORS):
        selector = _selector(name)
        if selector.selects(backend, config, ge_cache):
            return get(name), dict(selector.options(backend, config, ge_cache))
    if backend is None:
        adapter = get("inductor")
    elif isinstance(backend, str):
        try:
            adapter = get(backend)
        except KeyError:
            import difflib

            near = difflib.get_close_matches(backend, list(names()), n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"unknown backend {backend!r}; {hint}known: {', '.join(names())} (a "
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
    # The adapter reads its own config (by default, a dict of options).
    return adapter, dict(base.capability(adapter, "make_options")(config))


def _selector(name: str) -> Any:
    ref = _SELECTORS[name]
    if isinstance(ref, str):
        ref = importlib.import_module(ref)
        with _lock:
            _SELECTORS[name] = ref
    return ref
