"""Graph breaks (``fullgraph=False``): every frame Dynamo compiles is stored with its guards
and served in a fresh process that traces nothing and compiles nothing.

The method below breaks its graph twice (a branch on ``.item()``, a ``print``) and reads
two module globals after the breaks. One cold process takes both branches; a warm process
with empty Inductor dirs gives eager's result on both, prints what eager prints, calls no
g++ and does not import Dynamo. A fresh process where a global read after the breaks has
another value gets eager's result: the frame's guard on it fails, so that frame is
compiled live there and published, and the next such process is served from it. (torch's
caching precompile drops exactly these guards: a hit with the old value; see
docs/performance.md, "Graph breaks".)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from ccutil import Sandbox, cachectl

MODEL = '''
import os
import torch
from torch import nn

# Read after the graph breaks: a value Dynamo guards (EQUALS_MATCH) and a function it
# guards by identity (the kind torch's caching precompile drops).
SCALE = int(os.environ.get("CC_TEST_SCALE", "3"))
act = torch.tanh if os.environ.get("CC_TEST_ACT", "tanh") == "tanh" else torch.sigmoid


class Net(nn.Module):
    # A class attribute read after the breaks: torch 2.11 builds no guard on it (2.12+
    # does), and cachecompile adds the one 2.12 builds, in every frame that reads it.
    OFFSET = float(os.environ.get("CC_TEST_OFFSET", "0"))

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def run(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:      # data-dependent: the graph breaks here
            y = y + 1
        else:
            y = y * -2
        print("between graphs", tuple(y.shape))   # and here
        return act(y) * SCALE + type(self).OFFSET
'''

RUN = '''
import sys, warnings
import torch
from cachecompile import cache_compile
import model

m = model.Net().eval()
cached = cache_compile(m.run, fullgraph=False, backend="{backend}")
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
results = {{}}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with torch.no_grad():
        for name in {branches!r}:
            xx = x + 10 if name == "pos" else x - 10
            got = cached(xx)
            want = m.run(xx)
            results[name] = [bool(torch.allclose(got, want, atol=1e-6)), float(got.sum())]
served = {{}}
for variants in cached._runners.values():
    for v in variants:
        if v.frames is not None:
            served.update({{k: list(n) for k, n in v.frames.served().items()}})
report({{"results": results, "events": [e[0] for e in cached.events],
        "dynamo": "torch._dynamo" in sys.modules, "served": served,
        "warnings": [str(w.message) for w in caught if "cachecompile" in str(w.message)]}})
'''


def _prints(stdout: str) -> int:
    return sum(1 for line in stdout.splitlines() if line.startswith("between graphs"))


@pytest.fixture(scope="module")
def breaks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Sandbox, Any]:
    """One cold process (Inductor, the session's shared dirs) that takes both branches:
    the signature's entry from the first call, the other branch's frame published from
    the second. The warm process is the one with empty Inductor dirs."""
    box = Sandbox(tmp_path_factory.mktemp("breaks"))
    (box.root / "model.py").write_text(MODEL)
    cold = box.run(RUN.format(backend="inductor", branches=("pos", "neg")))
    return box, cold


@pytest.mark.slow
def test_two_breaks_cold_then_warm_with_nothing_traced_or_built(
        breaks: tuple[Sandbox, Any]) -> None:
    box, cold = breaks
    assert cold["events"] == ["miss"], cold.value
    assert all(ok for ok, _ in cold["results"].values()), cold.value
    assert cold["warnings"] == [], cold["warnings"]
    assert _prints(cold.stdout) == 4      # the cached call's prints and eager's

    box.reset_compiler_log()
    warm = box.run(RUN.format(backend="inductor", branches=("neg", "pos")),
                   fresh_inductor=True)   # new, empty Inductor dirs: any build would show
    assert warm["events"] == ["hit"], warm.value
    assert warm["results"] == cold["results"], (warm.value, cold.value)   # eager's, both
    assert _prints(warm.stdout) == 4, warm.stdout
    assert box.compiler_calls() == 0, box.gxx_log.read_text()
    assert warm["dynamo"] is False, "a warm process must not import torch._dynamo"
    assert warm["warnings"] == [], warm["warnings"]
    # Every continuation ran a stored variant: the first call's entry and the frame
    # variant the cold process published for the other branch. None compiled or ran as
    # written.
    served = warm["served"]
    assert served and all(n[1] == 0 and n[2] == 0 for n in served.values()), served
    assert sum(n[0] for n in served.values()) >= 4, served


@pytest.mark.slow
def test_a_global_read_after_the_breaks_changed_in_a_fresh_process(
        breaks: tuple[Sandbox, Any]) -> None:
    """torch's caching precompile serves this call from its cache with the old value; the
    entry's frame guards on it, so the frame is compiled live, published, and served to
    the next process with that value."""
    box, _ = breaks
    run = RUN.format(backend="inductor", branches=("pos",))
    changed = box.run(run, CC_TEST_SCALE="5")
    assert changed["events"] == ["hit"], changed.value
    assert changed["results"]["pos"][0], changed.value          # eager's result
    assert any(n[1] == 1 for n in changed["served"].values()), changed["served"]
    again = box.run(run, CC_TEST_SCALE="5")
    assert again["results"] == changed["results"]
    assert again["dynamo"] is False, "the published frame variant should serve it"
    assert any(n[0] == 1 and n[1] == 0 for n in again["served"].values()), again["served"]
    # The function Dynamo guards by identity: another one there, eager's result.
    other = box.run(run, CC_TEST_ACT="sigmoid")
    assert other["results"]["pos"][0], other.value
    assert other["results"]["pos"][1] != changed["results"]["pos"][1]
    # A class attribute read after the breaks, in both branches' frames: the first call's
    # and the one the cold process compiled later (a frame variant).
    both = RUN.format(backend="inductor", branches=("pos", "neg"))
    offset = box.run(both, CC_TEST_OFFSET="7")
    assert all(ok for ok, _ in offset["results"].values()), offset.value
    stats = cachectl("stats", env=box.env())
    assert stats.returncode == 0 and "frame" in stats.stdout, stats.stdout


CALLEES = '''
import torch
from torch import nn


def helper(y):
    print("in helper")          # breaks inside a function the method calls
    return torch.relu(y) * 2


class Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        n = int(h.abs().sum().item() > 1)   # breaks inside a submodule's forward
        return h * (n + 1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.sub = Sub()

    def run(self, x):
        return helper(self.sub(self.lin(x))) * 3
'''

RUN_CALLEES = '''
import sys
import torch
from cachecompile import cache_compile
from cachecompile.errors import GraphBreakError
import callees

m = callees.Net().eval()
cached = cache_compile(m.run, fullgraph=False, backend="aot_eager")
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
with torch.no_grad():
    ok = [bool(torch.equal(cached(x * s), m.run(x * s))) for s in (1, 2)]
    refused = None
    if {strict}:
        try:
            cache_compile(m.run, backend="aot_eager")(x)
        except GraphBreakError as e:
            refused = str(e)
served = {{}}
for variants in cached._runners.values():
    for v in variants:
        if v.frames is not None:
            served.update({{k: list(n) for k, n in v.frames.served().items()}})
report({{"ok": ok, "events": [e[0] for e in cached.events], "served": served,
        "dynamo": "torch._dynamo" in sys.modules, "refused": refused}})
'''


def test_frames_of_called_functions_run_their_stored_code(tmp_path: Path) -> None:
    """A submodule's forward and a helper that break inside are frames Dynamo compiles on
    their own (callees): a warm process runs their stored code through Dynamo's run-only
    frame hook, without importing Dynamo. fullgraph=True there is torch.compile's error,
    never the graph-broken entry."""
    box = Sandbox(tmp_path)
    (box.root / "callees.py").write_text(CALLEES)
    cold = box.run(RUN_CALLEES.format(strict=False))
    assert cold["ok"] == [True, True] and cold["events"] == ["miss"], cold.value
    warm = box.run(RUN_CALLEES.format(strict=False))
    assert warm["ok"] == [True, True] and warm["events"] == ["hit"], warm.value
    assert warm["dynamo"] is False
    served = warm["served"]
    assert any(k.startswith("Sub.forward (") and n[0] == 2 for k, n in served.items()), served
    assert any(k.startswith("helper (") and n[0] == 2 for k, n in served.items()), served
    strict = box.run(RUN_CALLEES.format(strict=True))
    assert strict["refused"] and "broke the graph" in strict["refused"], strict.value


@pytest.mark.slow
def test_cachectl_shows_every_frame(breaks: tuple[Sandbox, Any]) -> None:
    box, _ = breaks
    env = box.env()
    ls = cachectl("ls", "--json", env=env)
    entries = {e["labels"].get("frames"): e["key"] for e in json.loads(ls.stdout)}
    assert "3" in entries and "+1" in entries, ls.stdout   # the entry, a frame variant
    # The frame variant of the other branch (another test of this module may have
    # published one for another value of model.SCALE into the same store, before this).
    variants = {e["key"]: cachectl("show", e["key"], env=env).stdout
                for e in json.loads(ls.stdout) if e["labels"].get("frames") == "+1"}
    entries["+1"] = next((k for k, text in variants.items() if "___stack0" in text),
                         entries["+1"])
    table = cachectl("ls", env=env).stdout
    assert "frames" in table.splitlines()[0], table
    show = cachectl("show", entries["3"], env=env).stdout
    assert "frames   3" in show and "resume function" in show, show
    assert "model.SCALE == 3" in show, show   # a frame's guard, in the user's terms
    program = cachectl("program", entries["3"], env=env).stdout
    for part in ("# ---- frame 1:", "# ---- frame 2 variant 0: guards",
                 "Dynamo's transformed bytecode", "# ---- graph 1:"):
        assert part in program, program
    # One frame alone: its guards and bytecode, no other frame's, not the method's own.
    one = cachectl("program", entries["3"], "--frame", "2", env=env).stdout
    assert "# ---- frame 2 variant 0: guards" in one, one
    assert "# ---- frame 1:" not in one and "the entry fits a call" not in one, one
    none = cachectl("program", entries["3"], "--frame", "9", env=env)
    assert none.returncode == 2 and "has no frame 9" in none.stderr, none.stderr
    variant = cachectl("show", entries["+1"], env=env).stdout
    assert "a variant of one frame" in variant, variant
    # The value it serves, as the signature's entry shows its frames' (a new user could
    # not tell which value a frame variant was for).
    assert re.search(r"\[0\] ___stack0 (>|<=) 0\.0", variant), variant
    assert "(+1 published after it: `cachectl ls --variants`)" in show, show
    explain = cachectl("explain", entries["3"], env=env).stdout
    assert ("is the only entry" in explain and "but for the frame variants published after it"
            in explain and "resume function" in explain), explain


RUN_LIVE = '''
import sys, warnings
import torch
import cachecompile.key.identity as identity
from cachecompile import cache_compile
import model

if {unportable}:
    # As if the function the frame after the breaks reads had no process-independent
    # identity: its guard cannot be stored.
    real = identity.identity
    identity.identity = lambda obj, *a, **k: None if obj is model.act else real(obj, *a, **k)
m = model.Net().eval()
cached = cache_compile(m.run, fullgraph=False, backend="aot_eager")
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2)) + 10
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with torch.no_grad():
        ok = [bool(torch.equal(cached(x), m.run(x))) for _ in range(2)]
served = {{}}
for variants in cached._runners.values():
    for v in variants:
        if v.frames is not None:
            served.update({{k: list(n) for k, n in v.frames.served().items()}})
report({{"ok": ok, "served": served, "dynamo": "torch._dynamo" in sys.modules,
        "warnings": [str(w.message) for w in caught if "cachecompile" in str(w.message)]}})
'''


def test_a_frame_whose_guards_cannot_be_stored_is_live_in_every_process(tmp_path: Path) -> None:
    """No guard is dropped: the frame is stored without a variant and the reason; each
    process compiles it live (named once, counted in cachectl stats), the others hit."""
    box = Sandbox(tmp_path)
    (box.root / "model.py").write_text(MODEL)
    cold = box.run(RUN_LIVE.format(unportable=True))
    assert cold["ok"] == [True, True], cold.value
    for _ in range(2):
        warm = box.run(RUN_LIVE.format(unportable=False))
        assert warm["ok"] == [True, True] and warm["dynamo"] is True, warm.value
        live = [k for k, n in warm["served"].items() if n[1] == 2]
        assert len(live) == 1, warm["served"]
        named = [w for w in warm["warnings"] if "compiled live in every process" in w]
        assert len(named) == 1 and "no process-independent form" in named[0], warm["warnings"]
    stats = cachectl("stats", env={**box.env(), "COLUMNS": "200"})
    # The resume function's name has the bytecode offset of the break (24 on 2.11 and 2.13,
    # 28 on 2.12).
    assert re.search(r"Net\.torch_dynamo_resume_in_run_at_\d+: live in every process",
                     stats.stdout), stats.stdout
