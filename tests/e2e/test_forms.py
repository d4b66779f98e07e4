"""Every form of cache_compile, one semantics (issue 34): a module, a decorator with and
without arguments on a class-body method, a decorated nn.Module class, a plain function;
torch.compile's mode= / options= / fullgraph=; what stays out is refused by name. The
module form runs the forward the module has at each call, as torch.compile(module) does
(issue 47).

The fresh-process claims share one cold and one warm run per backend (module-scoped
fixtures): the inductor run has the compiler as its subject (empty Inductor dirs, a
logging g++), the aot_eager run holds code this project did not write (diffusers' Flux
transformer compiled whole and as repeated blocks, transformers' Llama with its decoder
layer class decorated, through ``generate()``).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from ccutil import Sandbox
from torch import nn

from cachecompile import (
    CachedModule,
    ContractError,
    IgnoredArgumentWarning,
    cache_compile,
    compile_repeated_blocks,
)
from cachecompile.forms import CachedMethod

# -- the user's code, as a module of the child processes ---------------------------------
USER = '''
import torch
from torch import nn
from cachecompile import cache_compile

SCALE = 0.5


class Mlp(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.fc1 = nn.Linear(dim, 32)
        self.fc2 = nn.Linear(32, dim)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Static(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    @cache_compile(dynamic=False)
    def forward(self, x):
        return torch.tanh(self.lin(x)) * 2


class Bare(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    @cache_compile
    def forward(self, x):
        return torch.sigmoid(self.lin(x)) - 1


@cache_compile(dynamic=False, mode="max-autotune-no-cudagraphs")
class Whole(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) + 1


def plain(x, y):
    return torch.sin(x) * SCALE + torch.cos(y)


cached_plain = cache_compile(plain)
'''

INDUCTOR = '''
import sys, torch, warnings
warnings.simplefilter("ignore")
import user
from cachecompile import cache_compile

torch.manual_seed(0)
mlp, st, bare, whole = user.Mlp().eval(), user.Static().eval(), user.Bare().eval(), user.Whole().eval()
module = cache_compile(mlp)
g = torch.Generator().manual_seed(1)
x = torch.randn(4, 16, generator=g)
diffs, events = {}, {}

def check(name, got, want):
    diffs[name] = float((got - want).abs().max())
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), name

with torch.no_grad():
    check("module", module(x), mlp.forward(x))
    check("decorator_args", st(x), torch.tanh(st.lin(x)) * 2)
    check("decorator_bare", bare(x), torch.sigmoid(bare.lin(x)) - 1)
    check("class", whole(x), whole.lin(x) + 1)
    # A serving loop: batches of several sizes. A plain function takes torch.compile's
    # default (dynamic=None): static for the first size, dynamic once the size changes,
    # then one entry serves every size.
    for i, rows in enumerate((2, 3, 5, 3, 2)):
        a = torch.randn(rows, 16, generator=g)
        b = torch.randn(rows, 16, generator=g)
        check(f"plain{i}", user.cached_plain(a, b), user.plain(a, b))
for name, fn in [("module", module.cached_forward), ("decorator_args", st.forward),
                 ("decorator_bare", bare.forward), ("class", whole.forward),
                 ("plain", user.cached_plain)]:
    events[name] = [e for e, _ in fn.events]
report({"events": events, "diffs": diffs, "dynamo": "torch._dynamo" in sys.modules,
        "inductor": "torch._inductor" in sys.modules})
'''

FOREIGN = '''
import sys, torch, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {tests!r})
from cachecompile import cache_compile, compile_repeated_blocks
from diffusers import FluxTransformer2DModel
import transformers
from transformers.models.llama import modeling_llama
from zoo import models as zoo

def flux(layers):
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=layers,
        num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4)).eval()

g = torch.Generator().manual_seed(1)
inp = dict(hidden_states=torch.randn(1, 16, 4, generator=g),
           encoder_hidden_states=torch.randn(1, 5, 16, generator=g),
           pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.tensor([0.5]),
           img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3), return_dict=False)
cfg = zoo.llm_config("llama")
ids = zoo.tokens(2, 7)
out = {{}}
with torch.no_grad():
    f = flux(1)
    want = f(**inp)[0]
    whole = cache_compile(f, backend="aot_eager")        # diffusers' habit: the component
    out["flux_whole"] = bool(torch.allclose(whole(**inp)[0], want, atol=1e-5))
    out["flux_whole_events"] = [e for e, _ in whole.events]
    out["flux_config"] = whole.config.num_layers          # attributes reach the original
    f2 = flux(4)
    want2 = f2(**inp)[0]
    group = compile_repeated_blocks(f2, backend="aot_eager")   # its _repeated_blocks
    out["flux_blocks"] = bool(torch.allclose(f2(**inp)[0], want2, atol=1e-5))
    out["flux_blocks_loaded"] = [group.loads, group.reuses]

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    want_logits = ref(input_ids=ids, use_cache=False).logits
    want_gen = ref.generate(ids, max_new_tokens=3, do_sample=False)
    cache_compile(modeling_llama.LlamaDecoderLayer, backend="aot_eager")   # the class
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    out["llama"] = bool(torch.allclose(m(input_ids=ids, use_cache=False).logits, want_logits,
                                       atol=1e-5))
    out["llama_generate"] = bool(torch.equal(m.generate(ids, max_new_tokens=3, do_sample=False),
                                             want_gen))
    out["llama_events"] = sorted({{e for layer in m.model.layers for e, _ in layer.forward.events}})
report(out)
'''


@pytest.fixture(scope="module")
def inductor_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, int, int]:
    # The compiler is the subject: empty Inductor dirs for each run (ccutil.py).
    box = Sandbox(tmp_path_factory.mktemp("forms_inductor"), fresh_inductor=True)
    (box.root / "user.py").write_text(USER)
    cold = box.run(INDUCTOR)
    cold_gxx = box.compiler_calls()
    box.reset_compiler_log()
    warm = box.run(INDUCTOR)
    return cold, warm, cold_gxx, box.compiler_calls()


@pytest.fixture(scope="module")
def foreign_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    box = Sandbox(tmp_path_factory.mktemp("forms_foreign"))
    code = FOREIGN.format(tests=str(Path(__file__).resolve().parent.parent))
    return box.run(code), box.run(code)


FORMS = ("module", "decorator_args", "decorator_bare", "class", "plain")


@pytest.mark.slow
def test_every_form_cold_then_warm_compiles_nothing(inductor_runs: Any) -> None:
    cold, warm, cold_gxx, warm_gxx = inductor_runs
    # dynamic=None for the plain function (torch.compile's default): the first size static,
    # then dynamic from the second size on, as torch.compile's automatic dynamic shapes.
    assert cold["events"] == {**{f: ["miss"] for f in FORMS[:4]}, "plain": ["miss", "miss"]}, \
        cold.value
    assert cold_gxx > 0, "the cold run should have built kernels"
    # A fresh process: every form loads its entries, calls no compiler, imports no Dynamo
    # or Inductor, and gives the cold run's (eager-checked) results.
    assert warm["events"] == {**{f: ["hit"] for f in FORMS[:4]}, "plain": ["hit", "hit"]}, \
        warm.value
    assert warm_gxx == 0
    assert (warm["dynamo"], warm["inductor"]) == (False, False)
    assert warm["diffs"] == cold["diffs"]


@pytest.mark.slow
def test_code_we_did_not_write_cold_then_warm(foreign_runs: Any) -> None:
    cold, warm = foreign_runs
    for run in (cold, warm):
        assert run["flux_whole"] and run["flux_blocks"], run.value
        assert run["llama"] and run["llama_generate"], run.value
        assert run["flux_config"] == 1
    assert cold["flux_whole_events"] == ["miss"] and warm["flux_whole_events"] == ["hit"]
    # compile_repeated_blocks takes torch.compile's default (dynamic=None, as block.compile()
    # does): static entries, one for the double blocks and one for the single block. A warm
    # process loads those 2 entries once; the other 3 double blocks run the entry another
    # block loaded, after its guards held for them. (Under dynamic=True the first double
    # block, whose inputs are no views, needed a variant of its own: [3, 2].)
    assert warm["flux_blocks_loaded"] == [2, 3], warm.value
    assert warm["llama_events"] == ["hit"], warm.value


# -- the module form follows its forward, as torch.compile(module) does ----------------------
FOLLOW = '''
import functools, os, types, torch
from torch import nn
from cachecompile import cache_compile

backend = os.environ["FF_BACKEND"]


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def patched(self, x):
    return torch.tanh(self.lin(x)) * 3


def add_hook(module):
    """accelerate's add_hook_to_module, in short: a partial over a closure, on the instance."""
    old = module.forward

    def new_forward(module, *args, **kwargs):
        return module._old_forward(*args, **kwargs) - 7

    module._old_forward = old
    module.forward = functools.update_wrapper(functools.partial(new_forward, module), old)


