"""Process-wide state of the cache: whether it is on for this torch, and one open store per
root.

The first probe failure (:func:`cachecompile._torch.probe`) turns caching off for the rest
of the process with one ``UnsupportedTorchWarning``; from then on every cached method runs
as plain ``torch.compile``. Opening a store sweeps its temp dirs, so each root is opened
once per process.
"""

from __future__ import annotations

import logging
import threading
import warnings

from cachecompile import _torch
from cachecompile.errors import UnsupportedTorchWarning, fault, user_stacklevel
from cachecompile.store import LocalStorage, default_root, open_store, settings
from cachecompile.store.errors import RemoteConfigError

logger = logging.getLogger(__name__)

_stores: dict[str, LocalStorage] = {}
_stores_lock = threading.Lock()
_off: str | None = None      # why caching is off in this process; once set, it stays
_off_lock = threading.Lock()


def store_for(cache_dir: str | None) -> LocalStorage:
    """One store object per root and process. ``open_store`` decides read-only
    (``CACHECOMPILE_READONLY``), as it does for cachectl. Hits are written a moment after
    the calls that made them (``hits_later``): a warm start's first calls never wait for
    the index."""
    root = cache_dir if cache_dir is not None else str(default_root())
    with _stores_lock:
        st = _stores.get(root)
        if st is None:
            try:
                # The remote named here, not left to open_store: a bad one is then this
                # process's CacheFaultWarning, not only a log line.
                st = open_store(root, remote=settings.REMOTE.get(), hits_later=True)
            except RemoteConfigError as e:
                # A malformed remote must not cost the local entries: serve from them.
                fault(f"{e}; using the local cache at {root} only")
                st = open_store(root, remote="", hits_later=True)
            _stores[root] = st
        return st


def cache_off(parts: tuple[str, ...] = ()) -> str | None:
    """Why caching is off in this process, or None while it is on.

    Probes torch (:func:`cachecompile._torch.probe`: its release, the warm path's private
    names, and the cold-path ``parts``). The first failure turns caching off for the rest
    of the process, with one ``UnsupportedTorchWarning``.
    """
    global _off
    if _off is None:
        why = _torch.probe(parts)
        if why is None:
            return None
        with _off_lock:
            first = _off is None
            if first:
                _off = why
        if first:
            warnings.warn(why, UnsupportedTorchWarning, stacklevel=user_stacklevel())
            logger.debug("cachecompile is off for this process: %s", why)
    return _off
