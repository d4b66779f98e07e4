"""Private torch names the warm path reads: global state, function modes, SDPBackend, ops.

Imports ``torch`` only, never ``torch._dynamo`` or ``torch._inductor``; every name is
looked up when a function is called, so a torch that lacks one fails :func:`probe`
(which turns the cache off) instead of failing ``import cachecompile``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from . import versions

# (module, attribute path) for every private name below: checked by cachecompile._torch.probe.
NEEDS: tuple[tuple[str, str], ...] = (
    ("torch", "_C._dynamo.guards.GlobalStateGuard"),
    ("torch", "_C._len_torch_function_stack"),
    ("torch", "_C._get_function_stack_at"),
    ("torch", "_C._SDPBackend"),
    ("torch.utils._device", "CURRENT_DEVICE"),
    ("torch.utils._pytree", ""),
    ("torch.fx._pytree", ""),
    ("torch", "_as_tensor_fullprec"),
    ("torch", "_C._DisableAutocast"),
    ("torch", "_C._autograd._get_current_graph_task_keep_graph"),
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
    g = torch._C._dynamo.guards.GlobalStateGuard()
    g.__setstate__(state)  # type: ignore[attr-defined]
    return g.check


def global_state_difference(state: str) -> str | None:
    """Which global settings differ from the snapshot ``state`` (a :func:`global_state`),
    each with both values (``grad_mode False, the entry's True``); None if none does.

    The snapshot is Dynamo's JSON; torch's own name for the first difference
    (``GlobalStateGuard.reason``, e.g. ``autocast(cpu)_enabled``) leads, because the
    autocast settings are lists indexed by device type."""
    now = global_state()
    if now == state:
        return None
    g = torch._C._dynamo.guards.GlobalStateGuard()
    g.__setstate__(state)  # type: ignore[attr-defined]
    named = "" if g.check() else str(g.reason() or "").strip()
    try:
        then, current = json.loads(state), json.loads(now)
    except ValueError:
        return named or "a global setting changed"
    diffs: list[str] = []

    def walk(path: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(f"{path}.{k}" if path else k, a.get(k), b.get(k))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                walk(f"{path}[{i}]", x, y)
        elif a != b:
            diffs.append(f"{path} {b}, the entry's {a}")

    walk("", then, current)
    return "; ".join(([named] if named else []) + diffs) or "a global setting changed"


def function_modes() -> list[Any]:
    """The active torch function modes, innermost last."""
    n = torch._C._len_torch_function_stack()
    return [torch._C._get_function_stack_at(i) for i in range(n)]


def default_device() -> str | None:
    """The device set by ``torch.set_default_device`` (None: not set)."""
    from torch.utils import _device

    dev = _device.CURRENT_DEVICE
    return None if dev is None else str(dev)


# -- the compilers' global settings ------------------------------------------------------
# Torch's config modules whose settings change what a compile produces, as torch's own
# FX graph cache reads them (``save_config_portable``): Inductor's, Dynamo's, AOTAutograd's.
COMPILER_CONFIGS = ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config")
# Settings of those that never change the program: logging, debugging, limits on how
# often Dynamo recompiles, where caches live (beyond each module's own ignore lists).
_NOT_PROGRAM = ("verbose", "log_", "print_", "repro_", "debug_", "report_", "cache_size_limit",
                "recompile_limit", "accumulated_", "suppress_errors", "compile_threads",
                "worker_start_method", "trace.", "fx_graph_cache", "fx_graph_remote_cache",
                "autotune_local_cache", "autotune_remote_cache", "enable_autograd_cache",
                "enable_remote_autograd_cache", "cache_key_tag", "force_disable_caches")


def _is_pass(name: str) -> bool:
    """A custom pass setting (torch's ignore lists hold them: its cache keys them apart)."""
    return "custom_p" in name


def _user_override(entry: Any, unset: object) -> Any:
    """What the process set a config entry to, or ``unset``.

    torch 2.12 and later keep each override in a ``ContextVar`` (per thread and context);
    2.11 keeps the value itself on the entry."""
    if versions.at_least(2, 12):
        override = getattr(entry, "user_override", None)
        return override.get() if override is not None else unset
    return getattr(entry, "user_override", unset)


def compiler_config_changes() -> dict[str, dict[str, Any]]:
    """Per config module, the settings this process changed from what the module starts
    with (its defaults, with the environment's ``TORCHINDUCTOR_*`` overrides, which the
    backend keys on their own), minus those that never change the program; raw values.

    A module never imported was never changed: it holds its defaults, so the warm path
    reads ``sys.modules`` and imports nothing (a serving process never imports Inductor).
    Custom passes set globally (``post_grad_custom_post_pass``) are settings like any
    other here; torch's cache keys them by their uuid, the caller by their code."""
    unset = getattr(sys.modules.get("torch.utils._config_module"), "_UNSET_SENTINEL", None)
    out: dict[str, dict[str, Any]] = {}
    for modname in COMPILER_CONFIGS:
        mod = sys.modules.get(modname)
        entries = getattr(mod, "_config", None)
        if mod is None or unset is None or not isinstance(entries, dict):
            continue
        ignored = {n for n in getattr(mod, "_save_config_ignore", ()) if not _is_pass(n)}
        prefixes = (*(p for p in getattr(mod, "_cache_config_ignore_prefix", ())
                      if not _is_pass(p)), *_NOT_PROGRAM, "_")
        changed: dict[str, Any] = {}
        for name, e in entries.items():
            value = _user_override(e, unset)
            if (value is unset or name in ignored or name.startswith(prefixes)
                    or getattr(e, "alias", None) is not None):
                continue
            force = getattr(e, "env_value_force", unset)
            if force is not unset:
                continue                  # the environment wins over the override
            start = getattr(e, "env_value_default", unset)
            if value != (e.default if start is unset else start):
                changed[name] = value
        if changed:
            out[modname] = changed
    return out


# -- objects Dynamo bakes into bytecode or guards ----------------------------------------
def from_numpy(value: Any) -> Any:
    """Dynamo's guard helper ``___from_numpy``: a numpy array or scalar as the tensor
    Dynamo traced it as (``torch.as_tensor``), anything else as it is, so that a tensor
    guard on a numpy value (``np.lcm(...) % k`` on Python's stack at a break) checks it.
    numpy is never imported here: a value cannot be numpy's unless numpy is loaded."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, (np.generic, np.ndarray)):
        return torch.as_tensor(value)
    return value


def as_tensor_fullprec(value: Any) -> Any:
    """``torch._as_tensor_fullprec``: the Python number as a 0-d float64 / int64 tensor on
    the CPU, one per number object. Replayed bytecode calls it on every call for each float
    Dynamo traced as a symbol under ``dynamic=True`` (a norm's eps, a scale: the graph takes
    it as a tensor), and a shape guard's ``___as_tensor(x)`` on 2.11 and 2.12. torch makes
    a new tensor each time (2.6 us here; five per call of the demo decoder). The same object
    gets the same tensor while it lives (held here, so its id is not reused) and while no
    one has written to the tensor (its version counter): the graph only reads it."""
    held = _FULLPREC.get(id(value))
    if held is not None and held[0] is value and held[1]._version == held[2]:
        return held[1]
    return _new_fullprec(value)


_FULLPREC: dict[int, tuple[Any, Any, int]] = {}
_FULLPREC_MAX = 4096


def _new_fullprec(value: Any) -> Any:
    if type(value) is not float and type(value) is not int:
        return torch._as_tensor_fullprec(value)
    # Outside inference mode: a tensor with a version counter, that serves calls in and
    # out of inference mode alike (an inference tensor has none).
    with torch.inference_mode(False):
        t = torch._as_tensor_fullprec(value)
    if len(_FULLPREC) >= _FULLPREC_MAX:
        _FULLPREC.clear()
    _FULLPREC[id(value)] = (value, t, t._version)
    return t


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


# -- Dynamo's marks on input tensors ------------------------------------------------------
# torch._dynamo.mark_dynamic / maybe_mark_dynamic / mark_static / mark_unbacked /
# mark_static_address store what they mark as attributes of the tensor, which Dynamo reads
# when it traces (torch/_dynamo/decorators.py). Setting one never imports Dynamo, and
# reading them does not either. (attribute, label) in the order they are reported.
_MARKS: tuple[tuple[str, str], ...] = (
    ("_dynamo_dynamic_indices", "dynamic"),
    ("_dynamo_dynamic_range", "range"),
    ("_dynamo_weak_dynamic_indices", "maybe_dynamic"),
    ("_dynamo_unbacked_indices", "unbacked"),
    ("_dynamo_strict_unbacked_indices", "strict_unbacked"),
    ("_dynamo_unbacked_bounds", "unbacked_bounds"),
    ("_dynamo_hint_overrides", "hints"),
    ("_dynamo_static_indices", "static"),
    ("_dynamo_static_input_type", "static_address"),
    # Not Dynamo's: TorchAir's set_dim_gears stores its gears here (beside mark_dynamic),
    # and a GE program is built for exactly those gears, so they are part of the signature.
    ("dim_gears", "gears"),
)
# Marks that make a dim dynamic (Dynamo: mark_dynamic wins over mark_static).
_WEAK = "_dynamo_weak_dynamic_indices"      # torch._dynamo.decorators.maybe_mark_dynamic
_HAS_MARKS = "_has_dynamo_dim_marking"        # ... and what it sets beside it (2.6 on)
DYNAMIC_MARKS = ("dynamic", "maybe_dynamic", "unbacked", "strict_unbacked")


def _mark_value(v: Any) -> Any:
    if isinstance(v, (set, frozenset, list, tuple)):
        return tuple(sorted((_mark_value(x) for x in v), key=repr))
    if isinstance(v, dict):
        return tuple(sorted(((k, _mark_value(x)) for k, x in v.items()), key=repr))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        # _DimRange(dim, min, max)
        return tuple(_mark_value(getattr(v, f.name)) for f in dataclasses.fields(v))
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def dim_marks(t: Any) -> tuple[tuple[str, Any], ...] | None:
    """The Dynamo marks on tensor ``t`` as ``((label, value), ...)``; None if it has none.

    Cheap on an unmarked tensor (one look at its ``__dict__``): it runs on every call.
    """
    d = t.__dict__
    if not d:
        return None
    out = tuple((label, _mark_value(d[attr])) for attr, label in _MARKS if d.get(attr))
    return out or None


def mark_maybe_dynamic(t: Any, dims: tuple[int, ...]) -> Callable[[], None]:
    """``torch._dynamo.maybe_mark_dynamic`` of ``dims`` on ``t``, written as Dynamo writes
    it (without importing Dynamo); what restores ``t``'s marks as they were."""
    d = t.__dict__
    before = {a: d[a] for a in (_WEAK, _HAS_MARKS) if a in d}
    setattr(t, _WEAK, set(before.get(_WEAK, ())) | set(dims))
    setattr(t, _HAS_MARKS, True)

    def restore() -> None:
        for a in (_WEAK, _HAS_MARKS):
            if a in before:
                setattr(t, a, before[a])
            else:
                t.__dict__.pop(a, None)

    return restore


# -- a training graph's run (cachecompile.backends.joint) --------------------------------
def autocast_off() -> Any:
    """A context with autocast off on every device: AOTAutograd runs a program traced
    under autocast so (the casts are in the program)."""
    return torch._C._DisableAutocast()


def keeps_graph() -> bool:
    """Whether the backward running now keeps its graph (``retain_graph=True``)."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def is_view(t: torch.Tensor) -> bool:
    return bool(t._is_view())


# -- what this process has imported ------------------------------------------------------
def dynamo_imported() -> bool:
    """Whether Dynamo was imported (a warm process never imports it)."""
    return "torch._dynamo" in sys.modules



def compiled_by_dynamo(obj: Any) -> Any | None:
    """What ``torch.compile`` was given, if ``obj`` is what it returned for a function or
    method (Dynamo's wrapper keeps the original as ``_torchdynamo_orig_callable``), or a
    method bound to what it returned for a module; else None. Read as attributes, without
    importing Dynamo. ``torch.compiler.disable``'s wrapper keeps the original the same
    way; it is not one."""
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    if not callable(obj) or getattr(obj, "_torchdynamo_disable", False):
        return None
    return getattr(obj, "_torchdynamo_orig_callable", None)
