"""Helpers for cache_compile tests: fresh child processes with isolated caches.

Each :class:`Sandbox` has its own cachecompile store. Inductor's own caches (its FX graph
and kernel cache, Triton's, and ``TMPDIR``, where Inductor keeps precompiled headers and
its ISA probe) are, by default, the test session's shared ones
(``CACHECOMPILE_TEST_INDUCTOR_DIR``, set by conftest.py): a child whose subject is *our*
cache (hits, misses, guards, ranks, the store) does not need to build the same C++ kernels
that another test's child already built, just as a user's machine keeps Inductor's cache.
A run whose subject is what the compiler does (``cold == "builds kernels"``, ``warm ==
"zero compiler calls"``) asks for ``fresh_inductor=True``: new, empty dirs, so that a live
compile in a warm process would call g++ and be counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zygote

REPO = Path(__file__).resolve().parent.parent

# A g++ stand-in that logs every invocation to the file its caller names, then runs the
# real compiler. Inductor finds it through CXX, which is in our key and in Inductor's own
# kernel hash (the compile command line): one wrapper *path* for the whole session, so a
# kernel that one sandbox's child built is found by every other child that shares the
# session's Inductor dirs. A per-sandbox path made every sandbox rebuild every kernel
# (issue 36). The log file is per sandbox, through GXX_LOG_ENV (not a key factor).
GXX_LOG_ENV = "CC_TESTS_GXX_LOG"
GXX_WRAPPER = f"""#!/bin/sh
echo "$@" >> "${{{GXX_LOG_ENV}:-/dev/null}}"
exec g++ "$@"
"""
# The session's wrapper logs the same way, then runs g++ through the session's memo
# (tests/gxx_memo.py): an identical compile, from any child, is built once.
GXX_MEMO_WRAPPER = f"""#!/bin/sh
echo "$@" >> "${{{GXX_LOG_ENV}:-/dev/null}}"
exec "@python@" -S -E "@memo@" "@memo_dir@" "$@"
"""


SHARED_INDUCTOR_ENV = "CACHECOMPILE_TEST_INDUCTOR_DIR"


def shared_inductor_dirs() -> dict[str, str] | None:
    """The session's shared Inductor/Triton/tmp dirs, or None outside such a session."""
    base = os.environ.get(SHARED_INDUCTOR_ENV)
    if not base:
        return None
    dirs = {"TORCHINDUCTOR_CACHE_DIR": Path(base) / "inductor",
            "TRITON_CACHE_DIR": Path(base) / "triton", "TMPDIR": Path(base) / "tmp"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return {k: str(v) for k, v in dirs.items()}


def logging_gxx(root: Path) -> Path:
    """The logging g++ wrapper: the session's one (in its shared dir), else one in ``root``."""
    base = os.environ.get(SHARED_INDUCTOR_ENV)
    bindir = Path(base) / "bin" if base else root / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    gxx = bindir / "logging-g++"
    if not gxx.exists():
        text = GXX_WRAPPER if not base else (
            GXX_MEMO_WRAPPER.replace("@python@", sys.executable)
            .replace("@memo@", str(Path(__file__).with_name("gxx_memo.py")))
            .replace("@memo_dir@", str(Path(base) / "gxx-memo")))
        # Written whole, then renamed: xdist's workers may race to make it.
        tmp = bindir / f".logging-g++.{os.getpid()}"
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, gxx)
    return gxx


