"""A call signature as text (``float32[2,16]@cpu, n=int``), torch-free.

One rendering wherever a signature is shown: log lines, labels, ``cachectl ls`` /
``show`` / ``explain`` / ``program`` and ``build --check``. It reads a signature as
:mod:`cachecompile.key.signature` builds it (tuples, torch dtypes) or as the key stores
it (its JSON form: lists, dtype names), so the CLI renders the ``signature`` factor
without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["describe"]

_SEQ = (tuple, list)


def describe(sig: Any, detail: bool = False) -> str:
    """A short human-readable rendering of a signature, for labels and log lines.
    ``detail`` also names what the short form leaves out (an inference-mode tensor), for
    ``cachectl explain`` to show two signatures that differ only there apart."""
    parts: list[str] = []
    for item in sig:
        if isinstance(item, _SEQ) and item and item[0] == "kw":
            parts.extend(f"{k}={_describe_one(v, detail)}" for k, v in item[1:])
        else:
            parts.append(_describe_one(item, detail))
    return ", ".join(parts)


def _describe_one(v: Any, detail: bool = False) -> str:
    if isinstance(v, _SEQ) and v and v[0] == "T":
        _, dtype, device, sizes, layout, inference, cls = v[:7]
        dims = ",".join("n" if s == -1 else str(s) for s in sizes)
        if isinstance(layout, _SEQ):
            extra = " strides[" + ",".join(str(s) for s in layout) + "]"
        else:
            extra = "" if layout else " strided"
        extra += f" {cls.rsplit('.', 1)[-1]}" if cls else ""
        extra += " inference" if detail and inference else ""
        if len(v) > 7:
            extra += " marked " + ",".join(f"{label}{list(val) if isinstance(val, _SEQ) else val}"
                                           for label, val in v[7])
        return f"{str(dtype).replace('torch.', '')}[{dims}]@{device}{extra}"
    if isinstance(v, _SEQ) and v and v[0] in ("nt", "dc") and len(v) == 3:
        name = v[1].rsplit(".", 1)[-1]
        if v[0] == "nt":
            return f"{name}(" + ", ".join(_describe_one(x, detail) for x in v[2]) + ")"
        return f"{name}(" + ", ".join(f"{k}={_describe_one(x, detail)}" for k, x in v[2]) + ")"
    if isinstance(v, _SEQ) and len(v) == 2 and isinstance(v[0], str):
        kind, val = v
        if kind in ("list", "tuple"):
            inner = ", ".join(_describe_one(x, detail) for x in val)
            return f"[{inner}]" if kind == "list" else f"({inner})"
        if kind == "dict":
            return "{" + ", ".join(f"{k!r}: {_describe_one(x, detail)}" for k, x in val) + "}"
        if kind == "obj":
            return str(val).rsplit(".", 1)[-1]
        if kind == "int" and val == -1:
            return "int"
        if kind == "float" and val is None:
            return "float"
        return repr(val)
    return repr(v)
