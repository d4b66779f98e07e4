"""Large outputs of ``cachectl`` written fast: a JSON array an item at a time, and
stdout in chunks (``ls`` of 100,000 entries)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from json.encoder import encode_basestring_ascii
from typing import Any

__all__ = ["Chunked", "echo_json_array"]


def echo_json_array(items: Iterable[dict[str, Any]]) -> None:
    """Print ``json.dumps(list(items), indent=1)``, one item at a time: the whole text
    of 100,000 entries was 150 MB held at once."""
    out = Chunked()
    first = True
    for item in items:
        out.write("[\n " if first else ",\n ")
        out.write(_indented(item, " "))
        first = False
    out.write("[]\n" if first else "\n]\n")
    out.flush()


class Chunked:
    """stdout written in chunks of about 1,000 pieces: with PYTHONUNBUFFERED (or a
    console) each write is a system call, 3.7 s for the 200,000 of 100,000 entries."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    def write(self, text: str) -> None:
        self._parts.append(text)
        if len(self._parts) >= 1000:
            self.flush()

    def flush(self) -> None:
        sys.stdout.write("".join(self._parts))
        sys.stdout.flush()
        self._parts.clear()


def _scalar(v: Any) -> str | None:
    """``json.dumps(v)`` of a scalar, through the C string encoder (json's indenting
    encoder is pure Python: 4 s of ``ls --json`` at 100,000 entries); None otherwise."""
    if isinstance(v, str):
        return encode_basestring_ascii(v)
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, int):
        return int.__repr__(v)
    if isinstance(v, float) and math.isfinite(v):
        return float.__repr__(v)
    return None


def _indented(obj: Any, pad: str) -> str:
    """``json.dumps(obj, indent=1)`` with every line after the first indented by ``pad``."""
    if isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
        inner = pad + " "
        parts = [f"{inner}{encode_basestring_ascii(k)}: {_indented(v, inner)}"
                 for k, v in obj.items()]
        return "{\n" + ",\n".join(parts) + "\n" + pad + "}"
    text = _scalar(obj)
    if text is not None:
        return text
    return json.dumps(obj, indent=1).replace("\n", "\n" + pad)
