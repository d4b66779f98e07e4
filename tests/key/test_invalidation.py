"""The invalidation matrix: a change to any key factor is a miss, never a wrong hit.

Each case makes one entry, then calls again with one thing changed, in the same store,
through a NEW cache_compile wrapper (so the outcome comes from the store, not from the
wrapper's memory). Every output is compared with eager. In-process, real torch.compile
on the aot_eager backend (fast); the Inductor-specific factors are checked on the key.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cachecompile import cache_compile
from cachecompile.key.signature import signature

aten = torch.ops.aten


class Net(nn.Module):
    def __init__(self, dim: int = 4, scale: float = 1.5) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("shift", torch.arange(dim, dtype=torch.float32) / dim)
        self.scale = scale

    def run(self, x: torch.Tensor, flag: bool = False, n: int = 1) -> torch.Tensor:
        y = torch.tanh(self.lin(x) + self.shift) * self.scale
        if flag:
            y = y + 1
        return y * n


def _call(cache_dir: Path, m: nn.Module, *args: Any, method: str = "run",
          **cc: Any) -> str:
    kwargs = cc.pop("call_kwargs", {})
    cached = cache_compile(getattr(m, method), backend=cc.pop("backend", "aot_eager"),
                           cache_dir=cache_dir, **cc)
    with torch.no_grad():
        out = cached(*args, **kwargs)
        want = getattr(m, method)(*args, **kwargs)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6), "cached result differs from eager"
    # "shared": the key missed and the method was traced, but an identical graph's
    # compiled program was already in the store (see test_ranks.py). For the key, a miss.
    event = cached.events[-1][0]
    return "miss" if event == "shared" else event


def seeded(seed: int = 0, **kw: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kw).eval()


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


# (name, variant call, expected outcome). The base call is _call(d, seeded(), X).
def _double(d: Path) -> str:
    return _call(d, seeded().double(), X.double())


def _train(d: Path) -> str:
    return _call(d, seeded().train(), X)


def _extra_buffer(d: Path) -> str:
    m = seeded()
    m.register_buffer("extra", torch.zeros(1))
    return _call(d, m, X)


def _decomp(d: Path) -> str:
    def tanh_decomp(x: torch.Tensor) -> torch.Tensor:
        return 2 * torch.sigmoid(2 * x) - 1

    return _call(d, seeded(), X, custom_decompositions={aten.tanh.default: tanh_decomp})


def _version(d: Path) -> str:
    real = torch.__version__
    # Another build of the same release: the release's side-by-side branches in _torch/
    # (which read torch.__version__) keep to the torch that is really here.
    torch.__version__ = real.split("+")[0] + "+other"  # type: ignore[assignment]
    try:
        return _call(d, seeded(), X)
    finally:
        torch.__version__ = real


def _deterministic(d: Path) -> str:
    torch.use_deterministic_algorithms(True)
    try:
        return _call(d, seeded(), X)
    finally:
        torch.use_deterministic_algorithms(False)


def _moved_store(d: Path) -> str:
    moved = d.parent / "moved"
    shutil.copytree(d, moved, symlinks=True)
    return _call(moved, seeded(), X)


CASES: list[tuple[str, Callable[[Path], str], str]] = [
    ("identical", lambda d: _call(d, seeded(), X), "hit"),
    ("other weights, same layout", lambda d: _call(d, seeded(7), X), "hit"),
    ("other input values", lambda d: _call(d, seeded(), X * 3), "hit"),
    ("dynamic size change", lambda d: _call(d, seeded(), torch.randn(9, 4)), "hit"),
    ("store copied to another path", _moved_store, "hit"),
    ("parameter shape", lambda d: _call(d, seeded(dim=6), torch.randn(3, 6)), "miss"),
    ("module dtype", _double, "miss"),
    ("training flag", _train, "miss"),
    ("added buffer", _extra_buffer, "miss"),
    # A float attribute under dynamic=True is a graph input for Dynamo (no recompile):
    # the same entry serves it, and _call checks the result against eager.
    ("float attribute, dynamic", lambda d: _call(d, seeded(scale=2.5), X), "hit"),
    ("int attribute", lambda d: _call(d, seeded(dim=4, scale=2), X), "miss"),
    ("dynamic flag", lambda d: _call(d, seeded(), X, dynamic=False), "miss"),
    ("custom decompositions", _decomp, "miss"),
    ("tp rank", lambda d: _call(d, seeded(), X, tp_rank=1), "miss"),
    ("pp rank", lambda d: _call(d, seeded(), X, pp_rank=1), "miss"),
    ("torch version", _version, "miss"),
    ("deterministic algorithms", _deterministic, "miss"),
    ("input dtype", lambda d: _call(d, seeded().double(), X.double()), "miss"),
    ("input rank", lambda d: _call(d, seeded(), X.unsqueeze(0)), "miss"),
    ("size 1 is specialised", lambda d: _call(d, seeded(), torch.randn(1, 4)), "miss"),
    ("non-contiguous input", lambda d: _call(d, seeded(), torch.randn(4, 3).t()), "miss"),
    ("bool argument flipped", lambda d: _call(d, seeded(), X, True), "miss"),
    ("int argument changed", lambda d: _call(d, seeded(), X, False, 3), "miss"),
    ("kwarg given", lambda d: _call(d, seeded(), X, call_kwargs={"flag": True}), "miss"),
    ("other backend", lambda d: _call(d, seeded(), X, backend="inductor"), "miss"),
]


@pytest.mark.parametrize("name, variant, expected", CASES, ids=[c[0] for c in CASES])
def test_factor_change(tmp_path: Path, name: str, variant: Callable[[Path], str],
                       expected: str) -> None:
    d = tmp_path / "cc"
    assert _call(d, seeded(), X) == "miss"
    assert variant(d) == expected, name


def test_static_shape_change_is_a_miss_dynamic_is_not(tmp_path: Path) -> None:
    d = tmp_path / "cc"
    assert _call(d, seeded(), X, dynamic=False) == "miss"
    assert _call(d, seeded(), torch.randn(5, 4), dynamic=False) == "miss"
    assert _call(d, seeded(), torch.randn(5, 4), dynamic=False) == "hit"


def _key(m: nn.Module, **cc: Any) -> str:
    cached = cache_compile(m.run, **cc)  # type: ignore[arg-type]
    return cached.key(signature((X,), {}, cc.get("dynamic", True))).digest


def test_inductor_key_sees_config_env_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _key(seeded())
    assert _key(seeded()) == base
    assert _key(seeded(), config={"max_autotune": True}) != base
    monkeypatch.setenv("TORCHINDUCTOR_SIMDLEN", "256")
    assert _key(seeded()) != base
    monkeypatch.delenv("TORCHINDUCTOR_SIMDLEN")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")  # location only
    assert _key(seeded()) == base
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert _key(seeded()) != base
    finally:
        torch.set_num_threads(threads)
    assert _key(seeded(), global_rank=0) == base
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert _key(seeded()) != base


def test_two_modules_of_one_class_with_different_structure(tmp_path: Path) -> None:
    d = tmp_path / "cc"
    a, b = seeded(dim=4), seeded(dim=8)
    ca = cache_compile(a.run, backend="aot_eager", cache_dir=d)
    cb = cache_compile(b.run, backend="aot_eager", cache_dir=d)
    xa, xb = torch.randn(2, 4), torch.randn(2, 8)
    with torch.no_grad():
        assert torch.allclose(ca(xa), a.run(xa))
        assert torch.allclose(cb(xb), b.run(xb))
        assert torch.allclose(ca(xa * 2), a.run(xa * 2))
    assert [e[0] for e in ca.events] == ["miss"]
    assert [e[0] for e in cb.events] == ["miss"]


class TwoMethods(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cached_prefill = cache_compile(self.prefill, backend="aot_eager", dynamic=True)
        self.cached_decode = cache_compile(self.decode, backend="aot_eager", dynamic=False)

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x[:, -1:]).sigmoid()


def test_two_cached_methods_on_one_module(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECOMPILE_DIR", str(tmp_path / "cc"))
    m = TwoMethods().eval()
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        assert torch.allclose(m.cached_prefill(x), m.prefill(x))
        assert torch.allclose(m.cached_decode(x), m.decode(x))
    m2 = TwoMethods().eval()
    m2.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert torch.allclose(m2.cached_prefill(x), m.prefill(x))
        assert torch.allclose(m2.cached_decode(x), m.decode(x))
    assert [e[0] for e in m2.cached_prefill.events] == ["hit"]
    assert [e[0] for e in m2.cached_decode.events] == ["hit"]


def _scaled_tanh(k: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def tanh_decomp(x: torch.Tensor) -> torch.Tensor:
        return k * torch.sigmoid(2 * x) - 1   # k is a closure cell: same code, other value
    return tanh_decomp


def test_decomposition_closure_change_is_a_miss(tmp_path: Path) -> None:
    # TorchAir keys custom code by its disassembly only; a changed closure value was a hit
    # that ran the old decomposition.
    d = tmp_path / "cc"
    for k, expected in ((2.0, "miss"), (2.5, "miss"), (2.0, "hit"), (2.5, "hit")):
        decomps = {aten.tanh.default: _scaled_tanh(k)}
        cached = cache_compile(seeded().run, backend="aot_eager", cache_dir=d,
                               custom_decompositions=decomps)
        m = seeded()
        with torch.no_grad():
            out = cached(X)
            want = (k * torch.sigmoid(2 * (m.lin(X) + m.shift)) - 1) * m.scale
        assert torch.allclose(out, want, atol=1e-5), k
        assert cached.events[-1][0] in ((expected,) if expected == "hit" else ("miss", "shared"))


def test_unrelated_env_vars_are_not_key_factors(monkeypatch: pytest.MonkeyPatch) -> None:
    from cachecompile.backends import inductor

    for name in ("CCACHE_DIR", "CC_DIR", "CXXFLAGS", "CXX_STANDARD", "OMP_PROC_BIND"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("CXX", "g++")
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    env = inductor._env_factors()
    assert "CXX" in env and "TORCHINDUCTOR_MAX_AUTOTUNE" in env
    assert not {"CCACHE_DIR", "CC_DIR", "CXXFLAGS", "CXX_STANDARD", "OMP_PROC_BIND"} & set(env)
