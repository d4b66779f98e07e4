"""The guard checker's words, recorded: what ``explain``, ``failure`` and ``lines`` say over
the guard matrix's cases (tests/e2e/test_guard_matrix.py) and generated ones
(tests/guard_gen.py), kept in tests/entry/golden/ so that a rewrite of the checker
(issue 52: ``entry/checker.py``) can be shown to say exactly what it said before.

Recording (``python tests/checker_golden.py``) compiles each case cold, in this process,
with the real ``cache_compile`` into a scratch store and keeps the portable guards the
entry holds; the test (tests/entry/test_checker_golden.py) needs no Dynamo: it rebuilds
each case's live objects, builds the checker from the recorded guards and compares what
it says for the unchanged call and for each failing one. Guards name code digests and
the entry's stored code object is marshal's: both belong to one Python release, so the
golden is per Python ``major.minor``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import os
import re
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import guard_gen
import torch

from cachecompile.entry import checker as checker_mod
from cachecompile.warm import replay

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "entry" / "golden" / f"checker_py{sys.version_info[0]}.{sys.version_info[1]}.json"
# Generated cases: one seed, one case per access kind as the first access (guard_gen).
SEED, N_GENERATED = 52, len(guard_gen.KINDS)
# The changed process's environment in the guard matrix (its _run).
MATRIX_ENV = {"GM_CHANGE": "1", "GM_SCALE": "3.0", "GM_FLAG": "1"}
logger = logging.getLogger(__name__)
THREADS = 1   # global state guards hold the thread count: recorded and checked under one


def _matrix_sources() -> tuple[str, str]:
    sys.path.insert(0, str(HERE / "e2e"))
    try:
        import test_guard_matrix as gm
    finally:
        sys.path.remove(str(HERE / "e2e"))
    return gm.HELPER, gm.CASES


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fresh(name: str) -> types.ModuleType:
    """``name`` imported again (its helper too): a module's state at import is the case."""
    for n in [n for n in sys.modules if n == name or n.startswith(name.split("_")[0] + "_")]:
        del sys.modules[n]
    return importlib.import_module(name)


# -- one case: its live objects, unchanged and changed ---------------------------------------
class Case:
    """What a case's checker runs on: the method's function, its module, and the calls."""

    def __init__(self, name: str, make: Callable[[bool], tuple[Any, tuple[Any, ...]]],
                 ctx: Callable[[], contextlib.AbstractContextManager[Any]],
                 env: dict[str, str]) -> None:
        self.name = name
        self.make = make    # changed -> (module instance, args)
        self.ctx = ctx      # the changed call's context (autocast, a function mode)
        self.env = env      # the changed process's environment


def matrix_cases(root: Path) -> list[Case]:
    helper, cases = _matrix_sources()
    (root / "gm_helper.py").write_text(helper)
    (root / "gm_cases.py").write_text(cases)
    out: list[Case] = []
    for cls_name in _matrix_names(root):
        def make(changed: bool, cls_name: str = cls_name) -> tuple[Any, tuple[Any, ...]]:
            with environ(MATRIX_ENV if changed else {"GM_CHANGE": "0"}):
                mod = _fresh("gm_cases")
            m = getattr(mod, cls_name)().eval()
            if changed and cls_name == "InstanceMethodPatched":
                m.helper = types.MethodType(lambda self, y: y * 5, m)
            return m, tuple(m.inputs())

        def ctx(cls_name: str = cls_name) -> contextlib.AbstractContextManager[Any]:
            kind = getattr(getattr(sys.modules["gm_cases"], cls_name), "ctx", None)
            if kind == "autocast":
                return torch.autocast("cpu", dtype=torch.bfloat16)
            if kind == "mode":
                return sys.modules["gm_cases"].Doubler()
            return contextlib.nullcontext()
        out.append(Case(f"matrix:{cls_name}", make, ctx, MATRIX_ENV))
    return out


def _matrix_names(root: Path) -> list[str]:
    with environ({"GM_CHANGE": "0"}):
        return [c.__name__ for c in _fresh("gm_cases").ALL]


def generated_cases(root: Path) -> list[Case]:
    batch = guard_gen.cases(SEED, N_GENERATED, inductor_every=0)
    guard_gen.write(root, batch)
    out: list[Case] = []
    for c in batch:
        def make(changed: bool, name: str = c.name) -> tuple[Any, tuple[Any, ...]]:
            mod = _fresh(name)
            m = mod.Net().eval()
            if changed:
                mod.change(m)
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)) - 0.3
            return m, (x,)
        out.append(Case(f"generated:{c.name}", make, contextlib.nullcontext, {}))
    return out


# -- what a checker says ----------------------------------------------------------------------
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
# A file path in a repr (a module's, a code object's): the scratch directory or the venv.
# Where ``values.short`` cut the repr, where it cuts depends on the path's length (in the
# path, or after it, at ``", line 2100``), so all from the path to the cut is one mark.
_CUT_PATH = re.compile(r"""(['"])/[^)]*?\.{3,}""")
_PATH = re.compile(r"""(['"])/[^'"]*?(['"])""")


