"""How fast this machine runs the kind of work the test suite does, as one number.

``python3 tools/machine_speed.py [--factor]`` prints the seconds a fixed, single-core
workload takes (the median of eleven runs): Python compiling and walking source, dicts,
strings and regexes, what mypy, Dynamo's tracing and Inductor's code generation spend their
time on. ``--factor`` prints that time over ``REFERENCE_S``, never under 1. It needs only
the standard library, so .ci/run runs it before any venv exists.

Why: the same 2-core CI machine ran the README command in 868 s one morning and in 2268 s
that afternoon, with mypy alone (code it does not run) going from 44 s to 137 s. A budget in
plain seconds then fails a green suite for the machine's speed, not for a slow test. .ci/run
scales its budgets by this number over ``REFERENCE_S`` (the machine the budgets were set on).
"""

from __future__ import annotations

import ast
import re
import statistics
import sys
import time

# The workload's median on the 2-core VM of the budgets' figures (docs/performance.md, "The
# test suite": the README command's tests in 819 s). Derived, since that machine is slower
# now: on 2026-12-02 at 15:00 UTC the same VM ran those tests in 2057 s (2.51x) and the
# workload's median of 21 runs was 0.568 s (0.44-0.74: the machine's speed moves by the
# second, hence a median of many short runs); 0.568 / 2.51.
REFERENCE_S = 0.23

_WORD = re.compile(r"[a-z_]+\d*")


def _source(n: int) -> str:
    lines = []
    for i in range(n):
        lines.append(f"def f{i}(a, b=({i}, 'x{i}')):\n"
                     f"    d = {{'k{i}': a, 'b': b}}\n"
                     f"    for j in range({i % 7}):\n"
                     f"        d[str(j)] = [a, j, d.get('k{i}')]\n"
                     f"    return sorted(d, key=lambda k: (len(k), k))\n")
    return "".join(lines)


def workload() -> float:
    """Seconds one pass takes on one core."""
    start = time.perf_counter()
    src = _source(300)
    for _ in range(4):
        tree = ast.parse(src)
        names = [node.id for node in ast.walk(tree) if isinstance(node, ast.Name)]
        code = compile(tree, "<speed>", "exec")
        ns: dict[str, object] = {}
        exec(code, ns)
        for i in range(0, 300, 3):
            ns[f"f{i}"](i)  # type: ignore[operator]
        counts: dict[str, int] = {}
        for word in _WORD.findall(src):
            counts[word] = counts.get(word, 0) + 1
        "".join(sorted(counts)).count("f1") + len(names)   # work, its result unused
    return time.perf_counter() - start


def measure(runs: int = 11) -> float:
    return statistics.median(workload() for _ in range(runs))


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv[1:]):
        print(__doc__)
        return 0
    seconds = measure()
    if argv[1:] == ["--factor"]:
        # How much slower than the reference machine, never under 1: a faster machine keeps
        # the budget as set.
        print(f"{max(1.0, seconds / REFERENCE_S):.2f}")
    else:
        print(f"{seconds:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
