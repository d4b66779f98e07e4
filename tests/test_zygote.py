"""The suite's fork server (tests/zygote.py) gives what a fresh ``python -c`` gives.

Each difference tests/zygote.py lists is held by one of these tests: made equal (the
child is compared with a plain interpreter's), sent to a plain interpreter (the choice
is checked), or left (what would notice it is checked not to)."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import zygote
from ccutil import PLAIN, REPO, ZYGOTE, ZYGOTE_COMPILER, Sandbox, choose_process

# The tests that compare a zygote's child with a plain interpreter, or check which one
# ran: nothing to compare where every child is a plain interpreter.
needs_zygotes = pytest.mark.skipif(os.environ.get("CC_TESTS_ZYGOTE", "1") == "0",
                                   reason="CC_TESTS_ZYGOTE=0: every child is a plain interpreter")

PROBE = """
import torch
import atexit, logging, os, signal, sys, warnings
atexit.register(lambda: print("RESULT " + _json.dumps({"atexit": True}), flush=True))
report({"hash": hash("cachecompile"), "pid": os.getpid(), "cwd": os.getcwd(),
        "path0": sys.path[:3], "argv": sys.argv, "main": __name__,
        "env": os.environ.get("CC_ZYGOTE_PROBE"), "dynamo": "torch._dynamo" in sys.modules,
        "inductor": "torch._inductor" in sys.modules,
        "isa_known": "torch._inductor.cpu_vec_isa" in sys.modules and
            sys.modules["torch._inductor.cpu_vec_isa"].valid_vec_isa_list.cache_info().currsize,
        "ours": sorted(m for m in sys.modules if m.split(".")[0] in ("cachecompile", "ccutil", "zygote"))})
# What a plain interpreter must show alike (test_a_zygote_child_is_a_fresh_python_c).
report({"modules": sorted(sys.modules), "fds": sorted(os.listdir("/proc/self/fd")),
        "stdin": os.readlink("/proc/self/fd/0"), "session": os.getsid(0) == os.getpid(),
        "orig_argv": sys.orig_argv[1:], "main_names": sorted(vars(sys.modules["__main__"])),
        "signals": {s.name: repr(signal.getsignal(s)) for s in signal.Signals
                    if s not in (signal.SIGKILL, signal.SIGSTOP)},
        "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "warnings": [repr(f) for f in warnings.filters], "atexit": atexit._ncallbacks(),
        "loggers": sorted(logging.root.manager.loggerDict),
        "root_logger": [logging.root.level, [repr(h) for h in logging.root.handlers]],
        "threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
        "flags": repr(sys.flags), "warnoptions": sys.warnoptions,
        "tasks": (__import__("numpy").ones((256, 256)) @ __import__("numpy").ones((256, 256)),
                  len(os.listdir("/proc/self/task")))[1]})
