"""The suite's fork server (tests/zygote.py) gives what a fresh ``python -c`` gives."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import zygote
from ccutil import Sandbox

PROBE = """
import torch
import atexit, os, sys
atexit.register(lambda: print("RESULT " + _json.dumps({"atexit": True}), flush=True))
report({"hash": hash("cachecompile"), "pid": os.getpid(), "cwd": os.getcwd(),
        "path0": sys.path[:3], "argv": sys.argv, "main": __name__,
        "env": os.environ.get("CC_ZYGOTE_PROBE"), "dynamo": "torch._dynamo" in sys.modules,
        "inductor": "torch._inductor" in sys.modules,
        "ours": sorted(m for m in sys.modules if m.split(".")[0] in ("cachecompile", "ccutil", "zygote"))})
sys.stderr.write("to stderr\\n")
sys.exit(int(os.environ.get("CC_ZYGOTE_RC", "0")))
"""


def test_a_zygote_child_is_a_fresh_python_c(tmp_path: Path) -> None:
    assert zygote.usable(PROBE)
    box = Sandbox(tmp_path)
    a = box.run(PROBE, compiles=False, CC_ZYGOTE_PROBE="one")
    b = box.run(PROBE, compiles=False, CC_ZYGOTE_PROBE="two")
    for r in (a, b):
        assert r.value == {"atexit": True}  # the last RESULT line: atexit ran at the exit
        assert "to stderr" in r.stderr
    va, vb = (json.loads(next(ln[7:] for ln in r.stdout.splitlines()
                              if ln.startswith("RESULT "))) for r in (a, b))
    assert (va["env"], vb["env"]) == ("one", "two")
    assert va["cwd"] == str(tmp_path) and va["argv"] == ["-c"] and va["main"] == "__main__"
    assert va["path0"][0] == "" and va["path0"][1] == str(Path(__file__).resolve().parent.parent)
    assert va["pid"] != vb["pid"] != os.getpid()
    # Consecutive children of one sandbox fork from two zygotes: two hash seeds, as two
    # fresh interpreters have.
    assert va["hash"] != vb["hash"]
    assert not va["dynamo"] and not va["inductor"] and va["ours"] == []
    bad = box.run(PROBE, check=False, compiles=False, CC_ZYGOTE_RC="3")
    assert bad.rc == 3


def test_scripts_that_do_something_before_torch_run_as_plain_interpreters() -> None:
    assert not zygote.usable("import os\nos.environ['X'] = '1'\nimport torch\n")
    assert not zygote.usable("from cachecompile import cache_compile\n")
    assert zygote.usable("# a comment\n\nimport torch, sys\n")
    assert zygote.usable("import torch.nn as nn\n")
    # Standard-library imports before torch set nothing torch's import reads.
    assert zygote.usable("import os, sys, torch\n")
    assert zygote.usable("from __future__ import annotations\nimport json\nfrom torch import nn\n")
    assert not zygote.usable("import numpy\nimport torch\n")
    assert not zygote.usable("import os\nprint(os.getpid())\nimport torch\n")


def test_an_environment_torch_reads_at_import_gets_a_plain_interpreter(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    script = ("import torch, os\n"
              "report({'fork': os.getppid() != int(os.environ['CC_TEST_PID'])})")
    # TORCH_LOGS is read by `import torch`: a zygote that imported torch without it cannot
    # stand in for a fresh process that has it.
    plain = box.run(script, TORCH_LOGS="-all", CC_TEST_PID=str(os.getpid()))
    forked = box.run(script, CC_TEST_PID=str(os.getpid()))
    assert plain["fork"] is False and forked["fork"] is True


def _probe(r: Any) -> dict[str, Any]:
    return dict(json.loads(next(ln[7:] for ln in r.stdout.splitlines()
                                if ln.startswith("RESULT "))))


def test_a_compiling_child_forks_with_the_compiler_imported_only_on_shared_dirs(
        tmp_path: Path) -> None:
    """A cold child (empty store) gets Dynamo and Inductor's compiler already imported,
    and is otherwise the same fresh ``python -c``; a child on fresh Inductor dirs (which
    Inductor's import reads) and a warm one do not."""
    box = Sandbox(tmp_path)
    cold = _probe(box.run(PROBE, CC_ZYGOTE_PROBE="cold"))   # nothing in the store yet
    assert cold["dynamo"] and cold["inductor"] and cold["ours"] == []
    assert cold["env"] == "cold" and cold["argv"] == ["-c"] and cold["cwd"] == str(tmp_path)
    fresh = _probe(box.run(PROBE, fresh_inductor=True))
    assert not fresh["dynamo"] and not fresh["inductor"]
    # An entry's folder (the store's layout): warm. An empty shard is no entry.
    from cachecompile.store.keys import DIGEST_LEN

    (box.store / "v1" / "entries" / "ab" / ("ab" + "0" * (DIGEST_LEN - 2))).mkdir(parents=True)
    warm = _probe(box.run(PROBE))
    assert not warm["dynamo"] and not warm["inductor"]
