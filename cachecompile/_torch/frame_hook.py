"""Running a stored frame in place of a function's own code, without Dynamo (warm path).

When a method breaks its graph around a call (``self.attn(x)`` whose ``forward`` breaks
inside), Dynamo runs that call eagerly and then compiles the callee's frame on its own:
the callee's code object belongs to the user's module, not to the method, and is reached
through ``Module.__call__``, which no name of ours can intercept. A warm process serves
such a frame with the same C hook Dynamo uses (PEP 523, ``torch._C._dynamo.eval_frame``):

* ``_load_precompile_entry(code, guard_manager, new_code)`` puts a (guards, code) pair in
  front of Dynamo's cache of ``code``; the guard manager here is a ``RootGuardManager``
  with one lambda guard, cachecompile's own check of the frame's arguments;
* ``set_eval_frame(False)`` is Dynamo's *run-only* mode: a frame whose code has an entry
  whose guards hold runs that entry's code; any other frame runs as it is. Nothing is
  traced or compiled, and neither ``torch._dynamo`` nor its Python is imported (checked by
  :func:`available`).

Entries are process-wide and Dynamo's own compiles consult them too, so each guard first
asks whether a cachecompile call is running in this thread (:func:`serving`): another
``torch.compile`` of the same function never runs our code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

NEEDS: tuple[tuple[str, str], ...] = (
    ("torch", "_C._dynamo.eval_frame._load_precompile_entry"),
    ("torch", "_C._dynamo.eval_frame.set_eval_frame"),
    ("torch", "_C._dynamo.guards.RootGuardManager"),
)

_EF: Any = getattr(torch._C, "_dynamo", None) and torch._C._dynamo.eval_frame
_G: Any = getattr(torch._C, "_dynamo", None) and torch._C._dynamo.guards

_state = threading.local()


def _owners() -> list[object]:
    owners: list[object] | None = getattr(_state, "owners", None)
    if owners is None:
        owners = _state.owners = []
    return owners


def serving(owner: object = None) -> bool:
    """Whether a cachecompile call with installed frames is running in this thread; with
    ``owner``, whether the innermost such call is ``owner``'s (the entry that installed a
    frame serves it only in its own calls: another entry of the same method, whose code
    objects it shares, runs its own frames and continuations)."""
    owners = _owners()
    if not owners:
        return False
    return owner is None or owners[-1] is owner


@contextlib.contextmanager
def run_only(owner: object = None) -> Iterator[None]:
    """Dynamo's run-only frame hook for this thread while the block runs: frames whose
    code has a holding entry (:func:`install`) run it; every other frame runs as written.
    ``owner``: whose call this is (:func:`serving`). Restores the hook that was set before
    (nested calls, a live compile around us)."""
    prev = _EF.set_eval_frame(False)
    owners = _owners()
    owners.append(owner)
    try:
        yield
    finally:
        owners.pop()
        _EF.set_eval_frame(prev)


@contextlib.contextmanager
def not_serving() -> Iterator[None]:
    """Installed frames stay out of the block (a live ``torch.compile`` inside a
    cachecompile call: Dynamo compiles what it meets itself, never around our code)."""
    saved = _owners()
    _state.owners = []
    try:
        yield
    finally:
        _state.owners = saved


class _Manager:
    """What ``_load_precompile_entry`` reads a guard manager through (Dynamo passes its
    ``GuardManagerWrapper``): the root manager as ``root``."""

    __slots__ = ("root",)

    def __init__(self, root: Any) -> None:
        self.root = root


def install(code: types.CodeType, check: Callable[[dict[str, Any]], bool],
            new_code: types.CodeType, text: str, owner: object = None) -> None:
    """Run ``new_code`` in place of ``code`` while a cachecompile call runs in this thread
    and ``check`` holds on the frame's arguments (a dict by name, as the C hook gives them).
    ``new_code`` must keep ``code``'s arguments, cells and free variables (Dynamo's
    transformed code does)."""
    root = _G.RootGuardManager()

    def guard(frame_locals: dict[str, Any]) -> bool:
        if not serving(owner):
            return False
        try:
            return bool(check(frame_locals))
        except Exception:  # a guard that raises is a guard that fails: the frame runs as is
            logger.debug("frame check raised", exc_info=True)
            return False

    root.add_lambda_guard(guard, [text], None)
    _EF._load_precompile_entry(code, _Manager(root), new_code)


def _probe_code(x: int) -> int:
    return x + 1


def _probe_new(x: int) -> int:
    return x + 100


@functools.cache
def available() -> bool:
    """Whether this torch's hook runs an installed entry, passes the frame's arguments,
    falls back to the frame's own code when the check fails, and leaves other threads'
    and other callers' frames alone (checked once per process on a private code object)."""
    try:
        code = _probe_code.__code__.replace()
        fn = types.FunctionType(code, globals(), "_probe_code")
        seen: list[Any] = []

        def check(d: dict[str, Any]) -> bool:
            seen.append(d.get("x"))
            return bool(d.get("x") == 1)

        install(code, check, _probe_new.__code__, "probe")
        outside = fn(1)
        with run_only():
            hit, miss = fn(1), fn(2)
        return (outside, hit, miss) == (2, 101, 3) and seen == [1, 2]
    except Exception:  # any failure: frames of called functions run eagerly
        logger.debug("the frame hook is unavailable", exc_info=True)
        return False
