"""Custom Inductor passes keyed by what they do; fused custom operators in the program.

In-process: how passes are identified and refused. Fresh processes (slow, real Inductor):
the add + RMSNorm fusion of docs/passes.md, run as written there.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from ccutil import REPO, Sandbox
from tiny import Small
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

from cachecompile import ContractError, UnidentifiedPassError, cache_compile, store
from cachecompile.key.passes import PASS_HOOKS, identify, missing_operators, operators_in

SCALE = 2.0


def _make_pass(k: float) -> Any:
    def p(graph: torch.fx.Graph) -> None:
        graph.owning_module.k = k  # type: ignore[union-attr]

    return p


def scaled_pass(graph: torch.fx.Graph) -> None:
    graph.lint() if SCALE > 1 else None


class UuidPass(CustomGraphPass):
    def __init__(self, uid: Any) -> None:
        self.uid = uid

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> Any:
        return self.uid


class Opaque:
    def __call__(self, graph: torch.fx.Graph) -> None:
        pass


def _pattern_pass(scale: float, name: str = "p") -> PatternMatcherPass:
    def search(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * scale

    def replace(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2.0

    p = PatternMatcherPass(pass_name=name)
    register_replacement(search, replace, [torch.empty(2, 4)], fwd_only, p)
    return p


# -- identity --------------------------------------------------------------------------------
def test_functions_are_keyed_by_code_closure_and_globals(monkeypatch: pytest.MonkeyPatch) -> None:
    assert identify(_make_pass(1.0)) == identify(_make_pass(1.0))
    assert identify(_make_pass(1.0)) != identify(_make_pass(2.0))
    before = identify(scaled_pass)
    assert before["globals"] == {"SCALE": "2.0"}
    monkeypatch.setattr(__import__(__name__), "SCALE", 3.0)
    assert identify(scaled_pass) != before
    assert identify(functools.partial(_make_pass(1.0))) == identify(
        functools.partial(_make_pass(1.0)))


def test_custom_graph_pass_is_keyed_by_its_uuid() -> None:
    assert identify(UuidPass("v1")) == {"class": f"{__name__}.UuidPass", "uuid": "v1"}
    assert identify(UuidPass(b"\x01\x02")) == {"class": f"{__name__}.UuidPass", "uuid": "0102"}
    assert identify(UuidPass("v1")) != identify(UuidPass("v2"))
    with pytest.raises(UnidentifiedPassError, match="uuid\\(\\) returned None"):
        identify(UuidPass(None))
    with pytest.raises(UnidentifiedPassError, match="its address"):
        identify(UuidPass(object()))


def test_pattern_pass_rules_are_keyed_by_their_functions() -> None:
    a, b, c = _pattern_pass(2.0), _pattern_pass(2.0), _pattern_pass(3.0)
    assert identify(a.apply) == identify(b.apply)
    assert identify(a) == identify(a.apply)["of"]
    assert identify(a.apply) != identify(c.apply)  # the search function's closure differs
    rule = identify(a)["rules"][0]
    assert rule["kind"] == "ReplacementPatternEntry"
    assert set(rule["functions"]) == {"search_fn", "replace_fn", "extra_check"}
    assert rule["functions"]["search_fn"]["function"].endswith("search")
    # A pass under another name is another pass.
    assert identify(_pattern_pass(2.0, "other")) != identify(a)
    # Adding a rule changes it.
    register_replacement(lambda x: torch.sigmoid(x) * 3.0, lambda x: torch.sigmoid(x),
                         [torch.empty(2, 4)], fwd_only, b)
    assert identify(a) != identify(b)


def test_what_cannot_be_identified_is_refused() -> None:
    with pytest.raises(UnidentifiedPassError, match="no code of its own|cannot key"):
        identify(print.__call__)  # type: ignore[operator]  # a method-wrapper: no code
    with pytest.raises(UnidentifiedPassError, match="Logger"):
        identify(_make_pass(logging.getLogger("x")))  # type: ignore[arg-type]
    ok = identify(Opaque())  # a callable of a user class: its code and state
    assert ok["class"].endswith("Opaque")
    stateful = Opaque()
    stateful.__dict__["log"] = logging.getLogger("y")
    with pytest.raises(UnidentifiedPassError, match="Logger"):
        identify(stateful)


def test_cache_compile_checks_passes_when_called(tmp_path: Path) -> None:
    m = Small()
    p = _make_pass(1.0)
    with pytest.raises(ContractError, match="unknown pass hook 'post_grad_pass'"):
        cache_compile(m.run, passes={"post_grad_pass": p})
    with pytest.raises(ContractError, match="both in config and in passes"):
        cache_compile(m.run, config={"post_grad_custom_post_pass": p},
                      passes={"post_grad_custom_post_pass": _make_pass(2.0)})
    with pytest.raises(ContractError, match="does not run them"):
        cache_compile(m.run, backend="aot_eager", passes={"post_grad_custom_post_pass": p})
    with pytest.raises(UnidentifiedPassError, match="post_grad_custom_pre_pass"):
        cache_compile(m.run, passes={"post_grad_custom_pre_pass": UuidPass(None)})
    with pytest.raises(UnidentifiedPassError, match=r"config\['joint_custom_post_pass'\]\[1\]"):
        cache_compile(m.run, config={"joint_custom_post_pass": [p, _make_pass(
            logging.getLogger("z"))]})  # type: ignore[arg-type]
    assert "pre_grad_custom_pass" in PASS_HOOKS
    # Passes given either way make the same key.
    a = cache_compile(m.run, cache_dir=tmp_path, passes={"post_grad_custom_post_pass": p})
    b = cache_compile(m.run, cache_dir=tmp_path, config={"post_grad_custom_post_pass": p})
    c = cache_compile(m.run, cache_dir=tmp_path,
                      passes={"post_grad_custom_post_pass": _make_pass(2.0)})
    sig = ("sig",)
    assert a.factors(sig) == b.factors(sig) != c.factors(sig)


def test_operators_in_a_program() -> None:
    src = ("aten = torch.ops.aten\nalloc_from_pool = torch.ops.inductor._alloc_from_pool\n"
           "    buf1 = torch.ops.demo.fused_add_rms_norm.default(buf0, a, b)\n"
           "    buf2 = torch.ops.aten.mm.default(a, b)\n")
    assert operators_in(src) == ["demo::fused_add_rms_norm", "inductor::_alloc_from_pool"]
    assert missing_operators(["demo_never_defined::op", "inductor::_alloc_from_pool",
                              "aten::mm"]) == ["demo_never_defined::op"]


# -- the fusion of docs/passes.md, in fresh processes ------------------------------------------
def docs_fusion_module() -> str:
    """The fusion.py code block of docs/passes.md, as written there."""
    text = (REPO / "docs" / "passes.md").read_text()
    blocks = re.findall(r"```python\n(# fusion\.py\n.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/passes.md must hold one fusion.py block"
    return blocks[0]


RUN_BLOCK = """
import sys, warnings, torch
{imports}
import fusion
b = fusion.Block().eval()
x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
r = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = b(x, r)
report({{"events": [e[0] for e in b.cached.events],
         "ok": bool(torch.allclose(out, b.forward_impl(x, r), atol=1e-5)),
         "warnings": [f"{{w.category.__name__}}: {{w.message}}" for w in caught
                      if "cachecompile" in str(w.message) or "Cache" in w.category.__name__]}})
