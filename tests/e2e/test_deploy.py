"""docs/deploy.md, followed as written, with a transformers decoder the zoo does not use
(Phi-3 from a tiny config): the page's own app/model.py, app/build.py and app/serve.py
(taken from its code blocks), then build -> export -> import -> verify -> serve read-only
-> check, each a fresh process. Serving must compile nothing (a logging g++ counts, in
fresh Inductor dirs), give eager's tokens, and `cachectl stats` must show its hits."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ccutil import REPO, Sandbox

pytestmark = pytest.mark.slow

DOC = REPO / "docs" / "deploy.md"


def doc_files() -> dict[str, str]:
    """The page's Python code blocks that name their file (``# app/model.py``)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    return {m.group(1): b for b in blocks if (m := re.match(r"# (app/\S+\.py)\n", b))}


def test_the_page_names_its_files() -> None:
    assert set(doc_files()) == {"app/model.py", "app/build.py", "app/serve.py"}


# What the test adds to serve.py's run: eager's tokens to compare, and what the cached
# methods did (the page's serve.py prints the tokens only).
CHECK = """
import json, sys
import torch
from app.model import Served
m = Served().eval()
# --one-token: a 1-token prompt, which the page's factory does not list (its own
# signature, as the page says), generating one token: the prefill alone (its miss is the
# check; a decode miss would be a second whole compile of the model).
one = "--one-token" in sys.argv
prompt = torch.randint(1, 256, (1, 1 if one else 7), generator=torch.Generator().manual_seed(5))
steps = 1 if one else 6
got = m.generate(prompt, steps)
want = m.generate(prompt, steps, cached=False)
print("RESULT " + json.dumps({
    "equal": torch.equal(got, want),
    "events": [e for f in (m.cached_prefill, m.cached_decode) for e, _ in f.events]}))
"""


def _run(box: Sandbox, env: dict[str, str], *cmd: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(cmd), env=env, cwd=box.root, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, (cmd, p.stdout, p.stderr[-4000:])
    return p


def test_deploy_page_step_by_step(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    for name, text in doc_files().items():
        (box.root / name).parent.mkdir(parents=True, exist_ok=True)
        (box.root / name).write_text(text)
    (box.root / "app" / "__init__.py").write_text("")
    (box.root / "check.py").write_text(CHECK)
    cachectl = [sys.executable, "-m", "cachecompile.cli.main"]
    key = tmp_path / "cc-key"
    key.write_text("a-signing-key-for-the-test-0123456789")
    os.chmod(key, 0o600)
    signed = {"CACHECOMPILE_SIGNING_KEY": f"file:{key}"}
    build_dir, image = tmp_path / "build", tmp_path / "image"

    # 1. Build (on the build machine).
    env = box.env(CACHECOMPILE_DIR=str(build_dir))
    p = _run(box, env, *cachectl, "build", "app.build:factory", "--jobs", "2")
    assert "2 built, 0 present, 0 not served" in p.stdout, p.stdout
    # 2. Export, signed.
    _run(box, {**env, **signed}, *cachectl, "export", "--cache-dir", str(build_dir),
         str(tmp_path / "warm.tar.zst"), "--model", "Served")
    # 3. Into the image: import (verified, signatures required), verify, ls.
    img = box.env(CACHECOMPILE_DIR=str(image), environ=signed)
    _run(box, img, *cachectl, "import", str(tmp_path / "warm.tar.zst"))
    _run(box, img, *cachectl, "verify")
    ls = _run(box, img, *cachectl, "ls")
    assert "prefill" in ls.stdout and "decode" in ls.stdout
    # 4. Serve read-only, from fresh Inductor dirs: zero compiles, eager's tokens.
    serve = dict(img, CACHECOMPILE_READONLY="1")
    box.reset_compiler_log()
    fresh = {**serve, **box.fresh_inductor_dirs()}
    out = _run(box, fresh, sys.executable, "-m", "app.serve")
    assert re.fullmatch(r"\[\[(\d+, ){5}\d+\]\]\n", out.stdout), out.stdout
    p = _run(box, {**serve, **box.fresh_inductor_dirs()}, sys.executable, "check.py")
    res = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert res["equal"] and res["events"] == ["hit", "hit"], res
    assert box.compiler_calls() == 0, "serving compiled"
    # The page's check: every signature `present`, exit 0; stats shows the hits.
    built = json.loads(_run(box, serve, *cachectl, "build", "app.build:factory",
                            "--json").stdout)
    assert [r["status"] for r in built] == ["present", "present"], built
    s = json.loads(_run(box, serve, *cachectl, "stats", "--json").stdout)
    assert s["readonly_processes"]["hits"] >= 4 and s["misses"] == {}, s
    assert box.compiler_calls() == 0
    # A prompt length the factory did not list (one token) is a miss that stats names (and
    # it runs right). It compiles, in the session's Inductor dirs: no compiler calls are
    # counted from here on. (A static compile: an unlisted batch size was a dynamic one,
    # twice the time, for the same check.)
    p = _run(box, serve, sys.executable, "check.py", "--one-token")
    res = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert res["equal"] and res["events"] == ["miss"], res
    s = json.loads(_run(box, serve, *cachectl, "stats", "--json").stdout)
    assert s["misses"] == {"absent": 1}, s
    assert s["misses_about"] == {"absent": {"signature": 1}}, s
