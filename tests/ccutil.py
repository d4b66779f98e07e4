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

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zygote

REPO = Path(__file__).resolve().parent.parent
# Which kind of process each child ran in, and why (choose_process): at INFO, which this
# logger lets through whatever the root logger's level, so that pytest shows it with a
# failed test's output ("Captured log call").
logger = logging.getLogger("ccutil")
logger.setLevel(logging.INFO)

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
        self._turn = 0  # which of the two plain zygotes (two hash seeds) the next fork is from
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

    def env(self, *, fresh_inductor: bool | None = None,
            environ: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
        """The child's environment: the sandbox's, then ``environ`` (a whole mapping, e.g. a
        remote server's settings), then ``extra``."""
        shared = shared_inductor_dirs()
        env = dict(os.environ)
        for k in list(env):
            # Kept: Inductor's compile threads, no key factor (tests/conftest.py sets it
            # for the session: compiles in-process, without Inductor's pool of workers).
            if k.startswith(("CACHECOMPILE_", "TORCHINDUCTOR_", "TORCH_COMPILE")) \
                    and k != "TORCHINDUCTOR_COMPILE_THREADS":
                del env[k]
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(self.root)])
        env["CACHECOMPILE_DIR"] = str(self.store)
        env["CXX"] = str(self.gxx)
        env[GXX_LOG_ENV] = str(self.gxx_log)
        env["PYTHONWARNINGS"] = "default"
        fresh = self.fresh_inductor if fresh_inductor is None else fresh_inductor
        env.update(self.fresh_inductor_dirs() if fresh or shared is None else shared)
        env.update(environ or {})
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
            environ: Mapping[str, str] | None = None, **extra: str) -> Any:
        """Run ``code`` in a fresh process; it reports with ``report(obj)``.

        The process is a fork of one of the test process's zygotes (tests/zygote.py) or a
        plain ``python -c``: :func:`choose_process` decides, and says why in the log.
        ``compiles`` (default: whether the store is still empty, a cold run) picks the
        zygote that has imported Dynamo and Inductor's compiler too."""
        prelude = textwrap.dedent("""
            import json as _json, sys as _sys
            def report(obj):
                print("RESULT " + _json.dumps(obj), flush=True)
        """)
        body = textwrap.dedent(code)
        env = self.env(fresh_inductor=fresh_inductor, environ=environ, **extra)
        # A zygote starts from a sandbox's plain environment (shared dirs, no extras),
        # not from the first child's: children with extras then fit where they can.
        base = self.env(fresh_inductor=False) if shared_inductor_dirs() is not None else env
        process = choose_process(body, env, base=base, compiles=compiles, store=self.store,
                                 turn=self._turn)
        script = prelude + body
        self._turn += process.zygote is not None
        logger.info("child of %s: %s, because %s", self.root.name, process.kind, process.why)
        if process.zygote is not None:
            proc = process.zygote.run(script, env, str(self.root), timeout)
        else:
            proc = plain_python_c(script, env, str(self.root), timeout)
        results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if check and (proc.returncode != 0 or not results):
            raise AssertionError(f"child failed (rc={proc.returncode}; {process.kind}, because "
                                 f"{process.why})\nstdout:\n{proc.stdout}"
                                 f"\nstderr:\n{proc.stderr[-6000:]}")
        out = json.loads(results[-1]) if results else None
        return ChildResult(out, proc.returncode, proc.stdout, proc.stderr)


PLAIN = "python -c"
ZYGOTE = "zygote fork"
ZYGOTE_COMPILER = "zygote fork with Dynamo and Inductor's compiler imported"


@dataclass(frozen=True)
class Process:
    """The kind of process a Sandbox child runs in, and why (:func:`choose_process`)."""

    kind: str
    why: str
    zygote: zygote.Zygote | None = None


def choose_process(script: str, env: Mapping[str, str], *, base: Mapping[str, str],
                   compiles: bool | None, store: Path, turn: int) -> Process:
    """Where a Sandbox child runs: a fork of a zygote (tests/zygote.py), with Dynamo and
    Inductor's compiler imported or without, or a plain ``python -c``; and why. Every
    reason is said here, in the order it is decided.

    ``compiles=None``: whether the child compiles is whether its store is empty (a cold
    run). ``turn`` picks one of the two plain zygotes (two hash seeds)."""
    if os.environ.get("CC_TESTS_ZYGOTE", "1") == "0":
        return Process(PLAIN, "CC_TESTS_ZYGOTE=0 turns zygotes off")
    misfit = zygote.script_misfit(script)
    if misfit is not None:
        return Process(PLAIN, f"the script cannot start from a zygote: {misfit}")
    if compiles is None:
        compiles = not _has_entries(store)
        why = "its store is empty (a cold run)" if compiles else (
            "its store holds an entry (a warm run, which may promise to import no Dynamo)")
    else:
        why = f"the test said compiles={compiles}"
    shared = shared_inductor_dirs()
    preload: tuple[str, ...] = ()
    if compiles and shared is not None and all(env.get(k) == v for k, v in shared.items()):
        preload = zygote.COMPILER
        why += ", on the session's shared Inductor dirs, which that zygote was started with"
    elif compiles:
        why += (", but on Inductor dirs of its own (Inductor's import reads them): a zygote "
                "without the compiler")
    servers = zygote.zygotes(base, preload)
    if isinstance(servers, str):
        return Process(PLAIN, f"no zygote could start ({servers})")
    server = servers[turn % len(servers)]
    misfit = server.misfit(env)
    if misfit is not None:
        return Process(PLAIN, f"a zygote's child would not be a fresh interpreter: {misfit}")
    return Process(ZYGOTE_COMPILER if preload else ZYGOTE, why, server)


def plain_python_c(script: str, env: Mapping[str, str], cwd: str,
                   timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -c script``, started as a zygote's child is: stdin from /dev/null, a
    session of its own, whose processes a timeout kills all."""
    p = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=cwd,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


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
