"""TorchAir's ``CompilerConfig`` as the adapter's options: every option canonically (the
``config`` key factor, readable option by option), and the modes that change what is
captured (the aclgraph modes, static kernels).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from cachecompile.backends.torchair_machine import import_torchair
from cachecompile.errors import TorchairUnavailableError
from cachecompile.key.factors import canonical
from cachecompile.store.jsonvalue import JSON

logger = logging.getLogger(__name__)

ACL_MODES = ("reduce-overhead", "npugraph_ex")


# -- options: the config, canonically -----------------------------------------------------
class ConfigOptions(Mapping[str, JSON]):
    """Every CompilerConfig option as ``dotted.path -> canonical value``, plus the object.

    A Mapping, so the generic ``config`` key factor lists each option readably
    (``cachectl explain`` names the one that differs). Callables (custom passes) are keyed
    by their code, files named by options by their content. Computed on first use (the
    first call, as TorchAir does); the live object is what the compile uses.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self._items: dict[str, JSON] | None = None

    def _leaves(self) -> dict[str, JSON]:
        if self._items is None:
            self._items = dict(sorted(_config_leaves(self.config).items()))
        return self._items

    def __getitem__(self, key: str) -> JSON:
        return self._leaves()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._leaves())

    def __len__(self) -> int:
        return len(self._leaves())

    def __repr__(self) -> str:
        return f"ConfigOptions({len(self)} options, mode={self.get('mode')!r})"


def _config_leaves(obj: Any, prefix: str = "") -> dict[str, JSON]:
    from torchair.configs._option_base import OptionValue

    file_kinds = tuple(c for c in (_option_class("FileValue"), _option_class("MustExistedFileAddr"))
                       if c is not None)
    out: dict[str, JSON] = {}
    for key, value in sorted(vars(obj).items()):
        if key.startswith("_"):
            continue
        path = prefix + key
        if isinstance(value, OptionValue):
            v = value.value
            if file_kinds and isinstance(value, file_kinds) and isinstance(v, str) and os.path.isfile(v):
                out[path] = {"path": v, "content": _file_digest(v)}
            else:
                out[path] = canonical(v)
        elif hasattr(value, "__dict__") and not callable(value):
            sub = _config_leaves(value, path + ".")
            out.update(sub if sub else {path: type(value).__qualname__})
        else:
            out[path] = canonical(value)
    return out


def _option_class(cls_name: str) -> type | None:
    mod = importlib.import_module("torchair.configs._option_base")
    cls = getattr(mod, cls_name, None)
    return cls if isinstance(cls, type) else None


def _file_digest(path: str) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_options(config: Any, ge_cache: bool) -> dict[str, Any]:
    """The adapter's options (the ``config`` key factor) for a CompilerConfig or None."""
    _, torchair = import_torchair()
    if config is None:
        config = torchair.CompilerConfig()
    mode = config.mode.value
    if ge_cache and mode in ACL_MODES:
        # TorchAir warns and ignores ge_cache in the aclgraph modes; so do we (and the
        # key says ge_cache=False, so the same entry serves both spellings).
        logger.warning("ge_cache has no effect with config.mode=%r (TorchAir ignores it too)",
                       mode)
        ge_cache = False
    if static_kernel(config) and import_torchair()[0] is None:
        raise TorchairUnavailableError(
            "experimental_config.aclgraph._aclnn_static_shape_kernel needs torch_npu (CANN) "
            "to build its kernels, and torch_npu does not import here")
    return {"compiler_config": ConfigOptions(config), "ge_cache": bool(ge_cache)}


def static_kernel(config: Any) -> bool:
    try:
        return bool(config.mode.value in ACL_MODES
                    and config.experimental_config.aclgraph._aclnn_static_shape_kernel)
    except AttributeError:
        return False
