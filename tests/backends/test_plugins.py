"""Backends a user brings: a vendor's adapter registered as a plugin (an installed
distribution's entry point, or ``backends.register``), and a bare backend callable.

The plugin here lives outside cachecompile: the test writes a package and its
``.dist-info`` (with ``entry_points.txt``) into a directory on the child's path, which is
what ``pip install`` leaves behind. It runs custom FX fusion passes switched by a global
config object (MindIE SD's style), then hands the graph to the built-in aot_eager adapter
for a replayable program.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from ccutil import Sandbox
from tiny import Small

from cachecompile import backends, cache_compile
from cachecompile.backends.bare import BareAdapter, dump_graph, rebuild, structure
from cachecompile.errors import ContractError

VENDOR = '''
"""A vendor's fusion backend for cachecompile (test-only distribution)."""
import os

import torch

from cachecompile import backends


class FusionConfig:
    """Set before compiling, as MindIE SD's CompilationConfig is."""
    enable_fast_gelu = True
    enable_mul_add = True


CONFIG = FusionConfig()


def _note(what):
    path = os.environ.get("VENDOR_LOG")
    if path:
        with open(path, "a") as f:
            f.write(what + "\\n")


def fast_gelu(graph):
    for n in graph.nodes:
        if n.op == "call_function" and n.target in (torch._C._nn.gelu,
                                                      torch.nn.functional.gelu):
            n.kwargs = {**n.kwargs, "approximate": "tanh"}


def mul_add(graph):
    import operator
    for n in list(graph.nodes):
        if (n.op == "call_function" and n.target is operator.add
                and isinstance(n.args[0], torch.fx.Node)
                and n.args[0].op == "call_function" and n.args[0].target is operator.mul
                and len(n.args[0].users) == 1 and isinstance(n.args[1], torch.fx.Node)):
            mul = n.args[0]
            with graph.inserting_before(n):
                fused = graph.call_function(torch.addcmul, (n.args[1], *mul.args))
            n.replace_all_uses_with(fused)
            graph.erase_node(n)
            graph.erase_node(mul)


class FusionAdapter:
    name = "vendor_fusion"
    shares_graphs = False

    def __init__(self):
        self.inner = backends.get("aot_eager")
        self.torch_parts = self.inner.torch_parts

    def factors(self, options):
        return {"fusion": {"fast_gelu": CONFIG.enable_fast_gelu,
                           "mul_add": CONFIG.enable_mul_add}, "version": "1.0"}

    def compile(self, gm, example_inputs, options, decompositions):
        _note("compile")
        if CONFIG.enable_fast_gelu:
            fast_gelu(gm.graph)
        if CONFIG.enable_mul_add:
            mul_add(gm.graph)
        gm.recompile()
        return self.inner.compile(gm, example_inputs, {}, decompositions)

    def load(self, files, meta):
        _note("load")
        return self.inner.load(files, meta)

    def plain_backend(self, options, decompositions):
        return (lambda gm, ex: self.compile(gm, ex, {}, decompositions).live), None


