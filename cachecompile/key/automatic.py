"""dynamic=None per dimension, as torch.compile's automatic dynamic shapes.

torch.compile's default compiles a frame static first; when a later call differs from
it, Dynamo recompiles with the dimensions *that changed* symbolic and every other one
still static (``automatic_dynamic_shapes``). Making the whole method dynamic instead
(every dimension, every int, every frame after a graph break) is another compile than
the one torch.compile makes, and reaches torch bugs that torch.compile's never meets
(Longformer with global attention: Inductor's ``Invalid NaN comparison``).

Here: the dimensions in which a call's static signature differs from the first of its
form (:func:`form`: the same signature but for sizes and ints, 0 and 1 included) are
widened, in the signature (their size becomes its class, as ``dynamic=True`` writes it)
and for Dynamo (``maybe_mark_dynamic`` on the call's tensors, for the first call of the
widened signature only, and taken off after: the user's tensors keep no mark). A
difference other than tensor sizes (an int's value, strides, a dtype) gives None: the
caller makes the method dynamic, as before.

Tensors are found in the order :func:`cachecompile.key.signature.signature` visits them,
so the n-th tensor signature is the n-th tensor; where the two counts differ nothing is
marked (fail closed: the compile specialises that dim, and its guards say so).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cachecompile._torch import runtime
from cachecompile.key.signature import Signature, tensors_in_order

# (n-th tensor of the call, its widened dims), sorted: hashable, comparable.
Dims = tuple[tuple[int, tuple[int, ...]], ...]


def _is_tensor_sig(s: Any) -> bool:
    return type(s) is tuple and len(s) >= 7 and s[0] == "T"


def _tensor_sigs(sig: Any, out: list[tuple[Any, ...]]) -> None:
    if _is_tensor_sig(sig):
        out.append(sig)
    elif type(sig) is tuple:
        for s in sig:
            _tensor_sigs(s, out)


def form(dynamic_sig: Signature) -> Signature:
    """The form of a call (its ``dynamic=True`` signature) whose calls are compared with
    the first of them: every tensor size and int blinded, 0 and 1 too. Dynamo's automatic
    dynamic compares every size with the first call's, so a batch of 1 then 2 makes that
    dim dynamic (sizes 0 and 1 stay specialised: :func:`widen`), not a form of its own
    compiled static first."""

    def walk(s: Any) -> Any:
        if _is_tensor_sig(s):
            return (*s[:3], (-1,) * len(s[3]), *s[4:])
        if type(s) is tuple:
            if len(s) == 2 and s[0] == "int" and type(s[1]) is int:
                return ("int", -1)
            return tuple(walk(x) for x in s)
        return s

    return walk(dynamic_sig)


def _same_but_sizes(a: Any, b: Any, out: dict[int, set[int]], n: list[int]) -> bool:
    """Walk ``a`` and ``b`` together, noting which sizes of each tensor differ; False at
    the first difference that is not a tensor's size."""
    if _is_tensor_sig(a) and _is_tensor_sig(b):
        i = n[0]
        n[0] += 1
        if a[:3] != b[:3] or a[4:] != b[4:] or len(a[3]) != len(b[3]):
            return False
        dims = {d for d, (x, y) in enumerate(zip(a[3], b[3], strict=True)) if x != y}
        if dims:
            out.setdefault(i, set()).update(dims)
        return True
    if type(a) is tuple and type(b) is tuple and len(a) == len(b):
        return all(_same_but_sizes(x, y, out, n) for x, y in zip(a, b, strict=True))
    return a == b


def changed_dims(first: Signature, now: Signature, known: Dims = ()) -> Dims | None:
    """The dims to widen so that ``now`` and ``first`` (static signatures of one form)
    share a signature, with ``known`` kept; None if they differ in more than sizes."""
    out: dict[int, set[int]] = {i: set(d) for i, d in known}
    if not _same_but_sizes(first, now, out, [0]):
        return None
    return tuple(sorted((i, tuple(sorted(d))) for i, d in out.items()))


def widen(sig: Signature, dims: Dims) -> Signature:
    """``sig`` (static) with ``dims`` written as ``dynamic=True`` writes them."""
    want = dict(dims)
    n = [0]

    def walk(s: Any) -> Any:
        if _is_tensor_sig(s):
            d = want.get(n[0], ())
            n[0] += 1
            if not d:
                return s
            sizes = tuple(-1 if i in d and x > 1 else x for i, x in enumerate(s[3]))
            return (*s[:3], sizes, *s[4:])
        if type(s) is tuple:
            return tuple(walk(x) for x in s)
        return s

    return walk(sig)


def mark(sig: Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any],
         dims: Dims) -> Callable[[], None]:
    """Mark ``dims`` of the call's tensors for Dynamo (maybe dynamic); what takes the
    marks off again."""
    found: list[tuple[Any, ...]] = []
    _tensor_sigs(sig, found)
    tensors = tensors_in_order(args, kwargs)
    if len(tensors) != len(found):
        return lambda: None
    undo = [runtime.mark_maybe_dynamic(tensors[i], d) for i, d in dims]

    def unmark() -> None:
        for u in reversed(undo):   # a tensor given twice ends as it began
            u()

    return unmark
