"""What ``cachectl`` prints for people: guards in the user's names, hook checks folded,
one way of counting entries and one way of printing a signature, in every verb.

* Dynamo installs module references under mangled global names
  (``__main__.__import_torch_dot_nn_dot_modules_dot_module``) and a builtins dict
  (``__builtins_dict___0['len']``): :func:`demangle` shows them as what they are
  (``torch.nn.modules.module``, ``builtins.len``).
* A module Dynamo traced gets one check per hook dict (``len(self._modules['fc1'].
  _forward_hooks) == 0``, eight kinds, and four global ones): :func:`fold_hooks` folds
  them into one line per group, ``fc1, fc2: no hooks (16 checks)``.
* :func:`entries` is the one phrase for a count of entries: ``3 entries (+3 shared
  graphs)``, the user's entries as ``ls`` lists them, and the shared-graph entries (``ls
  --graphs``) apart; :func:`plural` counts anything else the same way (``1 record``,
  ``2 records``).
* :func:`factor_text` prints a factor's value, the ``signature`` factor as the labels
  and log lines print it (``float32[2,16]@cpu``), never as raw JSON.

Torch-free, as all of ``cachectl``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cachecompile.key.sigtext import describe
from cachecompile.store.policy import is_shared_graph

__all__ = ["count", "demangle", "entries", "factor_text", "fold_hooks", "plural",
           "split_graphs", "were"]

# ``<module>.__import_torch_dot_nn_dot_modules_dot_module``: the module, in the function's
# module globals, under the name Dynamo gave it ("." spelled "_dot_").
_IMPORT = re.compile(r"(?:\b[A-Za-z_][\w.]*\.)?__import_(\w+)")
_BUILTINS = re.compile(r"(?:\b[A-Za-z_][\w.]*\.)?__builtins_dict___\d+\[['\"](\w+)['\"]\]")


def demangle(text: str) -> str:
    """``text`` with Dynamo's generated globals named as what they hold."""
    text = _IMPORT.sub(lambda m: m.group(1).replace("_dot_", "."), text)
    return _BUILTINS.sub(lambda m: f"builtins.{m.group(1)}", text)


# The hook dicts nn.Module keeps (torch/nn/modules/module.py), and the module's globals.
_HOOK_DICTS = (r"_(?:global_)?(?:forward|backward)(?:_pre)?_hooks(?:_with_kwargs|_always_called)?"
               r"|_(?:state_dict|load_state_dict)(?:_pre)?_hooks")
_HOOK_LEN = re.compile(rf"^len\((?P<owner>.+)\.(?P<dict>{_HOOK_DICTS})\) == 0"
                       r"(?: \(global module hooks\))?$")
_HOOK_TYPE = re.compile(rf"^type\((?P<owner>.+)\.(?P<dict>{_HOOK_DICTS})\) is "
                        r"(?:collections\.OrderedDict|builtins\.dict)$")
_SUBMODULE = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")


def _module_name(owner: str) -> str:
    """``self._modules['fc1']._modules['a']`` -> ``fc1.a``; ``self`` stays ``self``."""
    if owner == "self":
        return "self"
    if owner.startswith("self."):
        rest = _SUBMODULE.sub(lambda m: "." + m.group(1), owner[len("self"):])
        if "(" not in rest and "[" not in rest:
            return rest.lstrip(".")
    return owner


def fold_hooks(texts: Sequence[str]) -> list[tuple[list[int], str]]:
    """The guards' texts (demangled), hook-dict checks folded: ``(indices, line)`` in the
    order of each group's first guard; a guard that is no hook check is its own line."""
    groups: dict[str, tuple[list[int], list[str]]] = {}   # kind -> (indices, modules)
    order: list[tuple[int, str, bool]] = []    # (index, text or kind, is a group)
    for i, text in enumerate(texts):
        m = _HOOK_LEN.match(text) or _HOOK_TYPE.match(text)
        if m is None:
            order.append((i, text, False))
            continue
        kind = "global" if "_global_" in m.group("dict") else "module"
        if kind not in groups:
            groups[kind] = ([], [])
            order.append((i, kind, True))
        indices, modules = groups[kind]
        indices.append(i)
        name = _module_name(m.group("owner"))
        if kind == "module" and name not in modules:
            modules.append(name)
    out: list[tuple[list[int], str]] = []
    for i, text, group in order:
        if not group:
            out.append(([i], text))
            continue
        kind = text
        indices, modules = groups[kind]
        checks = f"({plural(len(indices), 'check')})"
        out.append((indices, f"no global module hooks {checks}" if kind == "global"
                    else f"{', '.join(modules)}: no hooks {checks}"))
    return out


def ranges(indices: Sequence[int]) -> str:
    """``[11, 12, 13, 15]`` -> ``11-13,15``."""
    parts: list[str] = []
    start = prev = None
    for i in [*indices, None]:
        if start is not None and (i is None or i != prev + 1):   # type: ignore[operator]
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ",".join(parts)


def split_graphs(labels: Iterable[Mapping[str, str]]) -> tuple[int, int]:
    """How many of these entries are the user's and how many shared graphs."""
    mine = graphs = 0
    for lb in labels:
        if is_shared_graph(lb):
            graphs += 1
        else:
            mine += 1
    return mine, graphs


def plural(n: int, noun: str, many: str = "") -> str:
    """A count and its noun, singular for one: ``1 record``, ``2 records`` (``many``: the
    plural where it is not ``noun`` + s)."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"


def were(n: int) -> str:
    """``1 was``, ``2 were``: a count of entries already where they were asked for."""
    return f"{n} {'was' if n == 1 else 'were'}"


def entries(n: int, graphs: int = 0) -> str:
    """The one way every verb counts entries: ``3 entries (+3 shared graphs)``."""
    return plural(n, "entry", "entries") + _and_graphs(graphs)


def count(n: int, graphs: int = 0) -> str:
    """The same count where the row names what is counted: ``3 (+3 shared graphs)``."""
    return f"{n}{_and_graphs(graphs)}"


def _and_graphs(graphs: int) -> str:
    return f" (+{plural(graphs, 'shared graph')})" if graphs else ""


def factor_text(name: str, value: Any) -> str:
    """A factor's value as ``show`` and ``explain`` print it: JSON, but a signature as
    every other place prints one (naming an inference-mode tensor, which the short form
    leaves out, so that two signatures that differ there print apart)."""
    if name == "signature" and isinstance(value, list):
        try:
            return describe(value, detail=True)
        except (TypeError, ValueError, IndexError, AttributeError):
            pass   # a signature of a format this code does not know: as stored
    return json.dumps(value)