def _plain(v: Any) -> Any:
    """A result as JSON holds it, with memory addresses and file paths (object reprs)
    made equal."""
    if isinstance(v, str):
        v = _CUT_PATH.sub(r"\1<path>...", _ADDRESS.sub("0x?", v))
        return _PATH.sub(r"\1<path>\2", v)
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def says(build: Callable[..., Any], m: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    """Everything a checker of each mode says about one call."""
    out: dict[str, Any] = {}
    for mode, kw in (("first", {"every_call": False}), ("always", {"every_call": True})):
        c = build(**kw)
        out[mode] = {"full": c.full(m, *args), "per_call": c.per_call(m, *args),
                     "explain": c.explain(m, *args), "failure": c.failure(m, *args)}
    return _plain(out)


def calls(case: Case) -> Iterator[tuple[str, Any, tuple[Any, ...],
                                        contextlib.AbstractContextManager[Any]]]:
    """The calls a case's checker is asked about: the one it was made for, then each
    failing one (the case's own change, grad mode on, a tensor argument of another rank,
    an object that is not the module)."""
    m, args = case.make(False)
    yield "same", m, args, contextlib.nullcontext()
    yield "grad", m, args, torch.enable_grad()
    ranked = tuple(a.unsqueeze(-1) if isinstance(a, torch.Tensor) else a for a in args)
    yield "rank", m, ranked, contextlib.nullcontext()
    yield "not the module", object(), args, contextlib.nullcontext()
    with environ(case.env):
        m2, args2 = case.make(True)
        yield "changed", m2, args2, case.ctx()


def observe(case: Case, guards: list[dict[str, Any]], imports: dict[str, str]
            ) -> dict[str, Any]:
    """What the checker says for each of a case's calls, and the lines it stores."""
    out: dict[str, Any] = {}
    m, _ = case.make(False)
    func = type(m).run
    g = replay.replay_globals(func, imports)
    out["lines"] = checker_mod.build_checker(func, guards, g).lines()
    for what, m, args, ctx in calls(case):
        func = getattr(type(m), "run", func)
        g = replay.replay_globals(func, imports)
        with torch.no_grad(), ctx:
            out[what] = says(functools.partial(checker_mod.build_checker, func, guards, g),
                             m, args)
    return _plain(out)


@contextlib.contextmanager
def pinned_state() -> Iterator[None]:
    """The global state a golden was recorded in (its global_state guards hold it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- recording --------------------------------------------------------------------------------
def _capture(case: Case, store: Path) -> tuple[list[dict[str, Any]], dict[str, str]] | None:
    """The portable guards (and the bytecode's imports) of the case's cold entry."""
    from cachecompile import cache_compile

    m, args = case.make(False)
    try:
        cached = cache_compile(m.run, backend="aot_eager", cache_dir=store,
                               dynamic=getattr(type(m), "dynamic", True))
        with torch.no_grad():
            cached(*args)
    except Exception as e:  # this torch cannot compile it: not a case here
        logger.warning("%s: not recorded (%s: %s)", case.name, type(e).__name__, e)
        return None
    for p in store.rglob("manifest.json"):
        meta = json.loads(p.read_text()).get("meta") or {}
        if meta.get("guards"):
            return meta["guards"], meta.get("imports") or {}
    logger.warning("%s: no entry with guards", case.name)
    return None


def all_cases(root: Path) -> list[Case]:
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return matrix_cases(root) + generated_cases(root)


def record() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="cc-golden-"))
    out: dict[str, Any] = {"python": list(sys.version_info[:2]), "torch": torch.__version__,
                           "cases": {}}
    with pinned_state():
        for i, case in enumerate(all_cases(root)):
            got = _capture(case, root / f"store{i}")
            if got is None:
                continue
            guards, imports = got
            out["cases"][case.name] = {"guards": guards, "imports": imports,
                                       "says": observe(case, guards, imports)}
            logger.info("%s: %d guards", case.name, len(guards))
    return out


def mismatches(golden: dict[str, Any], names: list[str] | None = None) -> list[str]:
    """Where the checker today says other than ``golden`` (the cases named, or all)."""
    root = Path(tempfile.mkdtemp(prefix="cc-golden-"))
    out: list[str] = []
    with pinned_state():
        for case in all_cases(root):
            want = golden["cases"].get(case.name)
            if want is None or (names is not None and case.name not in names):
                continue
            got = observe(case, want["guards"], want["imports"])
            for what in sorted(set(got) | set(want["says"])):
                if got.get(what) != want["says"].get(what):
                    out.append(f"{case.name} {what}: got {got.get(what)!r}, "
                               f"recorded {want['says'].get(what)!r}")
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n")
    logger.info("wrote %s", GOLDEN)
