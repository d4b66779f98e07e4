"""Custom Inductor passes, keyed by what they do; the custom operators a program calls.

Inductor runs user passes from its config (``post_grad_custom_post_pass`` and the other
hooks in :data:`PASS_HOOKS`). What a pass does decides the program, so each pass is part
of the key, identified by what it does:

* a ``CustomGraphPass`` (anything with a ``uuid()``): its class and ``uuid()``, the
  identity Inductor's own FX graph cache uses. ``uuid()`` returning None means "do not
  cache me" to Inductor; here the pass is refused;
* a ``PatternMatcherPass`` (or its bound ``apply``): every rule it holds, in order, each
  by its pattern and the code of the user's functions behind it (``register_replacement``'s
  search and replacement functions and extra check, a handler), with their closures,
  defaults and the plain globals they read as values;
* a function (or ``functools.partial``): its code, closure, defaults and the globals it
  reads (plain values; pattern passes and functions by identity);
* a callable object of a user class: the code of its class and its attributes' values.

Anything else, and any of the above holding an object with no identity (in a closure, a
default, an attribute), is refused with :class:`UnidentifiedPassError`: a key that said
"some callable" would hand out programs built by another pass.

The program Inductor generates for a fused graph calls the custom operator by name
(``torch.ops.demo.fused_add_rms_norm.default``). :func:`operators_in` lists them for the
entry; :func:`missing_operators` tells a warm process which of them it lacks, so that an
unregistered operator is a miss that names it rather than an AttributeError in a call.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import xxhash

from cachecompile._torch import passes as torch_passes
from cachecompile.errors import ContractError, UnidentifiedPassError
from cachecompile.key import identity
from cachecompile.store.jsonvalue import JSON

logger = logging.getLogger(__name__)


# Inductor's config options that hold user passes (torch._inductor.config), in the order
# Inductor runs them. Each takes one pass or a list of passes.
PASS_HOOKS = ("pre_grad_custom_pass", "joint_custom_pre_pass", "joint_custom_post_pass",
              "post_grad_custom_pre_pass", "post_grad_custom_post_pass")

_PLAIN = (bool, int, float, str, bytes, type(None))
_MAX_GLOBAL_DEPTH = 3
# Code in these packages is pinned by the torch and Python version factors.
_VERSIONED = ("torch", "functorch", "builtins")


def _digest(text: str) -> str:
    return xxhash.xxh3_128_hexdigest(text.encode())


def _qual(obj: Any) -> str:
    return identity.qualified_name(obj)


# -- cache_compile(config=..., passes=...) --------------------------------------------------
def merge(options: Mapping[str, Any], passes: Any) -> dict[str, Any]:
    """The Inductor options with ``passes={hook: pass}`` merged in (checked, not identified)."""
    out = dict(options)
    if passes is None:
        return out
    if not isinstance(passes, Mapping):
        raise ContractError("cache_compile(): passes must be a dict {hook: pass}, hooks being "
                            f"{', '.join(PASS_HOOKS)}; got {type(passes).__qualname__}")
    for hook, p in passes.items():
        if hook not in PASS_HOOKS:
            raise ContractError(f"cache_compile(): unknown pass hook {hook!r}; Inductor's are "
                                f"{', '.join(PASS_HOOKS)}")
        if out.get(hook) is not None and out[hook] is not p:
            raise ContractError(f"cache_compile(): {hook} is given both in config and in "
                                "passes; give it once")
        out[hook] = p
    return out


def check(options: Mapping[str, Any]) -> None:
    """Refuse, now, any pass in ``options`` that cannot be identified."""
    for hook in PASS_HOOKS:
        if options.get(hook) is not None:
            identify(options[hook], f"config[{hook!r}]")


def is_pass(obj: Any) -> bool:
    """A pass object that is not itself callable (a PatternMatcherPass)."""
    return torch_passes.is_pattern_pass(obj)


# -- identity ------------------------------------------------------------------------------
def identify(obj: Any, what: str = "a custom pass") -> JSON:
    """What ``obj`` does, as JSON for the key; UnidentifiedPassError if that cannot be told."""
    if isinstance(obj, (list, tuple)):
        return [identify(x, f"{what}[{i}]") for i, x in enumerate(obj)]
    if torch_passes.is_pattern_pass(obj):
        return _pattern_pass(obj, what)
    if isinstance(obj, types.MethodType):
        owner = obj.__self__
        name = obj.__func__.__name__
        if torch_passes.is_pattern_pass(owner):
            return {"method": name, "of": _pattern_pass(owner, what)}
        if _has_uuid(owner):
            return {"method": name, "of": _uuid_pass(owner, what)}
        return {"method": _function(obj.__func__, what), "self": _object(owner, what)}
    if _has_uuid(obj):
        return _uuid_pass(obj, what)
    if isinstance(obj, (types.FunctionType, functools.partial, types.BuiltinFunctionType)):
        return _function(obj, what)
    if callable(obj) and not isinstance(obj, type):
        return _object(obj, what)
    raise UnidentifiedPassError(
        f"{what} is {_qual(type(obj))}, which cachecompile cannot key by what it does. "
        "Pass a function, a PatternMatcherPass (or its .apply), or a CustomGraphPass "
        "with a uuid() that changes when the pass changes")


def _has_uuid(obj: Any) -> bool:
    return (not isinstance(obj, (type, types.ModuleType, types.FunctionType))
            and callable(getattr(obj, "uuid", None)))


def _uuid_pass(p: Any, what: str) -> JSON:
    try:
        uid = p.uuid()
    except Exception as e:  # the user's uuid() failing is a refusal, said so
        raise UnidentifiedPassError(f"{what}: {_qual(type(p))}.uuid() raised "
                                    f"{type(e).__name__}: {e}") from None
    if uid is None:
        raise UnidentifiedPassError(
            f"{what}: {_qual(type(p))}.uuid() returned None, which tells Inductor not to cache "
            "its programs; return an id that changes with the pass, e.g. "
            "torch._inductor.custom_graph_pass.get_hash_for_files((__file__,))")
    return {"class": _qual(type(p)), "uuid": _uuid_json(uid, what)}


def _uuid_json(v: Any, what: str) -> JSON:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (list, tuple)):
        return [_uuid_json(x, what) for x in v]
    text = repr(v)
    if " at 0x" in text:
        raise UnidentifiedPassError(f"{what}: uuid() returned {text}, an object identified "
                                    "by its address; return a string or bytes")
    return text


def _refuse_unknown(unknown: list[str], where: str, what: str) -> None:
    if unknown:
        raise UnidentifiedPassError(
            f"{what}: {where} holds {', '.join(sorted(set(unknown)))}, which has no "
            "identity to key it by. Hold plain values, functions or settings objects there"
            + ("" if "backend" in what else ", or make the pass a CustomGraphPass with a "
               "uuid()"))


def _function(fn: Any, what: str, depth: int = 0,
              seen: set[int] | None = None) -> JSON:
    """A function by its code, closure, defaults, and the globals its code reads."""
    unknown: list[str] = []
    ident = identity.identity(fn, 0, unknown)
    name = getattr(fn, "__qualname__", None) or _qual(fn)
    if ident is None:
        raise UnidentifiedPassError(f"{what}: {name} ({_qual(type(fn))}) has no code to key")
    _refuse_unknown(unknown, name, what)
    out: dict[str, JSON] = {"function": name, "code": _digest(ident)}
    target = fn.func if isinstance(fn, functools.partial) else fn
    if isinstance(target, types.FunctionType) and depth < _MAX_GLOBAL_DEPTH:
        seen = set() if seen is None else seen
        seen.add(id(target))
        reads = _globals(target, what, depth, seen)
        if reads:
            out["globals"] = reads
    return out


def _code_names(code: types.CodeType) -> Iterable[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _versioned(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in _VERSIONED


def _globals(fn: types.FunctionType, what: str, depth: int, seen: set[int]) -> dict[str, JSON]:
    """The module globals ``fn`` reads whose value changes what it does: plain values,
    user functions and passes (modules and classes are keyed elsewhere or by version)."""
    g = fn.__globals__
    out: dict[str, JSON] = {}
    for name in sorted(set(_code_names(fn.__code__))):
        if name not in g:
            continue
        v = g[name]
        if isinstance(v, types.ModuleType):
            if _user_module(v):
                # A helper module the code calls into (helpers.apply(graph)): its source.
                out[name] = {"module": v.__name__, "source": _module_source(v)}
            continue
        if isinstance(v, type):
            continue
        if isinstance(v, _PLAIN) or isinstance(v, (tuple, frozenset)) and all(
                isinstance(x, _PLAIN) for x in v):
            out[name] = repr(v)
        elif isinstance(v, (dict, list, set, tuple)):
            # A settings dict or a list of switches, read as values.
            unknown: list[str] = []
            out[name] = identity.value_token(v, 0, unknown)
            _refuse_unknown(unknown, f"global {name}", what)
        elif torch_passes.is_pattern_pass(v) or _has_uuid(v):
            out[name] = identify(v, f"{what} (global {name})")
        elif isinstance(v, types.FunctionType) and not _versioned(v) and id(v) not in seen:
            out[name] = _function(v, f"{what} (global {name})", depth + 1, seen)
        elif _config_object(v):
            # A settings object the code reads (MindIE SD's CompilationConfig, a vendor's
            # fusion switches): what it holds decides what the code does.
            out[name] = _settings(v, f"{what} (global {name})")
    return out


def _user_module(m: types.ModuleType) -> bool:
    root = m.__name__.split(".")[0]
    return (getattr(m, "__file__", None) is not None and root not in sys.stdlib_module_names
            and root not in _VERSIONED and not _installed(m))


def _installed(m: types.ModuleType) -> bool:
    """A module from site-packages: a third-party library, not the user's own code (its
    version pins it as well as its code would; hashing it on every key would be slow)."""
    f = str(getattr(m, "__file__", "") or "")
    return "site-packages" in f or "dist-packages" in f


def _module_source(m: types.ModuleType) -> str:
    try:
        with open(str(m.__file__), "rb") as f:
            return xxhash.xxh3_128_hexdigest(f.read())
    except OSError:
        return "unreadable"


def _config_object(v: Any) -> bool:
    """An instance of a user class that is not itself callable: settings, read as values."""
    root = (getattr(type(v), "__module__", None) or "").split(".")[0]
    return (hasattr(v, "__dict__") and not callable(v)
            and not isinstance(v, (types.ModuleType, type))
            and root not in sys.stdlib_module_names and root not in _VERSIONED)


def _settings(v: Any, what: str, depth: int = 0) -> JSON:
    """A settings object's public attributes (its class's defaults too) as values; nested
    settings objects likewise. One that holds something with no identity is refused."""
    if depth > _MAX_GLOBAL_DEPTH:
        raise UnidentifiedPassError(f"{what} nests settings objects too deeply to key")
    attrs: dict[str, JSON] = {}
    unknown: list[str] = []
    for k in sorted(dir(v)):
        if k.startswith("_"):
            continue
        x = getattr(v, k, None)
        if _config_object(x):
            attrs[k] = _settings(x, f"{what}.{k}", depth + 1)
        elif not callable(x):
            attrs[k] = identity.value_token(x, 0, unknown)
    _refuse_unknown(unknown, f"an attribute of {_qual(type(v))}", what)
    return {"settings": _qual(type(v)), "attrs": attrs}


def _object(obj: Any, what: str) -> JSON:
    """A callable of a user class: its class's code and its attributes as values."""
    cls = type(obj)
    code = identity.class_digest(cls)
    if code is None and (getattr(cls, "__module__", "") or "").split(".")[0] in (
            "torch", "functorch"):
        # torch's own callable classes (aot_autograd's AotAutograd): the torch version
        # pins their code; what they hold (fw_compiler...) is keyed below.
        code = f"versioned:{_qual(cls)}"
    if code is None:
        raise UnidentifiedPassError(
            f"{what} is {_qual(cls)}, a callable with no code of its own to key it by; pass a "
            "function, a PatternMatcherPass, or a CustomGraphPass with a uuid()")
    state = getattr(obj, "__dict__", None) or {}
    unknown: list[str] = []
    values = {k: identity.value_token(v, 0, unknown) for k, v in sorted(state.items())}
    _refuse_unknown(unknown, f"an attribute of {_qual(cls)}", what)
    return {"class": _qual(cls), "code": code, "state": _digest(repr(sorted(values.items())))}


