"""Portable identities: what a function, class or value *is*, across processes.

Dynamo guards functions, classes and modules by ``id()``, which means nothing in another
process. cachecompile names them by a qualified name plus a digest of their code
(bytecode, names, constants, recursively), with closure cells, defaults and partial
arguments as values. The key (``factors``, ``passes``) hashes them; the entry's guards
(``entry.guards``) compare them on the warm path.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import importlib
import sys
import types
from typing import Any

import torch
import xxhash

from cachecompile._torch import runtime
from cachecompile.store.jsonvalue import JSON

_code_digests: dict[int, tuple[types.CodeType, str]] = {}


def code_digest(code: types.CodeType) -> str:
    """Bytecode, names and constants, recursively; memoised per code object."""
    hit = _code_digests.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    h = xxhash.xxh3_128()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            else:
                h.update(_const_token(const).encode())

    feed(code)
    digest = h.hexdigest()
    _code_digests[id(code)] = (code, digest)
    return digest


_PLAIN_CONSTS = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis))


def _const_token(v: Any) -> str:
    """A constant as code sees it; objects (in generated code) by type, never by address."""
    if isinstance(v, _PLAIN_CONSTS):
        return repr(v)
    if isinstance(v, (tuple, frozenset)):
        items = sorted(v, key=repr) if isinstance(v, frozenset) else v
        return f"{type(v).__name__}(" + ",".join(_const_token(x) for x in items) + ")"
    return f"<{type(v).__module__}.{type(v).__qualname__}>"


def qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', None)}"


def import_attr(module: str, path: str) -> Any:
    """The object at ``module``'s dotted attribute ``path`` (``"torch.nn.functional",
    "gelu"``; ``"pkg.mod", "Cls.ADAPTER"``): ImportError or AttributeError if none."""
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# Classes from these packages are pinned by the torch and Python version factors.
_VERSIONED_PACKAGES = frozenset({"torch", "builtins", "collections", "functools", "types",
                                 "typing", "enum", "abc", "dataclasses", "_abc", "re"})
_class_digests: dict[int, tuple[type, str | None]] = {}


def pinned_by_version(module: str | None) -> bool:
    """Whether code of the module named ``module`` is pinned by the torch and Python
    version factors (torch's, a few standard library packages'), not the user's."""
    return _top(module) in _VERSIONED_PACKAGES


def class_digest(cls: type) -> str | None:
    """The code of a user class's methods (its own and inherited from user classes).

    Dynamo matches a class by ``id``, which in one process also pins its methods; across
    processes the same name may hold other code (an edited file, a method patched at
    import). A class whose package is pinned by a version factor (torch's, the standard
    library's) counts only the methods patched into it from outside (``nn.LayerNorm.forward
    = my_forward``, as kernel-patching libraries do); None if it has none.
    """
    hit = _class_digests.get(id(cls))
    if hit is not None and hit[0] is cls:
        return hit[1]
    h = xxhash.xxh3_128()
    n = 0
    for klass in cls.__mro__:
        pinned = _top(klass.__module__) in _VERSIONED_PACKAGES
        if not pinned:
            h.update(qualified_name(klass).encode())
        for name, value in sorted(vars(klass).items(), key=lambda kv: kv[0]):
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            fn = fn.fget if isinstance(fn, property) else fn
            if pinned:
                if not isinstance(getattr(fn, "__code__", None), types.CodeType) or \
                        _top(getattr(fn, "__module__", None)) in _VERSIONED_PACKAGES:
                    continue
                h.update(f"{qualified_name(klass)}.{name}@{qualified_name(fn)}".encode())
            # A decorated method (functools.wraps): the wrapper's code and what it wraps.
            for depth in range(8):
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType):
                    h.update(f"{name}:{depth}:{code_digest(code)};".encode())
                    n += 1
                fn = getattr(fn, "__wrapped__", None)
                if fn is None:
                    break
    digest = h.hexdigest() if n else None
    _class_digests[id(cls)] = (cls, digest)
    return digest


