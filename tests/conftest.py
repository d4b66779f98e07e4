"""Shared test setup: make the repository importable, also in child processes, and give
the session one shared set of Inductor caches for the children whose subject is not the
compiler (tests/ccutil.py says which)."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
# The repository, and tests/ itself: the test folders mirror the packages
# (tests/key, tests/cold, ...), and their modules import the shared helpers here
# (ccutil, redis_util, tiny, zoo) by name.
for path in (TESTS, REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# The suite runs two xdist workers on two cores, each with children whose OpenMP has a
# thread per core: libgomp's threads spin while they wait for work (OMP_WAIT_POLICY's
# default), and with more threads than cores that spinning took ~8% of the suite's CPU
# (tests/e2e/test_zoo.py's UNet: 121 s of CPU against 111 s passive). Passive waiting keeps
# every kernel and key as it was (threads are still one per core, and the policy is no key
# factor). Set here, before any torch import: the workers and every child inherit it,
# and libgomp reads it when it loads. A caller's own setting stands.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Inductor compiles in-process, not in its pool of compile workers, here and in every
# Sandbox child (ccutil.Sandbox.env keeps this one of Inductor's variables). On two cores
# its default (one worker per core) starts, in every process that compiles, a sidecar
# interpreter that imports torch and forks the workers (~1.3 s of a core), for a pool
# that is ready only after the short compiles of a test's tiny models are done, and whose
# parallelism two busy xdist workers cannot use: paired on the DiT and the Inductor guard
# matrix, 158/158 s of CPU with it, 144/155 s without. Not a key factor (it changes no
# program: cachecompile's own parallel builds set it the same way, procs/builders.py).
# CI's fresh-process pass keeps Inductor's default (CC_TESTS_INDUCTOR_POOL=1), so the
# pool's path stays tested; a caller's own setting stands.
if os.environ.get("CC_TESTS_INDUCTOR_POOL") != "1":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import breadth  # noqa: E402
import gxx_memo  # noqa: E402
import zygote  # noqa: E402
from ccutil import SHARED_INDUCTOR_ENV, logging_gxx  # noqa: E402

_created: list[str] = []
_set: list[str] = []
# How many of the session's tests tests/breadth.py marked.
_BREADTH = pytest.StashKey[int]()


def _byte_compile() -> None:
    # The tests start hundreds of fresh interpreters that import this checkout. Where
    # PYTHONDONTWRITEBYTECODE is set (as on some CI images), none of them writes the
    # bytecode it compiles, so each compiled ~70 modules from source again (~0.15 s of
    # a core each, measured here). Compiled once here, as a wheel install does, they are read by all; an
    # edited file is compiled again by the interpreter as usual (the source's mtime and
    # size are in the .pyc).
    import compileall

    for sub in ("cachecompile", "store", "tests"):
        compileall.compile_dir(str(REPO / sub), quiet=1, workers=1)


def pytest_configure(config: pytest.Config) -> None:
    # Made once, by the process that starts the session (pytest-xdist's controller, or a
    # plain run); xdist's workers inherit the variable, so all of them share the dirs.
    if not os.environ.get(SHARED_INDUCTOR_ENV):
        _byte_compile()
        path = tempfile.mkdtemp(prefix="cachecompile-tests-inductor-")
        os.environ[SHARED_INDUCTOR_ENV] = path
        _created.append(path)
        # The tests' own processes compile into the same Inductor cache as their children
        # (it was torch's default dir, a second cache): a kernel that an in-process test and
        # a child both build (the same model, the same shapes) is built once. Inductor
        # reads the variable at each compile; Sandbox children get theirs from ccutil.
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(path, "inductor")
            _set.append("TORCHINDUCTOR_CACHE_DIR")
        # The same compiler path as the Sandbox children (ccutil.logging_gxx): Inductor
        # hashes a kernel with its command line, compiler included, so an in-process
        # test and a child compiling the same model share kernels only when both call
        # the same CXX. Set before torch is imported: Inductor's config reads CXX once.
        if "CXX" not in os.environ:
            os.environ["CXX"] = str(logging_gxx(Path(path)))
            _set.append("CXX")


# First, so that -m and -k (pytest's own hook) see the breadth marks.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # What the README command leaves to CI's breadth step (tests/breadth.py).
    config.stash[_BREADTH] = breadth.mark(items, check=breadth.whole(config))
    # The longest tests first, then the other slow ones, then the rest (stable otherwise):
    # pytest-xdist hands tests out in this order, so the long process-heavy ones start
    # early and the quick ones fill the gaps, instead of the longest running last on one
    # core while the other waits. This needs --maxschedchunk=1 (the README's command):
    # xdist's default first batch is a quarter of each worker's share, which would give
    # every one of the longest tests to the first worker.
    items.sort(key=lambda item: (item.get_closest_marker("longest") is None,
                                 item.get_closest_marker("slow") is None))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    # What collection imported (torch, the test modules, what they build at import) moves
    # out of the collector's reach for this process's in-process tests, as each zygote does
    # for its children (zygote.FROZEN, which says what it changes; CC_TESTS_GC_FREEZE=0).
    if zygote.FROZEN:
        gc.collect()
        gc.freeze()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    # Say why tests were left out when -m left out the breadth cases (the README command).
    # Under xdist this process collects nothing (its workers do): no count, the same line.
    n = config.stash.get(_BREADTH, None)
    if "not breadth" in (config.option.markexpr or "") and n != 0:
        terminalreporter.write_line(
            "-m 'not breadth' left out the breadth cases (tests/breadth.py"
            + ("" if n is None else f": {n} here") + "): CI runs them after this "
            "(`bash .ci/breadth.sh`); `-m breadth` runs them here, no -m runs everything")
    # What the session's g++ cost and what its memo saved (tests/gxx_memo.py): the
    # suite's time is mostly C++ compiles, so this is the figure to watch.
    base = os.environ.get(SHARED_INDUCTOR_ENV)
    line = gxx_memo.summary(os.path.join(base, "gxx-memo")) if base else None
    if line:
        terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _created:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(SHARED_INDUCTOR_ENV, None)
    for name in _set:
        os.environ.pop(name, None)


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for a child ``python`` that must import this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("CACHECOMPILE_DIR", None)
    env.pop("CACHECOMPILE_SHARED_GROUP", None)
    return env


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh store root for an in-process cache_compile, with caching on."""
    monkeypatch.delenv("CACHECOMPILE_DISABLE", raising=False)
    return tmp_path / "cc"