"""


def _programs(box: Sandbox) -> dict[str, dict[str, Any]]:
    """Entry key -> {"operators": ..., "program": text} for Block.forward_impl entries."""
    st = store.open_store(box.store)
    out: dict[str, dict[str, Any]] = {}
    for info in st.entries():
        if info.labels.get("function") != "forward_impl":
            continue
        m = st.manifest(info.key)
        text = (st.maintenance().entry_dir(info.key) / "data" / "program.py").read_text()
        out[info.key] = {"operators": m["meta"]["program"]["operators"], "program": text,
                         "config": json.dumps(m["factors"]["config"])}
    return out


FUSED_CALL = "torch.ops.demo.fused_add_rms_norm.default("


@pytest.mark.slow
def test_docs_fusion_edited_pass_is_a_miss_unchanged_is_a_hit(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    fusion_src = docs_fusion_module()
    (box.root / "fusion.py").write_text(fusion_src)
    run = RUN_BLOCK.format(imports="")
    cold = box.run(run)
    assert (cold["events"], cold["ok"], cold["warnings"]) == (["miss"], True, [])
    (entry,) = _programs(box).values()
    assert FUSED_CALL in entry["program"], "the pass did not fuse add + RMSNorm"
    assert "demo::fused_add_rms_norm" in entry["operators"]

    warm = box.run(run)
    assert (warm["events"], warm["ok"], warm["warnings"]) == (["hit"], True, [])
    assert len(_programs(box)) == 1

    # The replacement function is edited (it no longer calls the fused op): a new key, a
    # compile, and a program without the fused call.
    edited = fusion_src.replace(
        "    return torch.ops.demo.fused_add_rms_norm(x, residual, weight)",
        "    return add_rms_norm(x, residual, weight) + 0.0")
    assert edited != fusion_src
    (box.root / "fusion.py").write_text(edited)
    after = box.run(run)
    assert (after["events"], after["ok"]) == (["miss"], True)
    programs = _programs(box)
    assert len(programs) == 2
    new = [p for p in programs.values() if p["program"] != entry["program"]]
    assert len(new) == 1 and FUSED_CALL not in new[0]["program"]
    assert "demo::fused_add_rms_norm" not in new[0]["operators"]
    # Back to the original pass: the first entry serves it again.
    (box.root / "fusion.py").write_text(fusion_src)
    assert box.run(run)["events"] == ["hit"]


NO_PASS = """
import torch
import fusion
from cachecompile import cache_compile
b = fusion.Block().eval()
plain = cache_compile(b.forward_impl)
x, r = torch.randn(4, 64), torch.randn(4, 64)
out = plain(x, r)
report({"events": [e[0] for e in plain.events]})
"""


@pytest.mark.slow
def test_docs_fusion_changes_the_generated_program(tmp_path: Path) -> None:
    """Without the pass the same method has no fused call (docs/passes.md says so)."""
    box = Sandbox(tmp_path)
    (box.root / "fusion.py").write_text(docs_fusion_module())
    assert box.run(NO_PASS)["events"] == ["miss"]
    (entry,) = _programs(box).values()
    assert "torch.ops.demo" not in entry["program"]
    assert "demo::fused_add_rms_norm" not in entry["operators"]
    assert "rsqrt" in entry["program"]  # the norm is Inductor's own kernel


# A pass whose fused operator lives in its own module, imported by the replacement only
# when a compile needs it: a warm process may well not have registered it.
LAZY_OPS = '''
import torch

@torch.library.custom_op("demo_lazy::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2.0

@scaled_tanh.register_fake
def _(x):
    return torch.empty_like(x)
'''
LAZY_FUSION = '''
import torch
from torch import nn
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement
from cachecompile import cache_compile

def search(x):
    return torch.tanh(x) * 2.0

def replace(x):
    import lazy_ops  # registers demo_lazy::scaled_tanh
    return torch.ops.demo_lazy.scaled_tanh(x)

fusion = PatternMatcherPass(pass_name="lazy")
register_replacement(search, replace, [torch.empty(2, 8)], fwd_only, fusion)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.cached = cache_compile(self.forward_impl,
                                    passes={"post_grad_custom_post_pass": fusion.apply})
    def forward_impl(self, x):
        return torch.tanh(self.proj(x)) * 2.0
'''
RUN_LAZY = """
import sys, warnings, torch
if {ops}:
    import lazy_ops