def _top(module: str | None) -> str:
    return (module or "").split(".")[0]


def type_value(cls: type) -> JSON:
    """What a type guard compares: the class's name and, for user classes, its code."""
    return {"qual": qualified_name(cls), "code": class_digest(cls)}


def value_token(v: Any, depth: int = 0, unknown: list[str] | None = None) -> str:
    """A process-independent token for a closure cell, default or partial argument.

    An object with no identity is keyed by its type alone; ``unknown`` collects the
    names of such types, for callers that must refuse them (custom passes).
    """
    if depth > 4:
        return "..."
    if v is None or isinstance(v, (bool, int, float, str, bytes, complex)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, (tuple, list, frozenset, set)):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return (f"{type(v).__name__}("
                + ",".join(value_token(x, depth + 1, unknown) for x in items) + ")")
    if isinstance(v, dict):
        return "dict(" + ",".join(f"{k!r}:{value_token(x, depth + 1, unknown)}"
                                  for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))) + ")"
    if isinstance(v, torch.Tensor):
        # Values are read live (Dynamo guards a closure tensor by TENSOR_MATCH on its own).
        return f"tensor:{v.dtype}{list(v.shape)}@{v.device}"
    ident = identity(v, depth + 1, unknown)
    if ident is not None:
        return ident
    if unknown is not None:
        unknown.append(qualified_name(type(v)))
    return f"object:{qualified_name(type(v))}"


