"""Private torch names the warm path reads: global state, function modes, SDPBackend, ops.

Imports ``torch`` only, never ``torch._dynamo`` or ``torch._inductor``; every name is
looked up when a function is called, so a torch that lacks one fails :func:`probe`
(which turns the cache off) instead of failing ``import cachecompile``.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

# (module, attribute path) for every private name below: checked by cachecompile._torch.probe.
NEEDS: tuple[tuple[str, str], ...] = (
    ("torch", "_C._dynamo.guards.GlobalStateGuard"),
    ("torch", "_C._len_torch_function_stack"),
    ("torch", "_C._get_function_stack_at"),
    ("torch", "_C._SDPBackend"),
    ("torch.utils._device", "CURRENT_DEVICE"),
    ("torch.utils._pytree", ""),
    ("torch.fx._pytree", ""),
)

# The module torch defines its operator classes in (OpOverload, OpOverloadPacket,
# HigherOrderOperator); an OpOverloadPacket's own __module__ is "torch._ops.<namespace>".
_OPS_MODULE = "torch._ops"


# -- global state ------------------------------------------------------------------------
def global_state() -> str:
    """Dynamo's own global-state snapshot (grad mode, autocast, default dtype, ...)."""
    return str(torch._C._dynamo.guards.GlobalStateGuard().__getstate__())  # type: ignore[attr-defined]


def global_state_check(state: str) -> Callable[[], bool]:
    """A check that the global state is still ``state`` (a :func:`global_state` snapshot)."""
    g = torch._C._dynamo.guards.GlobalStateGuard()  # type: ignore[attr-defined]
    g.__setstate__(state)  # type: ignore[attr-defined]
    return g.check  # type: ignore[no-any-return]


def function_modes() -> list[Any]:
    """The active torch function modes, innermost last."""
    n = torch._C._len_torch_function_stack()
    return [torch._C._get_function_stack_at(i) for i in range(n)]


def default_device() -> str | None:
    """The device set by ``torch.set_default_device`` (None: not set)."""
    from torch.utils import _device

    dev = _device.CURRENT_DEVICE
    return None if dev is None else str(dev)


# -- objects Dynamo bakes into bytecode or guards ----------------------------------------
def sdp_backend_name(v: Any) -> str | None:
    """The member name if ``v`` is an SDPBackend enum member, else None."""
    return v.name if isinstance(v, torch._C._SDPBackend) else None


def sdp_backend(name: str) -> Any:
    """The SDPBackend member called ``name``; ValueError for any other name."""
    members = torch._C._SDPBackend.__members__
    if not isinstance(name, str) or name not in members:
        raise ValueError(f"unknown SDPBackend {name!r}")
    return members[name]


def is_operator(obj: Any) -> bool:
    """Whether ``obj`` is a torch operator (OpOverload / OpOverloadPacket / HigherOrderOperator)."""
    return (type(obj).__module__ or "") == _OPS_MODULE


def operator_namespace(target: Any) -> str | None:
    """An operator's namespace (``aten``, ``_c10d_functional``); None for other callables."""
    ns = getattr(target, "namespace", None)
    if ns is not None:
        return str(ns)
    # An OpOverloadPacket has no .namespace, only its module torch._ops.<namespace>.
    module = getattr(target, "__module__", "") or ""
    if module.startswith(_OPS_MODULE + "."):
        return module[len(_OPS_MODULE) + 1:]
    return None


def pytree_modules() -> dict[str, types.ModuleType]:
    """The pytree modules FX code generation refers to as ``pytree`` and ``fx_pytree``."""
    return {"pytree": importlib.import_module("torch.utils._pytree"),
            "fx_pytree": importlib.import_module("torch.fx._pytree")}


# -- what this process has imported ------------------------------------------------------
def dynamo_imported() -> bool:
    """Whether Dynamo was imported (a warm process never imports it)."""
    return "torch._dynamo" in sys.modules


def inductor_imported() -> bool:
    """Whether Inductor was imported (a warm process of a C++ program never imports it)."""
    return "torch._inductor" in sys.modules
