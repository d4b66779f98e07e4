"""Fresh child processes that skip ``import torch``: a fork server for Sandbox.run.

Most of the suite's children are scripts whose first statement is ``import torch``. That
import costs each of them about 1.7 s of a core (issue 36: hundreds of children). A zygote
is a server process that has imported torch and nothing else (no torch._dynamo, no
Inductor, nothing of cachecompile, no test code; but see the compiling child below); for
each script it forks a child, which sets the script's environment, working directory and
``sys.path``, then runs the script as ``python -c`` runs it: as ``__main__``, with its
output on the caller's pipes, ending through the interpreter's normal exit (atexit
handlers, flushes) with the status the caller sees as a return code.

A forked child is what a fresh interpreter is at the end of its first line, with three
exceptions, each handled:

- **What ``import torch`` read from the environment** (torch's compiler settings,
  ``TORCH_LOGS``, the OpenMP and allocator variables its libraries read when loaded):
  the zygote records every variable Python code read during its import, and a script whose
  environment differs from the zygote's in any of them, or in any variable of
  :data:`_READ_BY_LIBRARIES`' prefixes, runs as a plain ``python -c`` instead.
- **The hash seed.** Children of one zygote share its ``str`` hash seed. Each test process
  runs two zygotes (two seeds) and a Sandbox alternates between them, so a cold run and
  the warm run after it still hash differently, as two fresh processes do.
- **Import order.** Only a script that imports torch before anything but standard-library
  imports uses a zygote; one that sets a variable or imports anything else first
  (``import os; os.environ[...]``, ``from cachecompile import ...``) runs as ``python -c``.

**A child that will compile** (a cold run: its store holds no entry yet; tests/ccutil.py
decides) forks from a third zygote that has also imported Dynamo and Inductor's compiler
(:data:`COMPILER`, about 3 s of a core that such a child pays at its first compile
otherwise). The same three rules hold for it, and one more: Inductor's import reads its
cache dirs, ``TMPDIR`` and ``CXX``, so only children on the session's shared Inductor
dirs (which that zygote was started with) use it; a child with empty dirs of its own runs
as ``python -c``. A warm child never uses it: its promise may be that it imports no Dynamo.

``CC_TESTS_ZYGOTE=0`` turns zygotes off (every child a plain interpreter).
"""

from __future__ import annotations

import ast
import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping

# Variables the native libraries behind torch read when they load (OpenMP, BLAS, the C
# allocator, the dynamic loader) or Python reads at its start: not seen by the recording
# of Python-level reads, so any difference in them means a plain interpreter.
# TORCHINDUCTOR_ and TORCHDYNAMO_ are not among them: only Python code reads those (Inductor's
# and Dynamo's config modules, imported by the child itself), and the recording sees the
# ones that torch's import reads.
_READ_BY_LIBRARIES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_",
                      "GLIBC_", "PYTHON", "TORCH_", "PYTORCH_", "CUDA", "NUMEXPR_", "NPY_")
# Modules a script may import before torch and still fork from a zygote: the standard
# library's (torch's import brings in many of them anyway, and importing one sets nothing
# torch's import reads).
_STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}

_SERVER = r'''
import json, os, selectors, socket, sys
# The interpreter's own entries of sys.path (the stdlib, site-packages), as a fresh
# `python -c` has them after its PYTHONPATH entries (this one is started without any).
_base_path = sys.path[1:]
_orig = type(os.environ)
_read = set()
_get, _has, _iter = _orig.__getitem__, _orig.__contains__, _orig.__iter__
_scanned = [None]
def _g(self, k):
    # A read of the key a scan of the whole environment just yielded (tqdm's envwrap
    # scans for its TQDM_ prefix) is no read of that variable by name.
    if k != _scanned[0]:
        _read.add(k)
    return _get(self, k)
def _h(self, k):
    _read.add(k)
    return _has(self, k)
def _i(self):
    for k in _iter(self):
        _scanned[0] = k
        yield k
    _scanned[0] = None
_orig.__getitem__, _orig.__contains__, _orig.__iter__ = _g, _h, _i
import torch  # noqa: F401  (the whole point)
import importlib, threading
for _m in filter(None, sys.argv[3].split(",")):
    importlib.import_module(_m)
_orig.__getitem__, _orig.__contains__, _orig.__iter__ = _get, _has, _iter
if threading.active_count() != 1:
    sys.exit("a preloaded module started a thread: forking would copy it half-held")

def _serve(path, parent):
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(16)
    print(json.dumps({"read": sorted(_read)}), flush=True)
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ)
    children = {}  # pid -> connection
    while os.getppid() == parent:
        for key, _ in sel.select(timeout=0.02):
            conn, _ = lsock.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            while not msg.endswith(b"\n"):
                msg += conn.recv(1 << 20)
            job = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                sel.close()
                lsock.close()
                for c in children.values():
                    c.close()
                conn.close()
                return job, fds
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    sys.exit(0)

_job, _fds = _serve(sys.argv[1], int(sys.argv[2]))
# The child: from here on, what `python -c CODE` is after its first line.
os.setsid()  # its own group, so that a timeout can kill what it started too
os.dup2(_fds[0], 1)
os.dup2(_fds[1], 2)
os.close(_fds[0])
os.close(_fds[1])
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
os.chdir(_job["cwd"])
os.environ.clear()
os.environ.update(_job["env"])
sys.path[:] = [""] + [p for p in _job["env"].get("PYTHONPATH", "").split(os.pathsep) if p] + _base_path
sys.argv[:] = ["-c"]
import tempfile
tempfile.tempdir = None
_code = compile(_job["code"], "<string>", "exec")
# The script runs in this interpreter's own __main__, emptied to what `python -c` gives
# it: a new module object in its place made Dynamo's guards of a dynamic graph read a
# local the entry cannot hold (tests/key/test_marks.py caught it).
def _fresh(d, keep):
    d.clear()
    d.update(keep)
    return d
_d = sys.modules["__main__"].__dict__
_keep = {k: _d[k] for k in ("__name__", "__doc__", "__package__", "__loader__", "__spec__",
                            "__annotations__", "__builtins__") if k in _d}
exec(_code, _fresh(_d, _keep))
'''


