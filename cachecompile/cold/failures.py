"""What a failed trace tells the user: a graph break where one graph was asked for
(:class:`GraphBreakError`, naming the file, the line and the fix), a compile that failed
inside torch (:class:`TorchCompileError`, with what plain torch.compile did), a note on
eager's own error. Worded here, raised by the sessions (:mod:`cachecompile.cold.capture`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from cachecompile._torch import dynamo
from cachecompile.errors import GraphBreakError, TorchCompileError
from cachecompile.key.signature import describe_types

logger = logging.getLogger(__name__)

_BREAK_HINT = ("Hint: pass fullgraph=False to let the graph break there (every frame is "
               "cached with its guards: docs/usage.md, \"Graph breaks\"), move the unsupported "
               "code (print, .item(), data-dependent Python control flow, unsupported "
               "libraries) out of the cached method, or run torch._dynamo.explain() on it "
               "for every break.")
_DATA_HINT = ("Hint: a size or a Python branch here depends on the values in a tensor "
              "(.tolist(), .item(), a boolean mask, nonzero()), which one graph for every "
              "call cannot have. Compute it outside the cached method and pass it in as a "
              "Python int or list, or cache a smaller part that does not need it (a vision "
              "tower's blocks rather than the tower); fullgraph=False splits the method there "
              "instead, and caches each part.")


def last_line(exc: BaseException) -> str:
    """The innermost error of torch's chain, as ``Type: first line``."""
    inner = exc
    for _ in range(16):
        nxt = getattr(inner, "inner_exception", None) or inner.__cause__
        if nxt is None or nxt is inner:
            break
        inner = nxt
    lines = [ln.strip() for ln in str(inner).strip().splitlines() if ln.strip()]
    return f"{type(inner).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def call_types(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A call's argument types under ``func``'s parameter names (``x: float32[4,15]@cpu``)."""
    names = [p.name for p in inspect.signature(func).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return describe_types(args, kwargs, names)


def torch_compile_error(exc: BaseException, func: Callable[..., Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any], dynamic: bool,
                        plain: BaseException | None,
                        automatic: bool = False) -> TorchCompileError:
    """torch's backend failed to compile a graph of ``func``: one message, with the last
    line of torch's error, what plain torch.compile did with the same call (``plain``: its
    error; None: not tried, the method's graph breaks) and the argument to try; the whole
    chain at DEBUG."""
    logger.debug("torch's compile failed", exc_info=exc)
    qualname = getattr(func, "__qualname__", repr(func))
    if automatic:   # dynamic=None given: its dynamic compile failed, or its static one
        try_instead = "dynamic=False (one entry per shape)" + (
            "" if dynamic else ", or caching a smaller part of the method")
    else:
        try_instead = ("dynamic=None (torch.compile's default: static first) or "
                       "dynamic=False" if dynamic else
                       "dynamic=True, or caching a smaller part of the method")
    if plain is None:
        spec = ("(Plain torch.compile was not tried on this call: the method's graph breaks, "
                "and its first frames ran already.)")
    else:
        spec = (f"Plain torch.compile(dynamic={dynamic}) fails on the same call too "
                f"({last_line(plain)}): a limit or a bug of this torch release, not of the "
                "inputs.")
    return TorchCompileError(
        f"cache_compile could not compile {qualname}({call_types(func, args, kwargs)}): "
        f"torch's compile failed ({last_line(exc)}). {spec} Try "
        f"{try_instead}. The whole error is logged at DEBUG (logger "
        "cachecompile.cold.failures). Nothing was cached.")


def graph_break_error(exc: BaseException, func: Callable[..., Any],
                      note: str = "") -> GraphBreakError:
    """Turn Dynamo's fullgraph failure into an error naming file, line and reason."""
    filename, lineno, reason = dynamo.graph_break_site(exc)
    hint = _BREAK_HINT
    if isinstance(exc, dynamo.data_dependent_errors()):
        cause = dynamo.data_dependent_cause(exc)
        reason = f"data-dependent: {reason}" + (f" (at {cause})" if cause else "")
        hint = _DATA_HINT
    where = f"{filename}:{lineno}" if filename else getattr(func, "__qualname__", repr(func))
    message = (
        f"cache_compile needs {getattr(func, '__qualname__', func)} to compile as ONE graph "
        f"(fullgraph), but Dynamo broke the graph at {where}: {reason}\n"
        f"{note}{hint}"
    )
    return GraphBreakError(message, filename=filename, lineno=lineno, reason=reason)


def with_note(exc: BaseException, note: str) -> BaseException:
    """``exc`` with ``note`` shown under its message (PEP 678; kept as ``__notes__`` on
    Python 3.10, whose tracebacks do not print it)."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
    return exc