x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
out = {}


def check(name, c, plain, m):
    got, want = c(x), plain(x)
    out[name] = {"as_torch_compile": bool(torch.allclose(got, want, atol=1e-5)),
                 "eager": bool(torch.allclose(got, m(x), atol=1e-5)),
                 "event": c.events[-1][0]}


with torch.no_grad():
    m = Mlp().eval()
    c = cache_compile(m, backend=backend)
    plain = torch.compile(m, backend=backend, fullgraph=True)   # the spec, beside it
    check("class", c, plain, m)
    m.forward = types.MethodType(patched, m)                    # a hand patch
    check("patched", c, plain, m)
    del m.forward                                               # removed: the class's again
    check("removed", c, plain, m)
    add_hook(m)
    check("hooked", c, plain, m)
    del m.forward
    check("unhooked", c, plain, m)
    # Wrapped when the forward was replaced already.
    m2 = Mlp().eval()
    add_hook(m2)
    check("hooked_before", cache_compile(m2, backend=backend), torch.compile(m2, backend=backend), m2)
report(out)
'''


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_module_form_follows_a_replaced_forward(tmp_path: Path, backend: str) -> None:
    box = Sandbox(tmp_path)
    cold = box.run(FOLLOW, FF_BACKEND=backend).value
    warm = box.run(FOLLOW, FF_BACKEND=backend).value
    for run in (cold, warm):   # within one process, and in a fresh one
        bad = {k: r for k, r in run.items() if not (r["as_torch_compile"] and r["eager"])}
        assert not bad, bad
    assert cold["class"]["event"] != "hit" and cold["patched"]["event"] != "hit", cold
    assert cold["hooked"]["event"] != "hit", cold
    # Each forward is cached under its own code: a fresh process loads every one.
    assert {r["event"] for r in warm.values()} == {"hit"}, warm


# -- in process: what each form is, and what stays out -----------------------------------
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.note = "original"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


def fn(x: torch.Tensor) -> torch.Tensor:
    return x + 1



def test_module_form_is_like_optimized_module(cache_dir: Path) -> None:
    m = Tiny().eval()
    c = cache_compile(m, backend="aot_eager", cache_dir=cache_dir)
    assert isinstance(c, CachedModule) and isinstance(c, nn.Module)
    assert c._orig_mod is m and c.note == "original" and c.lin is m.lin
    assert list(c.state_dict()) == ["lin.weight", "lin.bias"]      # no _orig_mod. prefix
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.allclose(c(x), m(x))
        c.load_state_dict({k: torch.zeros_like(v) for k, v in m.state_dict().items()})
        assert torch.equal(c(x), torch.zeros(2, 4))               # new weights are seen
    assert [e for e, _ in c.events] == ["miss"]
    m.register_forward_hook(lambda mod, a, out: out)
    with pytest.raises(ContractError, match="forward hooks"):
        c(x)


def test_a_deep_copy_caches_its_own_forward(cache_dir: Path) -> None:
    import copy

    @cache_compile(backend="aot_eager", cache_dir=cache_dir)
    class Copied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    m = Copied()
    x = torch.randn(2, 4)
    with torch.no_grad():
        m(x)
        twin = copy.deepcopy(m)
        torch.nn.init.zeros_(twin.lin.weight)
        assert twin.forward is not m.forward
        assert torch.allclose(twin(x), twin.lin.bias.expand(2, 4))
        assert torch.allclose(m(x), m.lin(x))


def test_gears_name_a_plain_functions_arguments(cache_dir: Path) -> None:
    cached = cache_compile(fn, backend="aot_eager", cache_dir=cache_dir, dynamic=False,
                           gears={"x": {0: [2, 4]}})
    assert cached.gears is not None
    assert torch.equal(cached(torch.ones(2, 3)), torch.full((2, 3), 2.0))


@pytest.mark.parametrize("bad, needle", [
    (torch.sin, "a C function"),
    (functools.partial(fn, torch.ones(1)), "functools.partial"),
    (torch.compile(Tiny()), "pass the original module"),
    (Tiny.forward, "through its class"),
    (object(), "neither a function"),
    (type("NotModule", (), {}), "not an nn.Module subclass"),
])
def test_what_stays_out_is_refused_by_name(bad: Any, needle: str) -> None:
    with pytest.raises(ContractError, match=needle):
        cache_compile(bad)


def test_a_misspelt_backend_is_refused_with_the_name_it_likely_meant() -> None:
    with pytest.raises(ContractError, match="unknown backend 'inductr'; did you mean 'inductor'"):
        cache_compile(Tiny(), backend="inductr")


def test_a_lambda_in_a_loop_is_refused() -> None:
    with pytest.raises(ContractError, match="defined at .* again") as info:
        for i in range(2):
            cache_compile(lambda x: x + i, backend="aot_eager")  # noqa: B023
    assert "outside the loop" in str(info.value)


def test_the_same_def_in_two_modules_is_two_functions(tmp_path: Path) -> None:
    """Code objects compare equal across files (same body, same line): two modules' twin
    functions are not one def executed again."""
    src = "def step(x):\n    return x * 2\n"
    fns = []
    for name in ("twin_a", "twin_b"):
        (tmp_path / f"{name}.py").write_text(src)
        spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fns.append(mod.step)
    assert fns[0].__code__ == fns[1].__code__ and fns[0].__code__ is not fns[1].__code__
    for f in fns:
        cache_compile(f, backend="aot_eager")


def test_forms_cached_twice_are_refused() -> None:
    c = cache_compile(Tiny(), backend="aot_eager")
    with pytest.raises(ContractError, match="already cached"):
        cache_compile(c)

    class Decorated(nn.Module):
        @cache_compile(backend="aot_eager")
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    assert isinstance(vars(Decorated)["forward"], CachedMethod)
    with pytest.raises(ContractError, match="cached already"):
        cache_compile(Decorated)
    with pytest.raises(ContractError, match="cached already"):
        cache_compile(Decorated())


@pytest.mark.parametrize("kwargs, needle", [
    ({"mode": "reduce-overhead"}, "CUDA graphs, whose capture is not cached"),
    ({"mode": "fast"}, "mode must be one of"),
    ({"mode": "max-autotune", "backend": "aot_eager"}, "selects Inductor options"),
    ({"fullgraph": "no"}, "fullgraph must be True or False"),
    ({"options": {"a": 1}, "config": {"a": 2}}, "disagree on a"),
])
def test_torch_compile_arguments_refused_with_the_reason(kwargs: dict[str, Any],
                                                         needle: str) -> None:
    with pytest.raises(ContractError, match=needle):
        cache_compile(Tiny().forward, **kwargs)


def test_mode_and_options_become_inductor_options() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredArgumentWarning)
        c = cache_compile(Tiny().forward, mode="max-autotune-no-cudagraphs",
                          options={"epilogue_fusion": False}, fullgraph=True)
    assert dict(c.spec.options) == {"max_autotune": True, "coordinate_descent_tuning": True,
                                    "epilogue_fusion": False}
    # What config says explicitly wins over the mode.
    c = cache_compile(Tiny().forward, mode="max-autotune", config={"max_autotune": False})
    assert c.spec.options["max_autotune"] is False
    assert "triton.cudagraphs" not in cache_compile(Tiny().forward,
                                                    mode="max-autotune").spec.options
    # fullgraph=False lets the graph break (docs/usage.md, "Graph breaks"), in every form;
    # it is the default where torch.compile stood, TorchAir's form keeps True.
    assert cache_compile(Tiny().forward, fullgraph=False).spec.fullgraph is False
    assert cache_compile(Tiny().forward).spec.fullgraph is True
    assert cache_compile(Tiny()).cached_forward.spec.fullgraph is False
    assert cache_compile(Tiny(), fullgraph=True).cached_forward.spec.fullgraph is True
    assert cache_compile(fn).spec.fullgraph is False
    decorated: Any = cache_compile(dynamic=False)(Tiny)().forward    # cached on access
    assert decorated.spec.fullgraph is False
    stack = Stack((True, False))
    compile_repeated_blocks(stack)
    blocks: list[Any] = [b.forward for b in stack.modules() if isinstance(b, Block)]
    assert blocks and all(f.spec.fullgraph is False for f in blocks)


def breaks(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


def test_a_plain_function_that_breaks_is_cached_by_default(cache_dir: Path) -> None:
    """torch.compile(fn)'s default lets the graph break: so does cache_compile(fn)'s, and
    the next process (Dynamo reset here) is served the frames."""
    x = torch.randn(3)
    for event in ("miss", "hit"):
        torch._dynamo.reset()
        c = cache_compile(breaks, backend="aot_eager", cache_dir=cache_dir)
        with torch.no_grad():
            assert torch.equal(c(x), breaks(x))
        assert [e for e, _ in c.events] == [event]


# -- repeated blocks, in process: one group loads once --------------------------------------
class Block(nn.Module):
    def __init__(self, flag: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.flag = flag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.lin(x))
        return x + y if self.flag else x - y   # a Python branch Dynamo guards


class Stack(nn.Module):
    _repeated_blocks = ["Block", "Missing"]   # diffusers' attribute: one kind may be absent

    def __init__(self, flags: tuple[bool, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(f) for f in flags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_repeated_blocks_load_once_and_check_each(cache_dir: Path) -> None:
    from cachecompile import compile_repeated_blocks

    flags = (True, True, False, True, True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = Stack(flags)(x)
        cold = Stack(flags)
        g1 = compile_repeated_blocks(cold, backend="aot_eager", cache_dir=cache_dir)
        assert torch.allclose(cold(x), want, atol=1e-6)
        # A second model on the same store stands for a fresh process: one entry per
        # guard outcome (flag True / False), each loaded once; the other blocks reuse it
        # after their own guards held, and the block whose flag differs does not.
        warm = Stack(flags)
        g2 = compile_repeated_blocks(warm, backend="aot_eager", cache_dir=cache_dir)
        assert torch.allclose(warm(x), want, atol=1e-6)
    assert (g1.loads, g1.reuses) == (1, 2)   # cold: block 1 loads what block 0 made
    assert (g2.loads, g2.reuses) == (2, 3)
    assert [e for b in warm.blocks for e, _ in b.forward.events] == ["hit"] * 5  # type: ignore[attr-defined]


def test_repeated_blocks_refusals() -> None:
    from cachecompile import compile_repeated_blocks

    with pytest.raises(ContractError, match="has no _repeated_blocks"):
        compile_repeated_blocks(Tiny())
    with pytest.raises(ContractError, match="no submodule of class Other"):
        compile_repeated_blocks(Stack((True,)), blocks=["Other"])
    s = Stack((True,))
    compile_repeated_blocks(s, backend="aot_eager")
    with pytest.raises(ContractError, match="cached already"):
        compile_repeated_blocks(s, backend="aot_eager")
