"""A team store: real OS users of one group share a store under either umask.

The test creates a group, two members and an outsider (removed after), and runs each
step as that user (setpriv; CAP_DAC_READ_SEARCH only, so that they can run this checkout's
interpreter, which may live under a private home: it grants reading, never writing, so
every write below is the user's own permission). Needs root; skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SHARED = b"\x7fELF" + bytes(range(256)) * 64   # the same kernel in both members' entries

STEP = r"""
import json, os, sys
from cachecompile.store import Hit, errors, make_key, open_store
root, step = sys.argv[1], sys.argv[2]
shared = bytes.fromhex(sys.argv[3])
out = {"uid": os.getuid()}
try:
    st = open_store(root)
    out["readonly"] = st.readonly
    ka, kb = make_key({"team": "a"}), make_key({"team": "b"})
    if step == "a-publish":
        st.put(ka, {"k.so": shared, "a.py": b"a = 1\n"}, labels={"model": "A", "function": "f"})
        out["hit"] = isinstance(st.get(ka), Hit)
    elif step == "b-publish":
        out["hit_a"] = isinstance(st.get(ka), Hit)
        st.put(kb, {"k.so": shared, "b.py": b"b = 1\n"}, labels={"model": "B", "function": "f"})
        out["hit"] = isinstance(st.get(kb), Hit)
    elif step == "a-reads":
        out["hit_b"] = isinstance(st.get(kb), Hit)
        out["stats"] = {k: st.stats()[k] for k in ("entries", "hits")}
        out["deleted_b"] = st.delete(kb)
except errors.StoreError as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out))
"""


@dataclass
class Team:
    group: str
    members: tuple[str, str]
    outsider: str
    base: Path


def _tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("creating OS users needs root")
    for tool in ("setpriv", "useradd", "groupadd", "userdel", "groupdel"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")


@pytest.fixture
def team() -> Iterator[Team]:
    _tools()
    tag = secrets.token_hex(3)
    group, a, b, c = f"cct{tag}", f"cca{tag}", f"ccb{tag}", f"ccc{tag}"
    made: list[list[str]] = []
    try:
        for cmd in (["groupadd", group],
                    ["useradd", "-M", "-N", "-g", "users", "-G", group, "-s", "/bin/sh", a],
                    ["useradd", "-M", "-N", "-g", "users", "-G", group, "-s", "/bin/sh", b],
                    ["useradd", "-M", "-N", "-g", "users", "-s", "/bin/sh", c]):
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                pytest.skip(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
            made.append(cmd)
        base = Path(f"/tmp/cc-team-{tag}")
        base.mkdir()
        base.chmod(0o1777)   # like /tmp: members make the store in it
        probe = as_user(a, "022", sys.executable, "-c", "import cachecompile.store")
        if probe.returncode != 0:
            pytest.skip(f"cannot run this checkout as another user here: {probe.stderr[-300:]}")
        yield Team(group, (a, b), c, base)
    finally:
        shutil.rmtree(f"/tmp/cc-team-{tag}", ignore_errors=True)
        for cmd in reversed(made):
            if cmd[0] == "useradd":
                subprocess.run(["userdel", cmd[-1]], capture_output=True)
            else:
                subprocess.run(["groupdel", cmd[-1]], capture_output=True)


def as_user(user: str, umask: str, *argv: str) -> subprocess.CompletedProcess[str]:
    uid = subprocess.run(["id", "-u", user], capture_output=True, text=True).stdout.strip()
    gid = subprocess.run(["id", "-g", user], capture_output=True, text=True).stdout.strip()
    repo = str(Path(__file__).resolve().parents[2])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": repo,
           "HOME": "/tmp", "USER": user}
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups",
           "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--",
           "sh", "-c", f'umask {umask}; exec "$@"', "sh", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def step(user: str, umask: str, root: Path, name: str) -> dict[str, object]:
    p = as_user(user, umask, sys.executable, "-c", STEP, str(root), name, SHARED.hex())
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout + p.stderr
    out: dict[str, object] = json.loads(lines[-1][7:])
    out["stderr"] = p.stderr
    return out


@pytest.mark.parametrize("umask", ["022", "002"])
def test_two_members_share_one_store(team: Team, umask: str) -> None:
    a, b = team.members
    root = team.base / "store"
    init = as_user(a, umask, sys.executable, "-m", "cachecompile.cli.main", "init",
                   "--shared", team.group, "--cache-dir", str(root))
    assert init.returncode == 0, init.stdout + init.stderr
    assert oct(root.stat().st_mode & 0o7777) == "0o2770"

    first = step(a, umask, root, "a-publish")
    assert first.get("error") is None and first["hit"] and not first["readonly"], first
    second = step(b, umask, root, "b-publish")
    # B is a full member: not read-only, hits A's entry, publishes its own (the shared
    # kernel is A's file: the kernel refuses B a hard link to it, so B gets a copy).
    assert second.get("error") is None and not second["readonly"], second
    assert second["hit_a"] and second["hit"], second
    third = step(a, umask, root, "a-reads")
    assert third.get("error") is None and third["hit_b"], third
    # Every member's hits reached the index (it was 0644: "readonly database").
    assert third["stats"] == {"entries": 2, "hits": 4}, third
    assert third["deleted_b"] is True   # a member may delete (gc, purge) another's entry
    for out in (first, second, third):
        assert "readonly database" not in str(out["stderr"]), out["stderr"]
        assert "failed" not in str(out["stderr"]), out["stderr"]


def test_a_user_outside_the_group_is_refused_with_the_fix(team: Team) -> None:
    a, _ = team.members
    root = team.base / "store"
    assert as_user(a, "022", sys.executable, "-m", "cachecompile.cli.main", "init",
                   "--shared", team.group, "--cache-dir", str(root)).returncode == 0
    out = step(team.outsider, "022", root, "a-publish")
    err = str(out.get("error"))
    assert err.startswith("InsecureStoreError"), out
    assert f"not in group {team.group}" in err and "usermod -aG" in err, err