def identity(obj: Any, depth: int = 0, unknown: list[str] | None = None, *,  # noqa: C901 (today's exception: one branch per kind of object Dynamo matches by id)
             matched: bool = False) -> str | None:
    """A process-independent identity for what Dynamo matches by ``id``; None if none.

    ``unknown`` (optional) collects the types of values inside it (closure cells,
    defaults, partial arguments) that have no identity and are keyed by type only.
    ``matched``: the object an identity guard matches itself, which may also be named by
    the module global that binds it (:func:`global_name`): Dynamo guards what the traced
    code reads of it on its own. Never inside a closure, default or partial argument (a
    key's token), where nothing would guard such an object's state.
    """
    if obj is None or obj is True or obj is False or obj is Ellipsis or obj is NotImplemented:
        return repr(obj)
    if isinstance(obj, types.ModuleType):
        return f"module:{obj.__name__}"
    if isinstance(obj, types.CodeType):
        return f"code:{obj.co_name}:{code_digest(obj)}"
    if isinstance(obj, type):
        code = class_digest(obj)
        return f"class:{qualified_name(obj)}" + (f":{code}" if code else "")
    if isinstance(obj, types.FunctionType):
        cells = tuple(value_token(c.cell_contents, depth, unknown) if _cell_full(c) else "<empty>"
                      for c in (obj.__closure__ or ()))
        return (f"function:{qualified_name(obj)}:{code_digest(obj.__code__)}"
                f":{value_token(obj.__defaults__, depth, unknown)}"
                f":{value_token(obj.__kwdefaults__, depth, unknown)}"
                f":{','.join(cells)}")
    if isinstance(obj, types.MethodType):
        bound = identity(obj.__self__, depth + 1, unknown)
        if bound is None:
            bound = f"object:{qualified_name(type(obj.__self__))}"
            if unknown is not None:
                unknown.append(qualified_name(type(obj.__self__)))
        return f"method:{identity(obj.__func__, depth + 1, unknown)}@{bound}"
    if isinstance(obj, types.BuiltinFunctionType):
        holder = obj.__self__
        if holder is None or isinstance(holder, types.ModuleType):
            return f"builtin:{getattr(obj, '__module__', None)}.{obj.__qualname__}"
        return (f"builtin:{obj.__qualname__}@"
                f"{identity(holder, depth + 1) or qualified_name(type(holder))}")
    if isinstance(obj, functools.partial):
        return (f"partial:{identity(obj.func, depth + 1, unknown)}"
                f":{value_token(obj.args, depth, unknown)}"
                f":{value_token(obj.keywords, depth, unknown)}")
    if isinstance(obj, enum.Enum):
        return f"enum:{qualified_name(type(obj))}.{obj.name}"
    if isinstance(obj, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"torch:{obj!r}"
    if isinstance(obj, (types.MethodWrapperType, types.WrapperDescriptorType,
                        types.MethodDescriptorType, types.ClassMethodDescriptorType,
                        types.GetSetDescriptorType, types.MemberDescriptorType)):
        objclass = getattr(obj, "__objclass__", None) or type(getattr(obj, "__self__", None))
        return f"descriptor:{qualified_name(objclass)}.{getattr(obj, '__name__', '?')}"
    if runtime.is_operator(obj):
        # OpOverload / OpOverloadPacket / HigherOrderOperator: named by the registry.
        return f"op:{type(obj).__name__}:{obj}"
    if type(obj).__name__ == "ProcessGroup" and hasattr(obj, "group_name"):
        # A collective's group: the compiled graph refers to it by name, so a process
        # group of the same name, size and rank is the same group to the program.
        return f"process_group:{obj.group_name}:{obj.rank()}/{obj.size()}"
    if isinstance(obj, contextvars.ContextVar):
        # Reached by a path the guard names (torch 2.15's config overrides hold one per
        # option, created at import): the same name there is the same variable. Its value
        # is guarded on its own.
        return f"contextvar:{obj.name}"
    if isinstance(obj, (staticmethod, classmethod)):
        return f"{type(obj).__name__}:{identity(obj.__func__, depth + 1, unknown)}"
    if isinstance(obj, property):
        return f"property:{identity(obj.fget, depth + 1, unknown)}"
    named = importable_name(obj) or (global_name(obj) if matched else None)
    return f"named:{named}" if named is not None else None


def importable_name(obj: Any) -> str | None:
    """``module.name`` for a callable no kind above knows (a numpy ufunc, a C extension's
    callable object) that is that module's attribute of that name in this process: a
    fresh process that imports the module finds the same object there. None otherwise."""
    if not callable(obj):
        return None
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not isinstance(module, str) or not isinstance(name, str) or "<" in name:
        return None
    try:
        found = import_attr(module, name)
    except Exception:  # not reachable by its name: no portable form
        return None
    return f"{module}.{name}" if found is obj else None


def global_name(obj: Any) -> str | None:
    """``module.name`` for a callable object without a name of its own that its module
    (``__module__``, already imported) binds at top level: a library's decorator that
    turns a function into an instance of a class made inside the decorator (transformers
    5.25's ``apply_rotary_pos_emb``, a ``kernels`` hub ``Func`` module), which a fresh
    process that imports the module binds there again. Only under one name: a module that
    binds it twice (an alias, or a global rebound to another such object) could bind
    another object under the name it had, which the name alone would not tell. None
    otherwise, and for a module we cannot read."""
    if not callable(obj):
        return None
    try:
        module = obj.__module__
        namespace = vars(sys.modules[module])
        names = sorted(k for k, v in list(namespace.items())
                       if v is obj and isinstance(k, str) and k.isidentifier())
    except Exception:  # not imported, or a namespace that is not a module's
        return None
    return f"{module}.{names[0]}" if len(names) == 1 else None


def _cell_full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - probing an empty cell raises
    except ValueError:
        return False
    return True


def model_label(module: Any) -> str:
    """What ``cachectl ls`` shows as an entry's model (its ``model`` label): the module's
    class, or what the class says it is (``cachecompile_label``: a plain function's holder
    names the function's Python module)."""
    own = getattr(type(module), "cachecompile_label", None)
    return own(module) if callable(own) else type(module).__qualname__