sys.stderr.write("to stderr\\n")
sys.exit(int(os.environ.get("CC_ZYGOTE_RC", "0")))
"""


def _reports(r: Any) -> list[dict[str, Any]]:
    return [json.loads(ln[7:]) for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]


@needs_zygotes
def test_a_zygote_child_is_a_fresh_python_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    assert zygote.script_misfit(PROBE) is None
    box = Sandbox(tmp_path)
    with caplog.at_level(logging.INFO, logger="ccutil"):
        a = box.run(PROBE, compiles=False, CC_ZYGOTE_PROBE="one")
        b = box.run(PROBE, compiles=False, CC_ZYGOTE_PROBE="two")
        c = box.run(PROBE, compiles=False, CC_ZYGOTE_PROBE="three")
    # Sandbox.run says which kind of process it made, and why.
    said = [r.getMessage() for r in caplog.records if r.name == "ccutil"]
    assert len(said) == 3 and all(f": {ZYGOTE}, because the test said compiles=False" in m
                                  for m in said), said
    for r in (a, b, c):
        assert r.value == {"atexit": True}  # the last RESULT line: atexit ran at the exit
        assert "to stderr" in r.stderr
    (va, sa), (vb, _), (vc, _) = (_reports(r)[:2] for r in (a, b, c))
    assert (va["env"], vb["env"]) == ("one", "two")
    assert va["cwd"] == str(tmp_path) and va["argv"] == ["-c"] and va["main"] == "__main__"
    assert va["path0"][0] == "" and va["path0"][1] == str(REPO)
    assert va["pid"] != vb["pid"] != os.getpid()
    # The hash seed: consecutive children of one sandbox fork from two zygotes (two
    # seeds), as two fresh interpreters have; the first and the third share one.
    assert va["hash"] != vb["hash"] and va["hash"] == vc["hash"]
    assert not va["dynamo"] and not va["inductor"] and va["ours"] == []
    bad = box.run(PROBE, check=False, compiles=False, CC_ZYGOTE_RC="3")
    assert bad.rc == 3

    # The same script in a plain interpreter: the same view of its start, the same
    # output of torch's import (a DeprecationWarning under PYTHONWARNINGS=default).
    monkeypatch.setenv("CC_TESTS_ZYGOTE", "0")
    with caplog.at_level(logging.INFO, logger="ccutil"):
        p = box.run(PROBE, compiles=False, CC_ZYGOTE_PROBE="one")
    assert f": {PLAIN}, because CC_TESTS_ZYGOTE=0 turns zygotes off" in caplog.records[-1].getMessage()
    vp, sp = _reports(p)[:2]
    assert {k: v for k, v in va.items() if k not in ("hash", "pid")} == {
        k: v for k, v in vp.items() if k not in ("hash", "pid")}
    assert sa["orig_argv"][0] == "-c" and "report(" in sa["orig_argv"][1]
    for k in sa:
        assert sa[k] == sp[k], (k, sa[k], sp[k])
    before_ours = [ln for ln in a.stderr.splitlines() if ln != "to stderr"]
    assert before_ours == [ln for ln in p.stderr.splitlines() if ln != "to stderr"]


DRAW = """
import torch
import random
report({"torch": torch.rand(1).item(), "seed": torch.initial_seed(), "random": random.random()})
"""


@needs_zygotes
def test_children_draw_as_fresh_interpreters_do(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Four children of the two plain zygotes draw four different torch.rand(1) and
    random.random(), as two plain interpreters draw two (before, 0.873, 0.819, 0.873, 0.819)."""
    box = Sandbox(tmp_path)
    forked = [box.run(DRAW, compiles=False).value for _ in range(4)]
    monkeypatch.setenv("CC_TESTS_ZYGOTE", "0")
    plain = [box.run(DRAW, compiles=False).value for _ in range(2)]
    for name in ("torch", "seed", "random"):
        assert len({d[name] for d in plain}) == 2, plain
        assert len({d[name] for d in forked}) == 4, (name, forked)


GENERATORS = """
import torch
import gc, random, sys, types
found = []
kinds = [random.Random]
if "numpy.random" in sys.modules:
    import numpy
    kinds += [numpy.random.RandomState, numpy.random.Generator]
def holders(obj):
    # Where a module, or a class a module defines, holds it.
    for m in list(sys.modules.values()):
        for k, v in list(getattr(m, "__dict__", {}).items()):
            if v is obj and m.__name__ != "__main__":
                yield f"{m.__name__}.{k}"
            elif type(v) is types.MethodType and v.__self__ is obj and m.__name__ != "__main__":
                yield f"{m.__name__}.{k}.__self__"   # a bound method (randrange = R().randrange)
            elif isinstance(v, type) and v.__module__ == m.__name__:
                yield from (f"{m.__name__}.{k}.{a}" for a, w in list(vars(v).items()) if w is obj)
import tempfile
gc.unfreeze()   # what the zygote froze (zygote.FROZEN), back in get_objects()' view
for obj in gc.get_objects():
    if isinstance(obj, tuple(kinds)) and not isinstance(obj, random.SystemRandom):
        names = sorted(holders(obj))
        if getattr(tempfile._name_sequence, "_rng", None) is obj:
            names.append("tempfile._name_sequence._rng")
        found.append(names or [type(obj).__qualname__ + " (held by no module)"])
import numpy.random, sympy
mi = sys.modules.get("more_itertools.recipes")
report({"found": sorted(found), "torch": torch.rand(1).item(), "numpy": numpy.random.rand(),
        "more_itertools": (mi._private_randrange(10**12)
                           if getattr(mi, "_private_randrange", None) else None),
        "sympy": [sympy.core.random.rng.random(), sympy.core.random._assumptions_rng.random(),
                  sympy.Dummy("x").dummy_index]})
"""