class _Server:
    """One zygote: a process that imported torch and forks a child per script."""

    def __init__(self, env: Mapping[str, str], preload: tuple[str, ...] = ()) -> None:
        self.env = dict(env)
        self.dir = tempfile.mkdtemp(prefix="cc-zygote-")
        self.path = os.path.join(self.dir, "sock")
        # Started from / with no PYTHONPATH: it imports torch, and nothing of this checkout.
        server_env = {k: v for k, v in self.env.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, self.path, str(os.getpid()),
                                      ",".join(preload)],
                                     env=server_env, cwd="/", stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the zygote did not start")
        read = set(json.loads(line)["read"])
        self.sensitive = read | {k for k in self.env if k.startswith(_READ_BY_LIBRARIES)}

    def fits(self, env: Mapping[str, str]) -> bool:
        keys = self.sensitive | {k for k in env if k.startswith(_READ_BY_LIBRARIES)}
        keys.discard("PYTHONPATH")  # set in the child's sys.path below
        if any(env.get(k) != self.env.get(k) for k in keys):
            return False
        # A sitecustomize (or .pth) on the script's PYTHONPATH would run at a fresh start.
        return not any(os.path.exists(os.path.join(p, "sitecustomize.py"))
                       for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)

    def run(self, code: str, env: Mapping[str, str], cwd: str,
            timeout: float) -> subprocess.CompletedProcess[str]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            job = {"code": code, "env": dict(env), "cwd": cwd}
            socket.send_fds(conn, [json.dumps(job).encode() + b"\n"], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        reply = conn.makefile("r")
        pid = json.loads(reply.readline())["pid"]
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}

        def drain(fd: int) -> None:
            with os.fdopen(fd, "rb") as f:
                for chunk in iter(lambda: f.read1(1 << 16), b""):
                    chunks[fd].append(chunk)

        readers = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in chunks]
        for t in readers:
            t.start()
        conn.settimeout(timeout)
        try:
            line = reply.readline()
        except TimeoutError:
            line = ""
        if not line:
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass
            conn.close()
            raise subprocess.TimeoutExpired(["<zygote>", "-c", code[:60]], timeout)
        rc = json.loads(line)["rc"]
        conn.close()
        deadline = time.monotonic() + timeout
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
        stdout, stderr = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))
        return subprocess.CompletedProcess(["<zygote>", "-c", code], rc, stdout, stderr)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass


# What a compiling child imports anyway, and what costs it most (~3 s of a core after
# torch): Dynamo and Inductor's compiler. A child that will compile forks from a zygote
# that imported them too (see :func:`run`).
COMPILER = ("torch._dynamo", "torch._inductor.compile_fx")
_servers: dict[tuple[str, ...], list[_Server]] = {}
_lock = threading.Lock()
_broken: dict[tuple[str, ...], str] = {}


def _zygotes(base: Mapping[str, str], preload: tuple[str, ...]) -> list[_Server]:
    with _lock:
        servers = _servers.get(preload)
        if servers and any(s.proc.poll() is not None for s in servers):
            _broken[preload] = "a zygote exited"
        if not servers and preload not in _broken:
            try:
                # Two plain zygotes, so that a sandbox's consecutive children (a cold run and the
                # warm run after it) hash differently; a compiling child is the only one of its
                # kind in a sandbox as a rule, and its zygote's seed is another one anyway.
                servers = _servers[preload] = [_Server(base, preload)
                                               for _ in range(1 if preload else 2)]
            except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
                _broken[preload] = repr(e)
                return []
            atexit.register(lambda: [s.close() for s in servers or ()])
        return [] if preload in _broken else servers or []


def usable(code: str) -> bool:
    """Whether ``code`` may run in a zygote: zygotes are on, and the script imports torch
    before it does anything else (its statements up to that import are imports of the
    standard library and torch only: ``import os, sys, torch`` qualifies, ``import os;
    os.environ[...] = ...`` before torch does not)."""
    if os.environ.get("CC_TESTS_ZYGOTE", "1") == "0":
        return False
    try:
        statements = ast.parse(code).body
    except SyntaxError:
        return False   # python -c reports it
    for st in statements:
        if isinstance(st, ast.Import):
            names = [a.name for a in st.names]
        elif isinstance(st, ast.ImportFrom) and st.level == 0 and st.module:
            names = [st.module]
        else:
            return False
        tops = {n.split(".")[0] for n in names}
        if not tops <= _STDLIB | {"torch"}:
            return False
        if "torch" in tops:
            return True
    return False


def run(code: str, env: Mapping[str, str], cwd: str, timeout: float, turn: int,
        preload: tuple[str, ...] = (), base: Mapping[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str] | None:
    """Run ``code`` in a zygote that imported ``preload`` after torch (zygote ``turn % 2``
    of the two plain ones), started from ``base`` (default ``env``); None where ``env``
    does not fit it."""
    servers = _zygotes(env if base is None else base, preload)
    if not servers:
        return None  # none could start: plain interpreters, as before
    server = servers[turn % len(servers)]
    if not server.fits(env):
        return None
    return server.run(code, env, cwd, timeout)
