"""A user's mistakes answered in their terms (issue 51), each run as the user ran it:
training through a backend cached for inference only, wrong inputs, generators, what torch.compile returned,
torch.compile's own arguments (``dynamic=None``, ``disable=``), a typo in a keyword,
``generate()`` on a cached module, a data-dependent vision tower, a truncated manifest
and a cache dir that cannot be made.

In-process, real Dynamo, the aot_eager backend (no C++ compiler): seconds each.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from ccutil import cachectl
from torch import nn

from cachecompile import (
    CacheFaultWarning,
    ContractError,
    GraphBreakError,
    IgnoredArgumentWarning,
    InferenceOnlyWarning,
    UncachedCallWarning,
    cache_compile,
)
from cachecompile import store as store_mod
from cachecompile.store import settings
from cachecompile.store.errors import SettingWarning

REPO = Path(__file__).resolve().parents[2]


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 4)
        self.calls = 0

    def f(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(x)

    def counted(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # a side effect: how often the method really ran
        return self.fc1(x)

    def gen(self, x: torch.Tensor) -> Any:
        yield self.fc1(x)


def steps(x: torch.Tensor) -> Any:
    for _ in range(2):
        yield x + 1


async def later(x: torch.Tensor) -> torch.Tensor:
    return x + 1



def _entries(root: Path) -> int:
    return sum(1 for _ in root.rglob("manifest.json")) if root.exists() else 0


# -- 1. training through a backend that caches inference only -----------------------------
def eager_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """A user's own backend callable: cachecompile caches what it returns for inference
    only (aot_eager and Inductor cache training calls too: tests/e2e/test_training.py)."""
    return gm.forward


def test_training_mode_in_grad_mode_warns_before_anything_is_compiled(cache_dir: Path) -> None:
    m = Mlp()  # a fresh module is in training mode, its parameters require grad
    cached = cache_compile(m.f, backend=eager_backend, cache_dir=cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InferenceOnlyWarning)
        with pytest.raises(InferenceOnlyWarning) as info:
            cached(torch.randn(2, 16))
    message = str(info.value)
    assert "inference only" in message and "training mode" in message
    assert "model.eval()" in message and "torch.compile" in message and "backward()" in message
    assert cached.events == [] and _entries(cache_dir) == 0, "warned before any compile"
    # Said once per cached method; the calls go on (inference that forgot eval()).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cached(torch.randn(2, 16))
        cached(torch.randn(3, 16))
    assert [w for w in caught if w.category is InferenceOnlyWarning] == []
    assert not out.requires_grad


def test_training_mode_on_a_training_backend_is_a_training_call(cache_dir: Path) -> None:
    """The same call on aot_eager: cached as torch.compile would run it, with autograd
    history, and no InferenceOnlyWarning."""
    m = Mlp()
    cached = cache_compile(m.f, backend="aot_eager", cache_dir=cache_dir)
    x = torch.randn(2, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cached(x)
    assert [w for w in caught if w.category is InferenceOnlyWarning] == []
    assert out.requires_grad and cached.events == [("miss", cached.events[0][1])]
    out.sum().backward()
    want = Mlp()
    want.f(x).sum().backward()
    assert m.fc1.weight.grad is not None and want.fc1.weight.grad is not None
    assert torch.equal(m.fc1.weight.grad, want.fc1.weight.grad)
    # cachectl shows both programs of the stored entry.
    [manifest] = list(cache_dir.rglob("manifest.json"))
    key = json.loads(manifest.read_text())["key"]
    shown = cachectl("program", key, "--no-bytecode", "--cache-dir", str(cache_dir)).stdout
    assert "# ---- program.py" in shown
    assert "# ---- backward/program.py (the backward of a training graph)" in shown


@pytest.mark.parametrize("setup", ["eval", "no_grad", "frozen"])
def test_no_training_warning_when_it_is_inference(cache_dir: Path, setup: str) -> None:
    m = Mlp()
    if setup == "eval":
        m.eval()
    if setup == "frozen":
        m.requires_grad_(False)
    cached = cache_compile(m.f, backend=eager_backend, cache_dir=cache_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if setup == "no_grad":
            with torch.no_grad():
                cached(torch.randn(2, 16))
        else:
            cached(torch.randn(2, 16))
    assert [w for w in caught if w.category is InferenceOnlyWarning] == []


# -- 2. a wrong argument is the eager error, not a graph break ----------------------------
def test_a_str_where_a_tensor_goes_is_eagers_type_error(cache_dir: Path) -> None:
    m = Mlp().eval()
    cached = cache_compile(m.f, backend="aot_eager", cache_dir=cache_dir)
    with pytest.raises(TypeError) as info:
        cached("abc")  # type: ignore[arg-type]
    assert not isinstance(info.value, GraphBreakError)
    assert "must be Tensor, not str" in str(info.value)
    notes = getattr(info.value, "__notes__", [])
    assert any("Mlp.f(x: str)" in n and "Nothing was compiled" in n for n in notes), notes
    assert _entries(cache_dir) == 0


def test_a_wrong_shape_is_eagers_error_without_dynamo_logs(
        cache_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    m = Mlp().eval()
    cached = cache_compile(m.counted, backend="aot_eager", cache_dir=cache_dir)
    with pytest.raises(RuntimeError) as info:
        cached(torch.randn(4, 15))
    err = info.value
    assert "mat1 and mat2 shapes cannot be multiplied (4x15 and 16x4)" in str(err)
    assert type(err) is RuntimeError, type(err).__mro__  # eager's, not Dynamo's subclass
    assert any("x: float32[4,15]@cpu" in n for n in getattr(err, "__notes__", []))
    # Dynamo's error stays reachable for a debugger, not printed with the traceback.
    assert err.__suppress_context__ and err.__context__ is not None
    assert m.calls == 1, "the call ran once, as the uncompiled call would"
    out, logged = capfd.readouterr()
    assert "failed while attempting to run meta" not in logged + out
    assert "TorchRuntimeError" not in logged + out
    # The right input still compiles and caches.
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.allclose(cached(x), m.fc1(x))
    assert cached.events == [("miss", "float32[n,n]@cpu")]


def test_an_object_dynamo_cannot_trace_is_eagers_error(cache_dir: Path) -> None:
    m = Mlp().eval()
    cached = cache_compile(m.f, backend="aot_eager", cache_dir=cache_dir)
    with pytest.raises(TypeError, match="must be Tensor, not object"):
        cached(object())  # type: ignore[arg-type]


# -- 3. generators ------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["method", "function", "class-body", "async"])
def test_generators_and_async_functions_are_refused_up_front(form: str) -> None:
    m = Mlp()
    with pytest.raises(ContractError) as info:
        if form == "method":
            cache_compile(m.gen)
        elif form == "function":
            cache_compile(steps)
        elif form == "async":
            cache_compile(later)
        else:
            class Streams(nn.Module):
                @cache_compile
                def forward(self, x: torch.Tensor) -> Any:
                    yield x
    message = str(info.value)
    if form == "async":
        assert "async function" in message
        asyncio.run(later(torch.ones(1)))  # (used, so it is not a never-awaited coroutine)
    else:
        assert "generator function (it yields)" in message
        assert "returns the results" in message


# -- 4. a typo in a setting names the setting and turns nothing off ----------------------
@pytest.mark.parametrize("value", ["True", "TRUE", "on", "yes"])
def test_disable_is_on_in_any_spelling(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                       value: str) -> None:
    monkeypatch.setenv("CACHECOMPILE_DISABLE", value)
    m = Mlp().eval()
    cached = cache_compile(m.f, backend="aot_eager", cache_dir=cache_dir)
    with torch.no_grad():
        cached(torch.randn(2, 16))
    assert cached.events == [("live", "float32[n,n]@cpu")] and _entries(cache_dir) == 0


def test_an_unknown_cpu_target_warns_by_name_and_caches_for_this_cpu(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_CPU_TARGET", "x86-64-v9")
    monkeypatch.setattr(settings, "_warned", set())
    m = Mlp().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cached = cache_compile(m.f, cache_dir=cache_dir)  # inductor: CPU targets are its
        with torch.no_grad():
            cached(torch.randn(2, 16))
    said = [str(w.message) for w in caught if w.category is SettingWarning]
    assert len(said) == 1 and said[0].startswith("CACHECOMPILE_CPU_TARGET='x86-64-v9': "
                                                 "unknown CPU target 'x86-64-v9'"), said
    assert "using the default (native)" in said[0]
    assert cached.events == [("miss", "float32[n,n]@cpu")] and _entries(cache_dir) >= 1


# -- 8. refusals that are ours, and torch.compile's own arguments -------------------------
def test_what_torch_compile_returned_is_refused_at_once() -> None:
    m = Mlp()
    for given in (torch.compile(m).forward, torch.compile(m.f)):  # type: ignore[attr-defined]
        with pytest.raises(ContractError) as info:
            cache_compile(given)
        assert "what torch.compile returned" in str(info.value)
        assert "cache_compile(model.forward)" in str(info.value)


def test_disable_true_returns_what_it_was_given() -> None:
    m = Mlp()
    assert cache_compile(m, disable=True) is m
    assert cache_compile(m.f, disable=True) == m.f
    assert cache_compile(steps, disable=True) is steps
    assert cache_compile(disable=True)(Mlp) is Mlp
    assert isinstance(cache_compile(m.f, disable=False), type(cache_compile(m.counted)))
    with pytest.raises(ContractError, match="disable must be True or False"):
        cache_compile(m.f, disable="yes")  # type: ignore[call-overload]


def test_dynamic_none_is_static_first_then_dynamic_across_processes(cache_dir: Path) -> None:
    def run() -> list[tuple[str, str]]:
        m = Mlp().eval()
        cached = cache_compile(m.f, backend="aot_eager", cache_dir=cache_dir, dynamic=None)
        with torch.no_grad():
            for n in (2, 2, 3, 5):
                x = torch.randn(n, 16)
                assert torch.allclose(cached(x), m.f(x))
        return cached.events

    assert run() == [("miss", "float32[2,16]@cpu"), ("miss", "float32[n,16]@cpu")]
    # A process that sees the same calls loads the same two entries, in the same order.
    assert run() == [("hit", "float32[2,16]@cpu"), ("hit", "float32[n,16]@cpu")]
    with pytest.raises(ContractError, match=r"True, False or None"):
        cache_compile(Mlp().f, dynamic="auto")  # type: ignore[call-overload]


def test_a_typo_in_a_keyword_says_what_was_meant() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache_compile(Mlp().f, dynamc=False, zz_unrelated=1)  # type: ignore[call-overload]
    (w,) = [w for w in caught if w.category is IgnoredArgumentWarning]
    assert "dynamc (did you mean dynamic?)" in str(w.message)
    assert "zz_unrelated" in str(w.message) and "zz_unrelated (" not in str(w.message)


def test_generate_on_a_cached_module_says_it_is_not_cached(cache_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model = cache_compile(model, backend="aot_eager", cache_dir=cache_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    said = [str(w.message) for w in caught if w.category is UncachedCallWarning]
    assert len(said) == 1, said
    assert "model.forward = cache_compile(model.forward)" in said[0]
    assert model.events == [] and _entries(cache_dir) == 0


def test_a_data_dependent_vision_tower_is_a_graph_break_error(cache_dir: Path) -> None:
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    cfg = Qwen2VLVisionConfig(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2,
                              patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
                              in_channels=3)
    torch.manual_seed(0)
    tower = Qwen2VisionTransformerPretrainedModel._from_config(cfg).eval()
    # fullgraph=True: the module form's default lets the graph break (test_graph_break_models).
    cached = cache_compile(tower, backend="aot_eager", cache_dir=cache_dir, fullgraph=True)
    with pytest.raises(GraphBreakError) as info, torch.no_grad():
        cached(torch.randn(16, 24), grid_thw=torch.tensor([[1, 4, 4]]))
    err = info.value
    assert "data-dependent" in str(err) and "Hint:" in str(err)
    assert "outside the cached method" in str(err)
    assert err.filename is not None and "qwen2_vl" in err.filename
    assert len(str(err)) < 1500


# -- 9. the smaller ones ------------------------------------------------------------------
def test_a_truncated_manifest_is_one_cache_fault_warning(cache_dir: Path) -> None:
    m = Mlp().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        cache_compile(m.f, backend="aot_eager", cache_dir=cache_dir)(x)
    (manifest,) = cache_dir.rglob("manifest.json")
    manifest.parent.chmod(0o700)
    manifest.chmod(0o600)
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    cached = cache_compile(m.f, backend="aot_eager", cache_dir=cache_dir)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        assert torch.allclose(cached(x), m.f(x))
    faults = [str(w.message) for w in caught if issubclass(w.category, CacheFaultWarning)]
    assert len(faults) == 1 and "not valid JSON" in faults[0] and "quarantined" in faults[0], \
        faults
    assert cached.events == [("miss", "float32[n,n]@cpu")]


def test_a_cache_dir_that_cannot_be_made_says_so(cache_dir: Path) -> None:
    m = Mlp().eval()
    cached = cache_compile(m.f, backend="aot_eager", cache_dir="/proc/cc")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        cached(torch.randn(2, 16))
    (fault,) = [str(w.message) for w in caught if issubclass(w.category, CacheFaultWarning)]
    assert "cannot create the cache directory /proc/cc" in fault, fault
    assert "CACHECOMPILE_DIR" in fault


def test_plain_functions_are_labelled_by_their_module(cache_dir: Path) -> None:
    cached = cache_compile(_double, backend="aot_eager", cache_dir=cache_dir)
    with torch.no_grad():
        cached(torch.randn(3))
    (info,) = store_mod.open_store(cache_dir).entries()
    assert info.labels["model"] == __name__ and info.labels["function"] == "_double"


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


TYPED = '''
import torch
from torch import nn
from cachecompile import cache_compile

class M(nn.Module):
    def f(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n

    @cache_compile
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

def step(x: torch.Tensor) -> float:
    return 1.0

m = M()
reveal_type(cache_compile(m.f))
reveal_type(cache_compile(step)(torch.ones(1)))
reveal_type(cache_compile(m))
reveal_type(cache_compile(M))
reveal_type(cache_compile(dynamic=False)(step))
reveal_type(m.forward(torch.ones(1)))
cache_compile(m.f)("x", 2)
'''


@pytest.mark.slow
def test_a_type_checker_sees_the_wrapped_callable(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    src = tmp_path / "typed_use.py"
    src.write_text(TYPED)
    p = subprocess.run([sys.executable, "-m", "mypy", "--python-version", "3.10",
                        "--ignore-missing-imports", "--no-error-summary",
                        "--cache-dir", str(REPO / ".mypy_cache"), str(src)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "MYPYPATH": str(REPO)})
    # (mypy releases differ in spelling builtins: "int" or "builtins.int")
    revealed = [ln.split("Revealed type is ", 1)[1].strip('"').replace("builtins.", "")
                for ln in p.stdout.splitlines() if "Revealed type is" in ln]
    assert revealed == [
        "cachecompile.cached.CachedFunction[[x: torch._tensor.Tensor, n: int], "
        "torch._tensor.Tensor]",
        "float",
        "cachecompile.forms.CachedModule",
        "type[typed_use.M]",
        "def (x: torch._tensor.Tensor) -> float",
        "torch._tensor.Tensor",
    ], p.stdout
    errors = [ln for ln in p.stdout.splitlines() if ": error:" in ln]
    assert len(errors) == 1 and '"str"; expected "Tensor"' in errors[0], json.dumps(errors)