@needs_zygotes
@pytest.mark.slow
def test_every_generator_in_a_zygote_is_reseeded(tmp_path: Path) -> None:
    """The zygote with the most imported (Dynamo and Inductor's compiler: numpy.random,
    sympy) holds no random generator but the ones its children reseed
    (zygote.RESEEDED, and Python's ``random``), and two of its children draw
    differently from each of them."""
    box = Sandbox(tmp_path)
    one, two = (box.run(GENERATORS, compiles=True) for _ in range(2))
    reseeded = {"random._inst", "numpy.random.mtrand._rand", "sympy.core.random.rng",
                "sympy.core.random._assumptions_rng", "sympy.core.symbol.Dummy._prng"}
    # Made by the zygote's ISA probe (zygote.PROBES), where its imports still bring them
    # in: tempfile's name sequence draws a new generator itself in a process of another
    # pid (_RandomNameSequence._rng_pid); more_itertools' is in zygote.RESEEDED (and its
    # draws are compared below).
    own = {"tempfile._name_sequence._rng", "more_itertools.recipes._private_randrange.__self__"}
    unknown = [names for names in one["found"] if not (reseeded | own) & set(names)]
    assert unknown == [], f"generators the zygote's children do not reseed: {unknown}"
    seen = {name for names in one["found"] for name in names} & reseeded
    assert seen == reseeded, f"the test no longer finds {sorted(reseeded - seen)}"
    for name in ("torch", "numpy"):
        assert one[name] != two[name], name
    assert one["more_itertools"] is None or one["more_itertools"] != two["more_itertools"]
    assert all(a != b for a, b in zip(one["sympy"], two["sympy"], strict=True)), (
        one["sympy"], two["sympy"])


def test_scripts_that_do_something_before_torch_run_as_plain_interpreters() -> None:
    assert "line 2" in (zygote.script_misfit("import os\nos.environ['X'] = '1'\nimport torch\n")
                        or "")
    assert "imports cachecompile before torch" in (
        zygote.script_misfit("from cachecompile import cache_compile\n") or "")
    assert zygote.script_misfit("# a comment\n\nimport torch, sys\n") is None
    assert zygote.script_misfit("import torch.nn as nn\n") is None
    # Standard-library imports before torch set nothing torch's import reads.
    assert zygote.script_misfit("import os, sys, torch\n") is None
    assert zygote.script_misfit(
        "from __future__ import annotations\nimport json\nfrom torch import nn\n") is None
    assert zygote.script_misfit("import numpy\nimport torch\n") is not None
    assert zygote.script_misfit("import os\nprint(os.getpid())\nimport torch\n") is not None
    assert zygote.script_misfit("import os\n") == "it never imports torch"


FORKED = ("import torch, os\n"
          "report({'fork': os.getppid() != int(os.environ['CC_TEST_PID']),"
          " 'umask': os.umask(0o22)})")