def _plain_value(v: Any) -> JSON:
    if isinstance(v, _PLAIN):
        return v if not isinstance(v, bytes) else v.hex()
    if isinstance(v, Mapping):
        return {str(k): _plain_value(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (list, tuple, set, frozenset)):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return [_plain_value(x) for x in items]
    ident = identity.identity(v)
    return ident if ident is not None else _qual(type(v))


def _pattern_pass(p: Any, what: str) -> JSON:
    rules: list[JSON] = []
    for i, rule in enumerate(torch_passes.pattern_rules(p)):
        where = f"{what}, rule {i} ({rule.kind} on {rule.target})"
        rules.append({
            "kind": rule.kind,
            "target": rule.target,
            "pattern": _digest(rule.pattern),
            "functions": {k: _function(f, where) for k, f in sorted(rule.functions.items())},
            "values": {k: _plain_value(v) for k, v in sorted(rule.values.items())},
            "opaque": {k: _digest(identity.identity(v) or _qual(type(v)))
                       for k, v in sorted(rule.opaque.items())},
        })
    return {"pattern_pass": _plain_value(torch_passes.pass_settings(p)), "rules": rules}


# -- custom operators in a program --------------------------------------------------------
_OP_RE = re.compile(r"\btorch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)")
# Always there: the namespace every program calls; checking each op costs a lookup.
_CORE = frozenset({"aten"})


def operators_in(source: str) -> list[str]:
    """The operators (``ns::name``) a program's source calls through ``torch.ops``, but
    ATen's: the names a warm process must have registered before the program can run."""
    found = {f"{ns}::{name}" for ns, name in _OP_RE.findall(source) if ns not in _CORE}
    return sorted(found)


def namespaces(operators: Iterable[str]) -> list[str]:
    return sorted({op.split("::", 1)[0] for op in operators})


def missing_operators(operators: Iterable[str]) -> list[str]:
    """The operators of ``operators`` (``ns::name``) not registered in this process."""
    missing: list[str] = []
    for op in operators:
        ns, _, name = str(op).partition("::")
        try:
            getattr(getattr(torch.ops, ns), name)
        except (AttributeError, RuntimeError):
            missing.append(str(op))
    return missing