class Sandbox:
    """One test's cache directories: a cachecompile store plus Inductor/Triton/tmp dirs.

    ``fresh_inductor=True`` gives every child of this sandbox new, empty Inductor dirs
    (as before the shared ones existed); ``run(..., fresh_inductor=True)`` does so for one
    child.
    """

    def __init__(self, root: Path, *, fresh_inductor: bool = False) -> None:
        self.root = root
        self.fresh_inductor = fresh_inductor
        self.store = root / "store"
        self.gxx_log = root / "gxx.log"
        self._n = 0
        self._turn = 0  # which of the two zygotes (two hash seeds) the next child forks from
        root.mkdir(parents=True, exist_ok=True)  # the children run in it
        self.gxx = logging_gxx(root)

    def fresh_inductor_dirs(self) -> dict[str, str]:
        """New, empty Inductor and Triton caches and TMPDIR (precompiled headers live there)."""
        self._n += 1
        base = self.root / f"run{self._n}"
        dirs = {"TORCHINDUCTOR_CACHE_DIR": base / "inductor", "TRITON_CACHE_DIR": base / "triton",
                "TMPDIR": base / "tmp"}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        return {k: str(v) for k, v in dirs.items()}

    def env(self, *, fresh_inductor: bool | None = None, **extra: str) -> dict[str, str]:
        shared = shared_inductor_dirs()
        env = dict(os.environ)
        for k in list(env):
            if k.startswith(("CACHECOMPILE_", "TORCHINDUCTOR_", "TORCH_COMPILE")):
                del env[k]
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(self.root)])
        env["CACHECOMPILE_DIR"] = str(self.store)
        env["CXX"] = str(self.gxx)
        env[GXX_LOG_ENV] = str(self.gxx_log)
        env["PYTHONWARNINGS"] = "default"
        fresh = self.fresh_inductor if fresh_inductor is None else fresh_inductor
        env.update(self.fresh_inductor_dirs() if fresh or shared is None else shared)
        env.update(extra)
        return env

    def compiler_calls(self) -> int:
        if not self.gxx_log.exists():
            return 0
        return len(self.gxx_log.read_text().splitlines())

    def reset_compiler_log(self) -> None:
        self.gxx_log.unlink(missing_ok=True)

    def run(self, code: str, *, timeout: float = 600, check: bool = True,
            fresh_inductor: bool | None = None, compiles: bool | None = None,
            **extra: str) -> Any:
        """Run ``code`` in a fresh process; it reports with ``report(obj)``.

        A script that imports torch before anything but the standard library forks from
        one of the test process's zygotes (tests/zygote.py), which imported torch; any other
        script, or one whose environment differs in what the zygote's imports read, runs
        as ``python -c``. A child that ``compiles`` forks from a zygote that has imported
        Dynamo and Inductor's compiler too (what it would import first anyway, ~3 s of a
        core). By default a child compiles when its store holds no entry yet (a cold
        run); a warm child, whose promise may be that it imports no Dynamo, never gets
        them."""
        prelude = textwrap.dedent("""
            import json as _json, sys as _sys
            def report(obj):
                print("RESULT " + _json.dumps(obj), flush=True)
        """)
        body = textwrap.dedent(code)
        env = self.env(fresh_inductor=fresh_inductor, **extra)
        proc = None
        if zygote.usable(body):
            # A script that imports torch first forks from a process that already did
            # (tests/zygote.py: what differs from a fresh interpreter, and how each is held).
            self._turn += 1
            if compiles is None:
                compiles = not _has_entries(Path(env["CACHECOMPILE_DIR"]))
            # Inductor's import reads its dirs (and CXX): a zygote that imported it serves
            # only children on the session's shared dirs, which it was started with.
            shared = shared_inductor_dirs()
            preload = zygote.COMPILER if compiles and shared is not None and all(
                env.get(k) == v for k, v in shared.items()) else ()
            # A zygote starts from a sandbox's plain environment (shared dirs, no extras),
            # not from the first child's: children with extras then fit where they can.
            base = env if shared is None else self.env(fresh_inductor=False)
            proc = zygote.run(prelude + body, env, str(self.root), timeout, self._turn,
                              preload, base=base)
        if proc is None:
            proc = subprocess.run([sys.executable, "-c", prelude + body], env=env,
                                  capture_output=True, text=True, timeout=timeout,
                                  cwd=str(self.root))
        results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if check and (proc.returncode != 0 or not results):
            raise AssertionError(f"child failed (rc={proc.returncode})\nstdout:\n{proc.stdout}"
                                 f"\nstderr:\n{proc.stderr[-6000:]}")
        out = json.loads(results[-1]) if results else None
        return ChildResult(out, proc.returncode, proc.stdout, proc.stderr)


def _has_entries(store: Path) -> bool:
    """Whether the store at ``store`` holds any entry on disk (the store's own walk of its
    ``entries/``; torch-free)."""
    from cachecompile.store.layout import Layout

    try:
        return next(Layout(store).digests(warn=False), None) is not None
    except OSError:   # a store a test made unreadable or not a folder: treated as empty
        return False


class ChildResult:
    def __init__(self, value: Any, rc: int, stdout: str, stderr: str) -> None:
        self.value = value
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr

    def __getitem__(self, k: str) -> Any:
        return self.value[k]


@dataclass
class Ran:
    """What a cachectl run gave: as subprocess.CompletedProcess names it."""

    returncode: int
    stdout: str
    stderr: str


def cachectl(*args: str, env: Mapping[str, str] | None = None, input: str | None = None) -> Ran:
    """``cachectl ARGS`` in this process through click's runner: the same command group and
    error-to-exit-code mapping as the installed command, without a Python start per call
    (0.5 s, several under load). ``env`` is the whole environment the command sees (default:
    this process's). A bug in a verb raises here with its traceback. Tests whose subject is
    the entry point, or a command racing another process, start ``python -m
    cachecompile.cli.main`` themselves."""
    from click.testing import CliRunner

    from cachecompile.cli.main import cli

    overrides: dict[str, str | None] = {}
    if env is not None:
        overrides = {k: None for k in os.environ if k not in env}
        overrides.update(env)
    r = CliRunner().invoke(cli, list(args), env=overrides, input=input, prog_name="cachectl",
                           catch_exceptions=False)
    return Ran(r.exit_code, r.stdout, r.stderr)