@needs_zygotes
def test_an_environment_torch_reads_at_import_gets_a_plain_interpreter(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    # TORCH_LOGS is read by `import torch`: a zygote that imported torch without it cannot
    # stand in for a fresh process that has it. LC_ALL sets Python's locale at its start.
    plain = box.run(FORKED, TORCH_LOGS="-all", CC_TEST_PID=str(os.getpid()))
    locale = box.run(FORKED, LC_ALL="C", CC_TEST_PID=str(os.getpid()))
    forked = box.run(FORKED, CC_TEST_PID=str(os.getpid()))
    assert (plain["fork"], locale["fork"], forked["fork"]) == (False, False, True)


@needs_zygotes
def test_a_changed_umask_gets_a_plain_interpreter(tmp_path: Path) -> None:
    """What a child inherits from its parent beyond the environment: a zygote's child has
    the test process's as it was when the zygote started, so a change since means a plain
    interpreter, which has the new one."""
    box = Sandbox(tmp_path)
    # compiles=False: the plain zygotes, started before the window. On an empty store a run
    # is a cold one, whose zygote (the compiling one), or choose_process's (a plain one),
    # could start inside the window, with umask 077: a worker whose first zygote test this
    # was then ran every later child as python -c, and those tests failed.
    assert box.run(FORKED, compiles=False, CC_TEST_PID=str(os.getpid()))["fork"]
    old = os.umask(0o077)
    try:
        child = box.run(FORKED, compiles=False, CC_TEST_PID=str(os.getpid())).value
        why = choose_process(f"import torch\n{FORKED}", box.env(), base=box.env(),
                             compiles=False, store=box.store, turn=0).why
    finally:
        os.umask(old)
    assert child == {"fork": False, "umask": 0o077}
    assert "umask changed since the zygote started" in why


@needs_zygotes
def test_a_module_on_pythonpath_that_shadows_one_torch_imported(tmp_path: Path) -> None:
    """A fresh interpreter would import a module of the script's PYTHONPATH in place of
    the one a zygote imported (here typing_extensions, which torch imports): a plain interpreter."""
    box = Sandbox(tmp_path)
    script = "import torch\nreport({})\n"
    assert choose_process(script, box.env(), base=box.env(), compiles=False, store=box.store,
                          turn=0).kind == ZYGOTE
    (tmp_path / "typing_extensions.py").write_text("raise ImportError('shadowed')\n")
    process = choose_process(script, box.env(), base=box.env(), compiles=False,
                             store=box.store, turn=0)
    assert process.kind == PLAIN and "typing_extensions" in process.why, process
    r = box.run(script, check=False, compiles=False)
    assert r.rc != 0 and "shadowed" in r.stderr   # what a fresh interpreter does with it


# What a fork leaves different from a fresh interpreter (tests/zygote.py, "Parent, session,
# command line" and "Memory"): no code under test reads it, and no test measures it.
_FORK_VISIBLE = re.compile(r"getppid|/proc/self/(cmdline|stat\b)|orig_argv|getsid|getpgid|"
                           r"getpgrp|ru_maxrss|VmHWM|VmRSS|memory_info")


def test_nothing_of_cachecompile_reads_what_a_fork_changes() -> None:
    here = Path(__file__).resolve()
    sources = [*(REPO / "cachecompile").rglob("*.py"), *(REPO / "store").rglob("*.py"),
               *(p for p in (REPO / "tests").rglob("*.py") if p not in (here, REPO / "tests" / "zygote.py"))]
    found = [f"{p.relative_to(REPO)}:{n}" for p in sources
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if _FORK_VISIBLE.search(line)]
    assert found == [], found


def _probe(r: Any) -> dict[str, Any]:
    return _reports(r)[0]


@needs_zygotes
def test_a_compiling_child_forks_with_the_compiler_imported_only_on_shared_dirs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cold child (empty store) gets Dynamo and Inductor's compiler already imported,
    and is otherwise the same fresh ``python -c``; a child on fresh Inductor dirs (which
    Inductor's import reads) and a warm one do not."""
    box = Sandbox(tmp_path)
    with caplog.at_level(logging.INFO, logger="ccutil"):
        cold = _probe(box.run(PROBE, CC_ZYGOTE_PROBE="cold"))   # nothing in the store yet
    assert f": {ZYGOTE_COMPILER}, because its store is empty (a cold run), on the session's" \
        in caplog.records[-1].getMessage()
    assert cold["dynamo"] and cold["inductor"] and cold["ours"] == []
    # Inductor's ISA probe ran in the zygote (zygote.PROBES), its g++ calls in no sandbox's log.
    assert cold["isa_known"] and box.compiler_calls() == 0, (cold, box.compiler_calls())
    assert cold["env"] == "cold" and cold["argv"] == ["-c"] and cold["cwd"] == str(tmp_path)
    fresh = _probe(box.run(PROBE, fresh_inductor=True))
    assert not fresh["dynamo"] and not fresh["inductor"]
    # An entry's folder (the store's layout): warm. An empty shard is no entry.
    from cachecompile.store.keys import DIGEST_LEN

    (box.store / "v1" / "entries" / "ab" / ("ab" + "0" * (DIGEST_LEN - 2))).mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="ccutil"):
        warm = _probe(box.run(PROBE))
    assert "its store holds an entry (a warm run" in caplog.records[-1].getMessage()
    assert not warm["dynamo"] and not warm["inductor"]
