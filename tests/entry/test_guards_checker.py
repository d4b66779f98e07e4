"""The warm-path guard checker on its own: compiled guards over live objects, no Dynamo.

The cross-process cases (one per kind of fact Dynamo guards) are in test_guard_matrix.py;
these pin what the checker itself promises: object paths shared between guards give the
same verdicts as evaluating each guard alone, a guard that raises is a failed guard, and
an identity guard that remembers the object it matched still sees a swap.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import pytest
import tiny
import torch
import torch.nn.functional as F
from torch import nn

from cachecompile.entry import checker as checker_mod
from cachecompile.entry import guards as g
from cachecompile.entry import values
from cachecompile.entry.checker import Checker, build_checker
from cachecompile.key.identity import identity


class Cfg:
    def __init__(self) -> None:
        self.act = "relu"
        self.width = 3
        self.table = [[1, 2], [3, 4]]


class M(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cfg = Cfg()
        self.fn = F.relu
        self.opts = {"mode": "a"}

    def helper(self, y: torch.Tensor) -> torch.Tensor:
        return y * 2

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _guard(kind: str, expr: str, value: Any, args: bool = False) -> dict[str, Any]:
    return {"kind": kind, "expr": expr, "value": value, "text": g.user_text(expr), "args": args}


def _guards(m: M, x: torch.Tensor) -> list[dict[str, Any]]:
    lin = "___odict_getitem(L['self']._modules, 'lin')"
    return [
        _guard("eq", "L['self'].cfg.act", values.encode_value("relu")),
        _guard("eq", "L['self'].cfg.width", values.encode_value(3)),
        _guard("len", "L['self'].cfg.table", 2),
        _guard("eq", "L['self'].cfg.table[1][1]", values.encode_value(4)),
        _guard("eq", "L['self'].opts['mode']", values.encode_value("a")),
        _guard("ident", "L['self'].fn", identity(F.relu)),
        _guard("ident", "L['self'].helper", identity(m.helper)),
        _guard("tensor", f"{lin}._parameters['weight']", g.tensor_facts(m.lin.weight)),
        _guard("tensor", f"{lin}._parameters['bias']", g.tensor_facts(m.lin.bias)),
        _guard("tensor", "L['x']", g.tensor_facts(x), args=True),
        _guard("expr", "L['x'].size()[0] == 3", None, args=True),
    ]


def _checker(m: M, x: torch.Tensor, every_call: bool = True) -> Checker:
    return build_checker(M.run, _guards(m, x), {},  # type: ignore[arg-type]
                           every_call=every_call)


def _one_by_one(m: M, x: torch.Tensor) -> bool:
    """The reference: each guard compiled alone, no shared paths, no memo."""
    return all(build_checker(M.run, [gd], {}).full(m, x)  # type: ignore[arg-type]
               for gd in _guards(M(), x))


@pytest.mark.parametrize("every_call", [True, False], ids=["shared paths", "plain"])
def test_every_change_fails_the_guard_that_reads_it(every_call: bool) -> None:
    x = torch.randn(3, 4)
    m = M()
    c = _checker(m, x, every_call)
    assert c.full(m, x) and c.per_call(m, x)
    changes = {
        "cfg.act": lambda m: setattr(m.cfg, "act", "silu"),
        "cfg.width": lambda m: setattr(m.cfg, "width", 2),
        "table": lambda m: m.cfg.table[1].__setitem__(1, 5),
        "table len": lambda m: m.cfg.table.append([0]),
        "dict value": lambda m: m.opts.__setitem__("mode", "b"),
        "function attr": lambda m: setattr(m, "fn", F.silu),
        "partial attr": lambda m: setattr(m, "fn", functools.partial(F.relu)),
        "instance method": lambda m: setattr(m, "helper", types.MethodType(lambda s, y: y, m)),
        "weight dtype": lambda m: setattr(m.lin, "weight", nn.Parameter(m.lin.weight.double())),
        "missing attr": lambda m: delattr(m, "cfg"),
        "cfg replaced": lambda m: setattr(m, "cfg", object()),
    }
    for what, change in changes.items():
        m2 = M()
        assert c.full(m2, x), what  # the memo saw m's objects; a new module still fits
        change(m2)
        assert not c.full(m2, x), what
        assert c.full(m2, x) is _one_by_one(m2, x), what
        assert c.explain(m2, x), what
        assert c.per_call(m2, x), f"{what}: only argument guards run per call"


def test_argument_guards_run_per_call() -> None:
    x = torch.randn(3, 4)
    m = M()
    c = _checker(m, x)
    for bad in (torch.randn(5, 4), torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, 1)):
        assert not c.per_call(m, bad) and not c.full(m, bad)
    assert c.per_call(m, torch.randn(3, 4))


def test_identity_memo_sees_a_swap_back_and_forth() -> None:
    x = torch.randn(3, 4)
    m = M()
    c = _checker(m, x)
    for _ in range(3):
        assert c.full(m, x)
        m.fn = F.silu
        assert not c.full(m, x)
        m.fn = F.relu
    # A bound method of another instance is not this instance's method.
    other = M()
    m.helper = other.helper  # type: ignore[method-assign]
    assert c.full(m, x) is _one_by_one(m, x)


@pytest.mark.parametrize("every_call", [True, False], ids=["shared paths", "plain"])
def test_shared_paths_keep_guard_order(every_call: bool) -> None:
    """A path read by a later guard is not evaluated when an earlier guard fails on a
    missing object; the verdict is False, never an exception."""
    x = torch.randn(3, 4)
    m = M()
    guards = [_guard("hasattr", "L['self']", {"attr": "cfg", "present": True}),
              _guard("eq", "L['self'].cfg.act", values.encode_value("relu"))]
    c = build_checker(M.run, guards, {}, every_call=every_call)  # type: ignore[arg-type]
    assert c.full(m, x)
    del m.cfg
    assert c.full(m, x) is False
    assert "cfg" in (c.explain(m, x) or "")


def test_a_stride_miss_names_the_strides_on_both_sides(tmp_path: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Two [1,1] int64 tensors, one sliced out of a wider one (strides [8, 1]), one
    contiguous ([1, 1]): Dynamo's tensor guard tells them apart, so their signatures do
    too (they used to print the same). The miss must show both strides, `stats` count it
    as a miss for want of a key that differs in its signature, and the guard text itself
    carries the strides."""
    import logging

    from cachecompile import cache_compile, store

    class Emb(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(16, 4)

        def step(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids).sum(-1)

    wide = torch.arange(8).reshape(1, 8)
    sliced, contiguous = wide[:, :1], torch.zeros(1, 1, dtype=torch.int64)
    assert sliced.stride() == (8, 1) and contiguous.stride() == (1, 1)
    m = Emb().eval()
    with torch.no_grad():
        cache_compile(m.step, backend="aot_eager", cache_dir=tmp_path, dynamic=False)(sliced)
        st = store.open_store(tmp_path)
        texts = [gd["text"] for i in st.entries() if i.labels.get("kind") != "graph"
                 for gd in st.manifest(i.key)["meta"]["guards"] if gd["kind"] == "tensor"]
        assert any(t.startswith("ids is a int64[1,1]") and t.endswith("strides [8,1]")
                   for t in texts), texts
        warm = cache_compile(Emb().eval().step, backend="aot_eager", cache_dir=tmp_path,
                             dynamic=False)
        with caplog.at_level(logging.INFO, logger="cachecompile"):
            assert torch.equal(warm(contiguous), m.step(contiguous))
    misses = [r.getMessage() for r in caplog.records if "cachecompile miss" in r.getMessage()]
    assert len(misses) == 1, misses
    # The strides are part of the signature (a static tensor's guard checks them), so
    # the two calls print apart and the miss line shows both.
    assert ("signature (the entry's [int64[1,1]@cpu strides[8,1]], this call's "
            "[int64[1,1]@cpu])") in misses[0], misses[0]
    s = st.stats()
    assert s["misses"] == {"absent": 2} and s["misses_about"] == {"absent": {"signature": 1}}


def test_a_value_miss_names_the_value_not_the_comparison(tmp_path: Any,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Dynamo specialised ``n == 2`` (a branch on a dynamic int); a call with 3 misses and
    says ``got 3`` (it used to say what the comparison gave: ``got False``)."""
    import logging

    from cachecompile import cache_compile

    class Branch(nn.Module):
        def run(self, x: torch.Tensor, n: int) -> torch.Tensor:
            if n == 2:
                return x * 2
            return x + n

    x = torch.ones(3)
    with torch.no_grad():
        cache_compile(Branch().run, backend="aot_eager", cache_dir=tmp_path, dynamic=True)(x, 2)
        warm = cache_compile(Branch().run, backend="aot_eager", cache_dir=tmp_path,
                             dynamic=True)
        with caplog.at_level(logging.INFO, logger="cachecompile"):
            assert torch.equal(warm(x, 3), x + 3)
    misses = [r.getMessage() for r in caplog.records if "guard failed" in r.getMessage()]
    assert len(misses) == 1, misses
    assert "n == 2 (got 3)" in misses[0], misses[0]


def test_a_size_dynamo_specialised_under_dynamic_true_says_so(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """dynamic=True, but the code branches on a size: Dynamo specialises it and the entry
    holds exact sizes. A call with another size misses (as torch.compile recompiles), and
    the reason says why an entry compiled for every size holds this one (issue 61)."""
    import logging

    from cachecompile import cache_compile

    class OnSize(nn.Module):
        def run(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 3:
                return x * 2
            return x + 1

    with torch.no_grad():
        cache_compile(OnSize().run, backend="aot_eager", cache_dir=tmp_path,
                      dynamic=True)(torch.ones(3, 5))
        warm = cache_compile(OnSize().run, backend="aot_eager", cache_dir=tmp_path,
                             dynamic=True)
        with caplog.at_level(logging.INFO, logger="cachecompile"):
            assert torch.equal(warm(torch.ones(4, 5)), torch.ones(4, 5) + 1)
    misses = [r.getMessage() for r in caplog.records if "guard failed" in r.getMessage()]
    assert len(misses) == 1, misses
    assert "the entry's [3, " in misses[0], misses[0]
    assert "compiled with dynamic=True, yet Dynamo specialised these sizes" in misses[0]
    # `cachectl explain` of the two entries says it too.
    from ccutil import cachectl

    from cachecompile.store import open_store
    keys = [i.key for i in open_store(tmp_path).entries()]
    out = cachectl("explain", *keys, "--cache-dir", str(tmp_path)).stdout
    assert len(keys) == 2 and "is one Dynamo specialised" in " ".join(out.split()), out
    from cachecompile.warm.lookup import specialised
    assert specialised('{"sizes": [null, null]}') == specialised("3") == ""
    assert specialised('{"sizes": [3, null]}', dynamic=False) == ""
    assert "0 or 1" in specialised('{"sizes": [1, null]}')


def test_a_global_state_miss_names_the_setting(tmp_path: Any,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Traced without autocast, called under CPU autocast: the miss names the setting that
    changed, with both values (it used to list every setting the guard covers)."""
    import logging

    from cachecompile import cache_compile

    x = torch.randn(2, 4)
    with torch.no_grad():
        cache_compile(tiny.Small().eval().run, backend="aot_eager", cache_dir=tmp_path)(x)
        warm = cache_compile(tiny.Small().eval().run, backend="aot_eager", cache_dir=tmp_path)
        with caplog.at_level(logging.INFO, logger="cachecompile"), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            warm(x)
    misses = [r.getMessage() for r in caplog.records if "guard failed" in r.getMessage()]
    assert len(misses) == 1, misses
    assert "changed: autocast(cpu)_enabled" in misses[0], misses[0]
    assert "autocast_state.enabled[0] True, the entry's False" in misses[0], misses[0]


def test_a_stored_checker_loads_without_parsing_or_compiling(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """An entry stores its checker's bodies and code object (``meta["checker"]``): a warm
    process builds the same checker from them with no guard parsed and no compile, and
    only for the conditions they were derived from."""
    x = torch.randn(3, 4)
    m = M()
    cold = _checker(m, x)
    lines = cold.lines()
    assert set(lines) == {"digest", "per_call", "full", "code"}

    def forbidden(*a: Any, **k: Any) -> Any:
        raise AssertionError("a warm checker parsed or compiled")

    with monkeypatch.context() as mp:
        mp.setattr(checker_mod, "guard_lines", forbidden)
        mp.setattr(checker_mod, "compile", forbidden, raising=False)
        warm = build_checker(M.run, _guards(m, x), {}, every_call=True,  # type: ignore[arg-type]
                               lines=lines)
    other, changed = M(), M()
    changed.cfg.act = "tanh"
    for obj, arg in ((m, x), (other, x), (changed, x), (m, torch.randn(4, 4))):
        assert warm.full(obj, arg) is cold.full(obj, arg)
        assert warm.per_call(obj, arg) is cold.per_call(obj, arg)
    assert warm.full(changed, x) is False and warm.full(m, x) is True
    # Bodies made for other guards are never used: the digest differs, so they compile.
    guards = _guards(m, x)[:-1]
    calls: list[int] = []
    real = checker_mod.guard_lines
    monkeypatch.setattr(checker_mod, "guard_lines", lambda *a: calls.append(1) or real(*a))  # type: ignore[func-returns-value]
    fewer = build_checker(M.run, guards, {}, every_call=True, lines=lines)  # type: ignore[arg-type]
    assert calls and fewer.full(m, x)


def test_miss_messages_say_what_was_read_in_the_users_terms() -> None:
    """A failed guard names the value it read, says plainly that an attribute is gone, and
    never shows a name Dynamo generated (issue 31)."""
    x = torch.randn(3, 4)
    m = M()
    m.cfg.width = 2.5  # type: ignore[assignment]
    guards = [_guard("type", "L['self'].cfg.width", {"qual": "builtins.float", "code": None}),
              _guard("expr", "not math.isnan(L['self'].cfg.width)", None)]
    c = build_checker(M.run, guards, {}, every_call=True)  # type: ignore[arg-type]
    assert c.full(m, x)
    m.cfg.width = float("nan")  # type: ignore[assignment]
    why = c.explain(m, x) or ""
    assert "got nan" in why and "got False" not in why, why
    del m.cfg.width
    why = c.explain(m, x) or ""
    assert "no attribute 'width': it is gone" in why, why
    assert g.user_text("G['__builtins_dict___3']['abs']", "mod") == "builtins['abs']"
    assert "unnamed_scope" not in g.user_text("G['___unnamed_scope_140']['f']", "mod")


def test_the_entry_meta_record_round_trips_and_names_another_format() -> None:
    """What an entry stores beside its files is one typed record (entry.meta.EntryMeta):
    written as JSON and read back whole; a record of another format, or with a field of
    the wrong type, is refused by name (a lookup counts it as a format miss)."""
    from cachecompile.entry.meta import FORMAT_VERSION, EntryMeta
    from cachecompile.errors import UnsupportedProgramError

    rec = EntryMeta(adapter="inductor", program={"kernels": {}}, imports={"__import_torch": "torch"},
                    compiled_fn="__compiled_fn_1", guards=[{"kind": "len", "expr": "L['x']"}],
                    signature="float32[2,4]@cpu", compile_seconds=1.5,
                    cold_phases={"backend": 1.0})
    raw = rec.to_json()
    assert raw["format"] == FORMAT_VERSION and "checker" not in raw   # empty fields left out
    assert EntryMeta.from_json(raw) == rec and rec.is_method
    graph = EntryMeta(adapter="inductor", program={}).to_json()
    assert set(graph) == {"format", "adapter", "program", "publisher"}
    assert not EntryMeta.from_json(graph).is_method
    with pytest.raises(UnsupportedProgramError,
                       match=f"entry format 2, not {FORMAT_VERSION}: written by another"):
        EntryMeta.from_json({**raw, "format": 2})
    # Format 3 (before graph breaks) would run a method's bytecode without the frames it
    # calls: refused by name too.
    with pytest.raises(UnsupportedProgramError, match="entry format 3, not 4"):
        EntryMeta.from_json({**raw, "format": 3})
    with pytest.raises(UnsupportedProgramError, match="'guards' is a str"):
        EntryMeta.from_json({**raw, "guards": "x"})
    with pytest.raises(UnsupportedProgramError, match="no 'adapter'"):
        EntryMeta.from_json({k: v for k, v in raw.items() if k != "adapter"})


# -- shared object paths, generated --------------------------------------------------------
def _generated_conds(rng: Any, n: int) -> list[str]:
    """Conditions over nested attributes, constant subscripts and ``___odict_getitem``
    reads of ``x`` (and a lambda whose names are its own), as guard kinds write them: no
    ``and`` (a body reads a condition's paths before testing it, so a read that only a
    short circuit skips fails the body: a miss, never a wrong hit)."""
    def path(depth: int) -> str:
        p = "x"
        for _ in range(depth):
            step = rng.choice(["attr", "item", "odict"])
            if step == "attr":
                p = f"{p}.{rng.choice('ab')}"
            elif step == "item":
                p = f"{p}[{rng.choice(['0', repr('k')])}]"
            else:
                p = f"___odict_getitem({p}, {rng.choice(['0', repr('k')])})"
        return p
    return [rng.choice([
        f"{path(rng.randint(1, 4))} == {rng.randint(0, 2)}",
        f"{path(rng.randint(1, 3))} != {path(rng.randint(1, 3))}",
        f"(lambda y: y.a)({path(rng.randint(0, 2))}) == 0",
    ]) for _ in range(n)]


def _tree(rng: Any, depth: int) -> Any:
    """A value every generated path can read (or fail to: a failing read is a False)."""
    if depth == 0:
        return rng.randint(0, 2)
    class Node(dict):   # attribute and item reads alike
        pass
    node = Node()
    for k in ("k", 0):
        if rng.random() < 0.9:
            node[k] = _tree(rng, depth - 1)
    for a in "ab":
        if rng.random() < 0.9:
            setattr(node, a, _tree(rng, depth - 1))
    return node


def test_shared_paths_check_what_the_conditions_check() -> None:
    """guard_lines(share_paths=True) binds each path once, over conditions that repeat
    across bodies (a frame's checkers, a model's frames, in another order): each body
    decides what its conditions decide one by one, whatever was derived before it."""
    import random

    rng = random.Random(65)
    ns: dict[str, Any] = {"___odict_getitem": lambda d, k: dict.__getitem__(d, k)}
    pool = _generated_conds(rng, 40)
    for _ in range(60):
        conds = rng.sample(pool, rng.randint(1, 12))
        body = g.guard_lines(conds, True)
        assert "__cc_L" not in body, body
        src = ("def f(x):\n    try:\n" + "".join(f"        {ln}\n" for ln in body.splitlines())
               + "        return True\n    except Exception:\n        return False\n")
        env = dict(ns)
        exec(src, env)
        for _ in range(5):
            x = _tree(rng, 4)

            def one(c: str, x: Any = x) -> bool:
                try:
                    return bool(eval(c, dict(ns), {"x": x}))
                except Exception:
                    return False
            assert env["f"](x) == all(one(c) for c in conds), (conds, body)
        # Each path read once: no binding repeats a path, and names start from 0 per body.
        binds = [ln for ln in body.splitlines() if ln.startswith("__cc_p")]
        paths = [ln.split(" = ", 1)[1] for ln in binds]
        assert len(paths) == len(set(paths)), body
        assert [ln.split(" = ", 1)[0] for ln in binds] == [f"__cc_p{i}"
                                                           for i in range(len(binds))], body