ADAPTER = FusionAdapter()
'''

CHILD = """
import logging, os, sys, torch
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
if os.environ.get("FAST_GELU") == "0":
    import vendor_fusion
    vendor_fusion.CONFIG.enable_fast_gelu = False
from cachecompile import cache_compile

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 32)
        self.scale = torch.nn.Parameter(torch.rand(32))
        self.cached = cache_compile(self._run, backend="vendor_fusion")
    def _run(self, x, bias):
        return torch.nn.functional.gelu(self.up(x)) * self.scale + bias

m = Block().eval()
x, bias = torch.randn(3, 16), torch.randn(3, 32)
with torch.no_grad():
    out = m.cached(x, bias)
    exact = m._run(x, bias)
report({"event": m.cached.events[-1][0], "dynamo": "torch._dynamo" in sys.modules,
        "out": out.flatten().tolist(),
        "tanh_gelu": not torch.allclose(out, exact, atol=1e-6),
        "close_to_eager": bool(torch.allclose(out, exact, atol=1e-2))})
"""


def install_vendor(root: Path) -> None:
    """What ``pip install vendor-fusion`` leaves: the package and its dist-info."""
    (root / "vendor_fusion").mkdir(parents=True)
    (root / "vendor_fusion" / "__init__.py").write_text(VENDOR)
    info = root / "vendor_fusion-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vendor-fusion\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[cachecompile.backends]\nvendor_fusion = vendor_fusion:ADAPTER\n")


@pytest.mark.slow
def test_a_plugin_backend_is_cached_across_processes(tmp_path: Path) -> None:
    box = Sandbox(tmp_path / "box")
    install_vendor(box.root)
    log = tmp_path / "vendor.log"
    cold = box.run(CHILD, VENDOR_LOG=str(log))
    assert cold["event"] == "miss" and cold["tanh_gelu"] and cold["close_to_eager"]
    assert log.read_text().split() == ["compile"]
    log.unlink()
    warm = box.run(CHILD, VENDOR_LOG=str(log))
    # A hit: no trace (Dynamo never imported), no compile, the plugin only loads.
    assert (warm["event"], warm["dynamo"]) == ("hit", False), warm.stderr[-3000:]
    assert log.read_text().split() == ["load"]
    assert warm["out"] == cold["out"]
    # One of its switches off: another program, a miss that names the switch.
    off = box.run(CHILD, VENDOR_LOG=str(log), FAST_GELU="0")
    assert off["event"] == "miss" and not off["tanh_gelu"]
    miss_line = next(ln for ln in off.stderr.splitlines() if "cachecompile miss" in ln)
    assert "fast_gelu" in miss_line, miss_line


def test_register_takes_an_adapter_or_where_to_import_it(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    inner = backends.get("aot_eager")

    class Mine:
        name = "mine"
        shares_graphs = False
        torch_parts = inner.torch_parts
        factors = inner.factors
        compile = inner.compile
        load = inner.load
        plain_backend = inner.plain_backend

    backends.register("mine", Mine())  # type: ignore[arg-type]
    assert backends.get("mine").name == "mine" and "mine" in backends.names()
    m = Small()
    c = cache_compile(m.run, backend="mine", cache_dir=str(tmp_path / "c"))
    assert c.spec.adapter.name == "mine"
    with pytest.raises(TypeError, match="lacks .*compile"):
        backends.register("broken", object())  # type: ignore[arg-type]
    # A module reference whose adapter calls itself otherwise: refused, saying both.
    backends.register("alias", "cachecompile.backends.aot_eager:ADAPTER")
    with pytest.raises(TypeError, match="calls itself 'aot_eager'"):
        backends.get("alias")
    with pytest.raises(ContractError, match="unknown backend 'nope'.*entry-point"):
        cache_compile(m.run, backend="nope")


def _rewrite_backend(gm: Any, example_inputs: list[Any]) -> Any:
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.tanh:
            n.target = torch.sigmoid
    gm.recompile()
    return gm.forward


def test_a_bare_backend_is_keyed_by_what_it_does() -> None:
    a = BareAdapter(_rewrite_backend)
    assert a.factors({}) == {"callable": f"{__name__}._rewrite_backend",
                             "identity": a.identity}

    def other(gm: Any, ex: list[Any]) -> Any:
        return gm.forward

    assert BareAdapter(other).identity != a.identity

    class Holder:
        def __init__(self) -> None:
            self.lock = threading.Lock()  # no identity: the key could not tell it apart

        def __call__(self, gm: Any, ex: list[Any]) -> Any:
            return gm.forward

    with pytest.raises(ContractError, match="backend callable"):
        cache_compile(Small().run, backend=Holder())
    with pytest.raises(ContractError, match="takes no config"):
        cache_compile(Small().run, backend=_rewrite_backend, config={"x": 1})


def test_the_stored_graph_rebuilds_node_for_node() -> None:
    seen: list[Any] = []

    def grab(gm: Any, ex: list[Any]) -> Any:
        seen.append((json.loads(json.dumps(dump_graph(gm.graph))), structure(gm.graph)))
        return gm.forward

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.nn.functional.gelu(self.lin(x)).view(x.shape[0], -1)
            z = torch.cat([y, x], -1)  # a list argument
            z = z.view(z.size())  # a torch.Size argument
            return y * 2 + x.shape[0] + z[:, :8], y[:, :2].clone()

    torch._dynamo.reset()
    torch.compile(M(), backend=grab, dynamic=True)(torch.randn(4, 8))
    doc, shape = seen[0]
    rebuilt = rebuild(doc, {})
    assert structure(rebuilt.graph) == shape
    assert [n.name for n in rebuilt.graph.nodes] == [r["name"] for r in doc["nodes"]]


CHILD_BARE = """
import os, sys, torch, transformers
from cachecompile import cache_compile

CALLS = []

def silu_as_sigmoid_mul(gm, example_inputs):
    # A vendor's pattern pass: SiLU as x * sigmoid(x), then the graph runs as it is.
    CALLS.append(1)
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in (torch.nn.functional.silu,
                                                      torch._C._nn.silu):
            with gm.graph.inserting_before(n):
                sig = gm.graph.call_function(torch.sigmoid, (n.args[0],))
                mul = gm.graph.call_function(torch.mul, (n.args[0], sig))
            n.replace_all_uses_with(mul)
            gm.graph.erase_node(n)
    gm.recompile()
    return gm.forward

class Serve(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64)
        self.lm = transformers.LlamaForCausalLM(cfg).eval()
        self.cached = cache_compile(self._logits, backend=silu_as_sigmoid_mul)
    def _logits(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits

s = Serve()
ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
import torch._dynamo.utils as du
with torch.no_grad():
    out = s.cached(ids)
    traced = du.counters["stats"]["unique_graphs"]
    ids2 = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(2))
    out2 = s.cached(ids2)
    ref = torch.compile(s._logits, backend=silu_as_sigmoid_mul, dynamic=True)
    r1, r2 = ref(ids), ref(ids2)
report({"event": s.cached.events[-1][0], "traced": traced, "calls": len(CALLS),
        "same": bool(torch.equal(out, r1) and torch.equal(out2, r2))})
"""


@pytest.mark.slow
def test_a_bare_backend_callable_skips_the_trace_in_a_warm_process(tmp_path: Path) -> None:
    box = Sandbox(tmp_path / "box")
    cold = box.run(CHILD_BARE)
    # Cold: Dynamo traced, the backend ran (once for the cache, once for torch.compile).
    assert cold["event"] == "miss" and cold["traced"] >= 1 and cold["same"], cold.value
    warm = box.run(CHILD_BARE)
    # Warm: no trace; the backend ran on the rebuilt graph, and the results are
    # torch.compile's with the same backend, exactly, at two sequence lengths.
    assert (warm["event"], warm["traced"]) == ("hit", 0), warm.stderr[-3000:]
    # The backend ran once per length (a dynamic graph's sizes: see the tracing test
    # below), and once for the torch.compile it is compared with.
    assert warm["calls"] == 3 and warm["same"], warm.value
    manifest = next((box.store / "v1").rglob("manifest.json"))
    factors = json.loads(manifest.read_text())["factors"]
    assert "silu_as_sigmoid_mul" in json.dumps(factors)


class _Patterns:
    enable_fast_gelu = True


class _CompilationConfig:
    """MindIE SD's style: a global settings object with nested switches."""

    def __init__(self) -> None:
        self.fusion_patterns = _Patterns()
        self.aclgraph_only = False


SETTINGS = _CompilationConfig()


def _reads_settings(gm: Any, example_inputs: list[Any]) -> Any:
    if SETTINGS.fusion_patterns.enable_fast_gelu and not SETTINGS.aclgraph_only:
        pass
    return gm.forward


def test_a_backend_is_keyed_by_the_settings_object_it_reads() -> None:
    seen = {BareAdapter(_reads_settings).identity}
    SETTINGS.fusion_patterns.enable_fast_gelu = False  # an instance's switch
    seen.add(BareAdapter(_reads_settings).identity)
    SETTINGS.aclgraph_only = True
    seen.add(BareAdapter(_reads_settings).identity)
    try:
        _Patterns.enable_fast_gelu = False  # a class default, through a new instance
        SETTINGS.fusion_patterns = _Patterns()
        SETTINGS.aclgraph_only = False
        assert BareAdapter(_reads_settings).identity in seen  # same values, same key
        assert len(seen) == 3
        SETTINGS.aclgraph_only = threading.Lock()  # type: ignore[assignment]  # no identity: refused, not ignored
        with pytest.raises(ContractError, match="_CompilationConfig holds _thread.lock"):
            BareAdapter(_reads_settings)
    finally:
        _Patterns.enable_fast_gelu = True
        SETTINGS.fusion_patterns = _Patterns()
        SETTINGS.aclgraph_only = False


def test_registering_an_adapter_under_another_name_is_refused() -> None:
    aot = backends.get("aot_eager")
    with pytest.raises(TypeError, match="calls itself 'aot_eager'"):
        backends.register("renamed", aot)
    impostor = type("Impostor", (), {k: getattr(aot, k) for k in (
        "shares_graphs", "torch_parts", "factors", "compile", "load", "plain_backend")})()
    impostor.name = "inductor"
    with pytest.raises(ContractError, match="registered already"):
        cache_compile(Small().run, backend=impostor)


def test_torch_own_backend_objects_and_what_a_backend_reads_are_keyed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm: Any, ex: list[Any]) -> Any:
        return gm.forward

    # aot_autograd(...)'s object: torch's class (the version pins it), keyed by what it holds.
    a = BareAdapter(aot_autograd(fw_compiler=fw))
    assert a.qualname.endswith("AotAutograd instance") and a.identity
    # A helper module the backend calls into, and a settings dict it reads.
    helper = tmp_path / "bk_helper.py"
    helper.write_text("def rewrite(gm):\n    return gm\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import bk_helper

    ns: dict[str, Any] = {"bk_helper": bk_helper, "SETTINGS": {"fast": True}}
    exec("def backend(gm, ex):\n    bk_helper.rewrite(gm)\n"
         "    return gm.forward if SETTINGS['fast'] else gm\n", ns)
    first = BareAdapter(ns["backend"]).identity
    ns["SETTINGS"]["fast"] = False
    second = BareAdapter(ns["backend"]).identity
    helper.write_text("def rewrite(gm):\n    return None\n")
    third = BareAdapter(ns["backend"]).identity
    assert len({first, second, third}) == 3


def test_the_weights_digest_reads_every_tensor() -> None:
    from cachecompile.key.factors import state_digest

    m = torch.nn.Linear(2, 2)
    m.register_buffer("scale", torch.tensor(2.0))  # 0-d: CLIP's logit_scale
    m.register_buffer("mask", torch.tensor([True, False]))
    before = state_digest(m)
    with torch.no_grad():
        m.scale.fill_(3.0)  # type: ignore[operator]
    assert state_digest(m) != before


CHILD_TRACING = """
import torch
from torch._dynamo.backends.common import aot_autograd
from cachecompile import cache_compile

def fw(gm, example_inputs):
    return gm.forward

_aot = aot_autograd(fw_compiler=fw)

def tracing_backend(gm, example_inputs):  # traces the graph again: specialises to inputs
    return _aot(gm, example_inputs)

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.cached = cache_compile(self._run, backend=tracing_backend)
    def _run(self, x):
        return torch.relu(self.lin(x)).sum(-1) * x.shape[0]

m = M().eval()
ok = []
with torch.no_grad():
    for rows in (2, 5, 2, 7):
        x = torch.randn(rows, 8)
        ok.append(bool(torch.allclose(m.cached(x), m._run(x), atol=1e-6)))
report({"events": [e for e, _ in m.cached.events], "ok": ok})
"""


@pytest.mark.slow
def test_a_tracing_backend_gets_each_size_of_a_dynamic_graph(tmp_path: Path) -> None:
    # aot_autograd / compile_fx trace the graph they are given: handed plain ints and
    # real tensors in a warm process, their output held for one size only ("size of
    # tensor a (9) must match ... (16)" on the next). Each set of sizes gets its own.
    box = Sandbox(tmp_path / "box")
    cold = box.run(CHILD_TRACING)
    assert cold["events"] == ["miss"] and all(cold["ok"]), cold.value
    warm = box.run(CHILD_TRACING)
    assert warm["events"] == ["hit"] and all(warm["ok"]), (warm.value, warm.stderr[-2000:])
    assert "CacheFaultWarning" not in warm.stderr, warm.stderr[-2000:]
