"""The forms ``cache_compile`` takes besides a bound method, each reduced to one.

torch.compile is applied to a module, a function, or used as a decorator; TorchAir's
``cache_compile`` takes a bound method. Every form here ends as a bound method of an
``nn.Module`` handed to the one cached path (``api.cache_compile`` builds it), so guards,
keys, ranks, gears, prebuilding and ``cachectl`` labels are the method's:

* :class:`CachedModule`: ``cache_compile(module)``, the module with its ``forward`` cached,
  forwarding attributes and ``state_dict`` as torch's ``OptimizedModule`` does;
* :class:`CachedMethod`: ``@cache_compile`` on ``def forward(self, ...)`` in a class body
  (or on a whole ``nn.Module`` class), a descriptor that caches per instance on first access;
* :func:`function_method`: a plain function, as the method of a stateless holder module
  whose code reads the function's own module globals (so Dynamo guards what the function
  reads exactly as it does for a method defined in that module).

``make`` callables come from ``api`` (a floor up): this module only shapes the forms.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from cachecompile.errors import ContractError, UncachedCallWarning, user_stacklevel

# A bound method -> its cached form; the module form also passes the instance forward a
# method calls (forward_method), which is keyed by what it is.
MakeCached = Callable[..., Any]


def is_optimized_module(obj: Any) -> bool:
    """torch.compile(module)'s wrapper (Dynamo's ``OptimizedModule``), recognised by its
    class name and its ``_orig_mod``: importing Dynamo to check would cost a warm process
    seconds."""
    return (isinstance(obj, torch.nn.Module)
            and any(k.__name__ == "OptimizedModule" for k in type(obj).__mro__)
            and "_orig_mod" in obj._modules)


class CachedModule(torch.nn.Module):
    """``cache_compile(module)``: the module, with its ``forward`` cached.

    Like torch's ``OptimizedModule``: the original is the submodule ``_orig_mod``; other
    attributes are read from it; ``state_dict`` and ``load_state_dict`` are the original's
    (without the ``_orig_mod.`` prefix torch adds). Calling it runs the wrapper's own
    hooks, then the original's ``forward`` *as it is at that call*, cached: torch.compile(module)
    compiles ``module.__call__``, which reads ``forward`` on every call, so a ``forward``
    replaced on the instance after wrapping (accelerate's ``add_hook_to_module``, a hand
    patch) is what runs, and removing it brings the class's back. Each forward followed
    is cached under its own code (:meth:`_cached_for`).
    """

    # How many replaced forwards are kept cached at once (a hook added and removed in a
    # loop makes a new forward object each time).
    FOLLOWED = 8

    def __init__(self, module: torch.nn.Module, make: MakeCached) -> None:
        super().__init__()
        self._orig_mod = module
        # Not modules: kept out of nn.Module's registries (and out of state_dict).
        self.__dict__["_make"] = make
        cls_forward: Any = getattr(type(module), "forward", None)
        self.__dict__["_class_forward"] = cls_forward
        # The class's forward, cached now (a wrong argument is refused at wrapping).
        self.__dict__["_class_cached"] = make(types.MethodType(cls_forward, module))
        # Forwards followed since, latest last: (the forward object, its cached form).
        self.__dict__["_followed"] = []
        self.__dict__["_lock"] = threading.Lock()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        orig = self._modules["_orig_mod"]
        if orig._forward_hooks or orig._forward_pre_hooks:  # type: ignore[union-attr]
            raise ContractError(
                f"cache_compile({type(orig).__qualname__}) caches its forward, and the "
                "original module has forward hooks, which the cached forward would skip. "
                "Register them on the module cache_compile returned instead")
        d = self.__dict__
        if "forward" not in orig.__dict__ and type(orig).forward is d["_class_forward"]:  # type: ignore[union-attr]
            return d["_class_cached"](*args, **kwargs)
        return self._cached_for(orig)(*args, **kwargs)

    def _cached_for(self, orig: Any) -> Any:
        """The cached form of ``orig``'s forward now: an instance forward that is a method
        of a module is cached as that method (its code, its key); any other callable
        (accelerate's ``functools.partial(new_forward, module)``, a closure) as a method
        that calls ``self.forward``, keyed by what the callable is (Dynamo guards what it
        reads through it). A class forward patched after wrapping is a method too."""
        d = self.__dict__
        fwd = orig.forward
        if (type(fwd) is types.MethodType and fwd.__self__ is orig
                and fwd.__func__ is d["_class_forward"]):
            return d["_class_cached"]
        with d["_lock"]:
            followed: list[tuple[Any, Any]] = d["_followed"]
            for i, (known, cached) in enumerate(followed):
                if known is fwd or (type(fwd) is types.MethodType and fwd == known):
                    followed.append(followed.pop(i))
                    return cached
            if (type(fwd) is types.MethodType and isinstance(fwd.__self__, torch.nn.Module)
                    and isinstance(fwd.__func__, types.FunctionType)):
                cached = d["_make"](fwd)
            else:
                cached = d["_make"](forward_method(orig, fwd), fwd)
            followed.append((fwd, cached))
            del followed[:-self.FOLLOWED]
            return cached

    @property
    def cached_forward(self) -> Any:
        """The cached form of the forward a call would run now."""
        orig: Any = self._modules["_orig_mod"]
        d = self.__dict__
        if "forward" not in orig.__dict__ and type(orig).forward is d["_class_forward"]:
            return d["_class_cached"]
        return self._cached_for(orig)

    def __getattr__(self, name: str) -> Any:
        modules = self.__dict__.get("_modules")
        if modules is None or "_orig_mod" not in modules:
            raise AttributeError(name)
        if name == "_orig_mod":
            return modules["_orig_mod"]
        if name == "generate" and not self.__dict__.get("_generate_warned"):
            self.__dict__["_generate_warned"] = True
            self._warn_generate(modules["_orig_mod"])
        return getattr(modules["_orig_mod"], name)

    @staticmethod
    def _warn_generate(orig: torch.nn.Module) -> None:
        """``model = cache_compile(model)`` then ``model.generate()``: generate is the
        original's method and calls the original's forward, not this wrapper (as with
        torch.compile(model)). Said once, when ``generate`` is first read."""
        if not callable(getattr(type(orig), "generate", None)):
            return
        name = type(orig).__qualname__
        warnings.warn(
            f"cache_compile({name}) caches calls of the module it returned; "
            f"{name}.generate() calls the original module's forward, which runs uncompiled "
            "and uncached (as it does after torch.compile(model)). To cache what generate "
            "calls, cache the forward in place: model.forward = cache_compile(model.forward), "
            "then call model.generate(...)", UncachedCallWarning, stacklevel=user_stacklevel())

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._modules["_orig_mod"].state_dict(*args, **kwargs)  # type: ignore[union-attr]

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._modules["_orig_mod"].load_state_dict(*args, **kwargs)  # type: ignore[union-attr]

    @property
    def events(self) -> list[tuple[str, str]]:
        """The outcomes of the cached forward a call would run now (``CachedFunction.events``)."""
        events: list[tuple[str, str]] = self.cached_forward.events
        return events

    def __repr__(self) -> str:
        return f"CachedModule({self._modules['_orig_mod']!r})"


def _call_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return self.forward(*args, **kwargs)


def forward_method(module: torch.nn.Module, forward: Any) -> types.MethodType:
    """A method of ``module`` that calls its instance ``forward`` (a callable that is no
    method of a module), named as the module's forward and run in its class's module, so
    that it is cached like the class's forward would be; the callable is read from the
    instance on every call, as ``module.__call__`` reads it."""
    cls = type(module)
    home = sys.modules.get(cls.__module__)
    globals_ = vars(home) if home is not None else _call_forward.__globals__
    fn = types.FunctionType(_call_forward.__code__, globals_, "forward")
    fn.__qualname__ = f"{cls.__qualname__}.forward"
    fn.__module__ = cls.__module__
    fn.__doc__ = getattr(forward, "__doc__", None)
    return types.MethodType(fn, module)


class CachedMethod:
    """``@cache_compile`` on a method in a class body: cached per instance.

    A non-data descriptor: the first access on an instance builds its cached method (the
    bound method through ``make``) and stores it in the instance's ``__dict__`` under the
    method's name, where later lookups find it first (as ``functools.cached_property``).
    ``__wrapped__`` is the function, so the class's code digest (a key factor) still
    covers it.
    """

    def __init__(self, func: types.FunctionType, make: MakeCached) -> None:
        functools.update_wrapper(self, func)
        self.__wrapped__ = func
        self.__qualname__ = func.__qualname__
        self._make = make
        self._name = func.__name__
        self._owner: type | None = None
        self._lock = threading.Lock()

    def __set_name__(self, owner: type, name: str) -> None:
        self._owner = owner
        self._name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        with self._lock:
            cached = instance.__dict__.get(self._name)
            if cached is None:
                if not isinstance(instance, torch.nn.Module):
                    raise ContractError(
                        f"@cache_compile on {self.__qualname__}: {type(instance).__qualname__} "
                        "is not an nn.Module; cache_compile caches methods of modules")
                cached = self._make(types.MethodType(self.__wrapped__, instance))
                instance.__dict__[self._name] = cached
        return cached

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ContractError(
            f"{self.__qualname__} was given to cache_compile outside a class body: decorate "
            "the method where the class defines it (@cache_compile above def forward), or "
            "pass the method bound to an instance, cache_compile(model.forward)")


def in_class_body(func: types.FunctionType) -> bool:
    """Whether ``func`` is being defined in a class body (``Model.forward``, also
    ``build.<locals>.Model.forward``), not in a module or a function."""
    parts = func.__qualname__.split(".")
    return len(parts) >= 2 and parts[-2] != "<locals>"


def taken_from_class(func: types.FunctionType) -> bool:
    """Whether ``func`` was read off a class that exists already (``Model.forward``
    after the class statement), rather than being decorated in its class body."""
    parts = func.__qualname__.split(".")
    if "<locals>" in parts:
        return False
    obj: Any = func.__globals__.get(parts[0])
    for part in parts[1:-1]:
        obj = getattr(obj, part, None)
    return isinstance(obj, type) and vars(obj).get(parts[-1]) is func


def decorate_class(cls: type, make: MakeCached) -> type:
    """``@cache_compile`` on an ``nn.Module`` subclass: its ``forward``, cached per instance
    (the class itself is returned, so its name still names it)."""
    forward = cls.__dict__.get("forward", getattr(cls, "forward", None))
    if isinstance(forward, CachedMethod):
        raise ContractError(f"cache_compile({cls.__qualname__}): its forward is cached "
                            "already; decorate the class or the method, once")
    if not isinstance(forward, types.FunctionType) or forward is torch.nn.Module.forward:
        raise ContractError(f"cache_compile({cls.__qualname__}): the class has no Python "
                            "forward to cache")
    descriptor = CachedMethod(forward, make)
    cls.forward = descriptor  # type: ignore[attr-defined]
    descriptor.__set_name__(cls, "forward")
    return cls


# -- plain functions ---------------------------------------------------------------------
class FunctionModule(torch.nn.Module):
    """Holds a plain function, so that it is cached as a method of a module with no state
    (``cache_compile(fn)``): the function is the attribute ``fn``; the method calling it is
    :func:`function_method`'s."""

    def __init__(self, fn: types.FunctionType) -> None:
        super().__init__()
        self.fn = fn
        self.eval()

    def cachecompile_label(self) -> str:
        """The entry's model label (``cachectl ls``): the function's Python module (the
        function column names the function), not this holder's class."""
        return str(self.fn.__module__)


def _call_function(self: FunctionModule, *args: Any, **kwargs: Any) -> Any:
    return self.fn(*args, **kwargs)


# code object (by identity: code objects compare equal across files, so two modules' same
# def at the same line would be one) -> it, kept alive so that its id is not reused, and
# the function first cached with it: a second function of the same code object is the
# same def executed again (in a loop, a factory): its identity is not stable.
_seen: dict[int, tuple[types.CodeType, weakref.ref[types.FunctionType]]] = {}
_seen_lock = threading.Lock()


def check_function(fn: Any, pattern: str = "") -> types.FunctionType:
    """The plain Python function ``fn``, or ContractError naming why it cannot be cached."""
    if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType,
                       types.MethodWrapperType, types.WrapperDescriptorType,
                       types.MethodDescriptorType)) or (callable(fn) and inspect.isbuiltin(fn)):
        raise ContractError(
            f"cache_compile() got {getattr(fn, '__qualname__', fn)!r}, a C function: Dynamo "
            "traces Python bytecode, and there is none. Wrap the call in a def of your own "
            "(def f(x): return op(x)) and cache that")
    if isinstance(fn, functools.partial):
        raise ContractError(
            "cache_compile() got a functools.partial: its bound arguments would not be keyed "
            "as code is. Cache the function itself and pass the arguments, or write a def "
            "that fixes them")
    if not isinstance(fn, types.FunctionType):
        raise ContractError(
            f"cache_compile() got {type(fn).__qualname__}, which is neither a function, a "
            "bound method of an nn.Module, an nn.Module nor an nn.Module class. Make the "
            "callable an nn.Module and pass it, or pass its Python function.\n" + pattern)
    refuse_generators(fn, fn.__qualname__)
    with _seen_lock:
        seen = _seen.get(id(fn.__code__))
        ref = seen[1] if seen is not None else None
        first = ref() if ref is not None else None
        if ref is not None and first is not fn:
            what = "a lambda" if fn.__name__ == "<lambda>" else f"the function {fn.__qualname__}"
            raise ContractError(
                f"cache_compile() got {what} defined at {fn.__code__.co_filename}:"
                f"{fn.__code__.co_firstlineno} again: a new function object of code it "
                "cached before (a def or lambda in a loop, or in a function called again). "
                "Its identity is not stable, so each would be a new cached function. Define "
                "it once (at module level) and cache it once, outside the loop")
        _seen[id(fn.__code__)] = (fn.__code__, weakref.ref(fn))
    return fn