import lazy_fusion
b = lazy_fusion.Block().eval()
x = torch.randn(4, 8)
registered_before = hasattr(torch.ops.demo_lazy, "scaled_tanh")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = b.cached(x)
report({{"events": [e[0] for e in b.cached.events], "before": registered_before,
         "ok": bool(torch.allclose(out, b.forward_impl(x), atol=1e-6)),
         "warnings": [str(w.message) for w in caught if "cachecompile" in str(w.message)]}})
"""


@pytest.mark.slow
def test_a_missing_custom_operator_is_a_miss_that_names_it(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    (box.root / "lazy_ops.py").write_text(LAZY_OPS)
    (box.root / "lazy_fusion.py").write_text(LAZY_FUSION)
    cold = box.run(RUN_LAZY.format(ops=True))
    assert (cold["events"], cold["ok"]) == (["miss"], True)
    (entry,) = [p for p in _programs(box).values()]
    assert "demo_lazy::scaled_tanh" in entry["operators"]

    # The operator is not registered when the entry is looked up: a miss naming it, a
    # correct result from a live compile, no crash, and no second entry.
    without = box.run(RUN_LAZY.format(ops=False))
    assert without["before"] is False
    assert (without["events"], without["ok"]) == (["live"], True), without.stderr[-3000:]
    assert len(without["warnings"]) == 1
    assert "demo_lazy::scaled_tanh" in without["warnings"][0]
    assert "not registered" in without["warnings"][0]
    assert "AttributeError" not in without.stderr
    assert len(_programs(box)) == 1

    # Registered again: the entry is a hit.
    again = box.run(RUN_LAZY.format(ops=True))
    assert (again["events"], again["ok"], again["warnings"]) == (["hit"], True, [])