def refuse_generators(fn: types.FunctionType, name: str) -> None:
    """ContractError for a generator or ``async`` function: calling one runs none of its
    body, so there is no call to compile (what a compile would trace is the creation of
    the generator; its body would run later, uncompiled, pulled by the caller)."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        what = "an async generator" if inspect.isasyncgenfunction(fn) else "a generator"
        raise ContractError(
            f"cache_compile() got {name}, {what} function (it yields): calling it runs none "
            "of its body, so there is no call to compile and cache. Cache a function that "
            "returns the results (a tensor, or a tuple or list of them), and iterate over "
            "them outside it; or cache the step the loop calls")
    if inspect.iscoroutinefunction(fn):
        raise ContractError(
            f"cache_compile() got {name}, an async function: calling it returns a coroutine "
            "without running its body, so there is no call to compile. Cache the plain "
            "(def) function that computes the tensors, and await around it")


def function_method(fn: types.FunctionType) -> types.MethodType:
    """The bound method that caches ``fn``: a :class:`FunctionModule` holding it, whose
    method runs in ``fn``'s module (its globals, its name in logs and labels), so the
    trace reads the module's globals as the function does and guards them alike."""
    holder = FunctionModule(fn)
    code = _call_function.__code__
    method_fn = types.FunctionType(code, fn.__globals__, fn.__name__)
    method_fn.__qualname__ = fn.__qualname__
    method_fn.__module__ = fn.__module__
    method_fn.__doc__ = fn.__doc__
    return types.MethodType(method_fn, holder)
