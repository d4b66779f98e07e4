"""Fresh child processes that skip ``import torch``: a fork server for Sandbox.run.

Most of the suite's children are scripts whose first statement is ``import torch``. That
import costs each of them about 1.7 s of a core (issue 36: hundreds of children). A zygote
is a server process that has imported torch and nothing else (no torch._dynamo, no
Inductor, nothing of cachecompile, no test code; but see the compiling child below); for
each script it forks a child, which sets the script's environment, working directory and
``sys.path``, then runs the script as ``python -c`` runs it: as ``__main__``, with its
output on the caller's pipes, ending through the interpreter's normal exit (atexit
handlers, flushes) with the status the caller sees as a return code.

Which kind of process a child gets, and why, is decided in one place:
``ccutil.choose_process``, which Sandbox.run logs at INFO (pytest shows it under a failed
test's "Captured log call").

**What a forked child is not, and how each difference is held.** A forked child is what a
fresh interpreter is at the end of its first line, but for the differences below. Each
is either made equal in the child, or sends the script to a plain ``python -c`` (the
zygote "does not fit"), or is left as it is, with the reason; each names the test
(tests/test_zygote.py unless said) that holds it.

- *Random state* (made equal): a fresh interpreter seeds torch's CPU generator from the
  OS at ``import torch``, and numpy's and sympy's module generators when they are
  imported (and sympy the first index of its Dummy symbols); children of one zygote would
  all draw the zygote's numbers (0.873, 0.819, 0.873, 0.819 from two zygotes). The child reseeds each from the OS first thing
  (:data:`RESEEDED`); Python's ``random`` reseeds itself after a fork (its own
  ``os.register_at_fork`` hook). ``test_children_draw_as_fresh_interpreters_do``; that no
  other generator exists in a zygote: ``test_every_generator_in_a_zygote_is_reseeded``.
- *What ``import torch`` read from the environment* (does not fit): torch's compiler
  settings, ``TORCH_LOGS``, the OpenMP and allocator variables its libraries read when
  loaded, the locale and ``TZ`` Python reads at its start. The zygote records every variable
  Python code read during its import; a script whose environment differs from the
  zygote's in any of them, or in any variable of :data:`_READ_BY_LIBRARIES`' prefixes,
  runs as ``python -c``.
  ``test_an_environment_torch_reads_at_import_gets_a_plain_interpreter``.
- *What ``import torch`` printed* (made equal): a warning torch's import gives
  (``PYTHONWARNINGS=default`` shows a DeprecationWarning of torch.jit) went to the
  zygote's stderr once; the zygote keeps what its imports wrote and each child writes it
  to its own stdout and stderr first, as a fresh interpreter's import would.
  ``test_a_zygote_child_is_a_fresh_python_c``.
- *What the script's PYTHONPATH would have shadowed* (does not fit): a module of the same
  name as one the zygote imported, on the script's ``PYTHONPATH``, or a
  ``sitecustomize``. ``test_a_module_on_pythonpath_that_shadows_one_torch_imported``.
- *Process attributes a child inherits* (does not fit): umask, resource limits, CPU
  affinity, priority, user and groups, blocked and ignored signals are the test
  process's when the zygote started; where the test process has changed one since, the
  script runs as ``python -c``. ``test_a_changed_umask_gets_a_plain_interpreter``.
- *The interpreter's own view of its start* (made equal): ``sys.argv`` is ``["-c"]``,
  ``sys.orig_argv`` the ``python -c CODE`` a plain child has, ``sys.path`` ``""``, then
  ``PYTHONPATH``, then the interpreter's own entries; ``__main__`` holds what ``python -c``
  gives it; stdin is ``/dev/null`` (a plain child's too: ccutil); the working directory,
  the environment, the open file descriptors, the signal handlers and mask, the
  loaded modules, ``atexit`` handlers, warning filters and logging set-up are a plain
  child's. ``test_a_zygote_child_is_a_fresh_python_c`` (compares them with a plain child's).
- *The hash seed* (left, halved): children of one zygote share its ``str`` hash seed, which
  cannot change after start. Each test process runs two plain zygotes (two seeds) and a
  Sandbox alternates between them, so a cold run and the warm run after it hash
  differently, as two fresh processes do; its first and third children hash alike.
  ``test_a_zygote_child_is_a_fresh_python_c``.
- *Import order* (does not fit): only a script that imports torch before anything but
  standard-library imports uses a zygote; one that sets a variable or imports anything
  else first (``import os; os.environ[...]``, ``from cachecompile import ...``) runs as
  ``python -c``. ``test_scripts_that_do_something_before_torch_run_as_plain_interpreters``.
- *Parent, session, command line* (left): a child's parent is the zygote, not the test
  process; it leads a session of its own (so a timeout kills what it started; a plain
  child does too: ccutil); ``/proc/self/cmdline`` and ``ps`` show the zygote's command.
  Nothing of cachecompile reads them: ``test_nothing_of_cachecompile_reads_what_a_fork_changes``.
- *Native threads* (made equal): after torch's import a process has one more thread,
  OpenBLAS's pool (numpy's import starts it). OpenBLAS stops its threads before a fork
  and starts them again at the child's first BLAS call (its own fork handlers), so a
  child runs BLAS with the pool a fresh interpreter has; a Python thread in a zygote
  stops it from starting. ``test_a_zygote_child_is_a_fresh_python_c``.
- *Memory* (left): a child's pages are the zygote's, copy-on-write, and its peak RSS
  (``ru_maxrss``) starts at the zygote's. No test measures a child's memory (the tools/
  benchmarks start their own interpreters): the same test.
- *The collector* (left): a zygote freezes what its imports made (:data:`FROZEN`), so a
  child's collections skip it, and ``gc.get_objects()`` does not list it: a test that scans
  the heap unfreezes first (``test_every_generator_in_a_zygote_is_reseeded``).

**A child that will compile** (a cold run: its store holds no entry yet; ccutil decides)
forks from a third zygote that has also imported Dynamo and Inductor's compiler
(:data:`COMPILER`, about 3 s of a core that such a child pays at its first compile
otherwise). The differences above hold for it too, and one more: Inductor's import reads
its cache dirs, ``TMPDIR`` and ``CXX``, so only children on the session's shared Inductor
dirs (which that zygote was started with) use it; a child with empty dirs of its own runs
without it. A warm child never uses it: its promise may be that it imports no Dynamo.
What the preload imported is in the child already (modules, loggers, atexit handlers,
the warnings it printed: written first, not at the first compile), and so is what its
probes found out (:data:`PROBES`: the CPU's vector ISAs, whose g++ calls are then in no
sandbox's log, and the hash of torch's source files; the generator an import made there is
reseeded, :data:`RESEEDED`). One torch metric is not measured in it: Dynamo's timing of
each new guard tree (:data:`UNMEASURED`; ``CC_TESTS_GUARD_PROFILE=1`` measures it).
``test_a_compiling_child_forks_with_the_compiler_imported_only_on_shared_dirs``.

``CC_TESTS_ZYGOTE=0`` turns zygotes off (every child a plain interpreter); CI runs the
fresh-process tests so too (.ci/fresh-processes.sh).
"""

from __future__ import annotations

import ast
import atexit
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

# Variables the native libraries behind torch read when they load (OpenMP, BLAS, the C
# allocator, the dynamic loader) or Python reads at its start (its own, the locale, the
# time zone): not seen by the recording of Python-level reads, so any difference in them
# means a plain interpreter. TORCHINDUCTOR_ and TORCHDYNAMO_ are not among them: only
# Python code reads those (Inductor's and Dynamo's config modules, imported by the child
# itself), and the recording sees the ones that torch's import reads.
_READ_BY_LIBRARIES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_",
                      "GLIBC_", "PYTHON", "TORCH_", "PYTORCH_", "CUDA", "NUMEXPR_", "NPY_",
                      "LC_", "LANG", "TZ")
# Modules a script may import before torch and still fork from a zygote: the standard
# library's (torch's import brings in many of them anyway, and importing one sets nothing
# torch's import reads).
_STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}
# The generators a fresh interpreter seeds from the OS when it imports their module, as
# ``module: statement`` run in each child whose zygote imported the module. Python's own
# ``random`` is not here: it reseeds itself in a forked child. tests/test_zygote.py checks
# that a zygote holds no other generator.
RESEEDED = {
    "torch": "torch.default_generator.seed()",
    "numpy.random": "numpy.random.seed()",
    "sympy.core.random": "sympy.core.random.rng.seed(); sympy.core.random._assumptions_rng.seed()",
    # A Dummy symbol's index starts at a number drawn when sympy defines the class (the
    # Dummies made during the zygote's imports keep theirs, as at a fresh start).
    "sympy.core.symbol": ("d = sympy.core.symbol.Dummy; d._prng.seed(); "
                          "d._base_dummy_index = d._prng.randint(10**6, 9*10**6)"),
    # Imported by Inductor's ISA probe (PROBES: setuptools, then jaraco's helpers).
    # (Where a release has no such generator, the stand-in is Python's own, reseeded anyway.)
    "more_itertools.recipes": ("import random; (getattr(more_itertools.recipes, "
                               "'_private_randrange', None) or random.random).__self__.seed()"),
}

_SERVER = r"""
import json, os, sys
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
# What the imports write (torch's import warns under PYTHONWARNINGS=default) is kept and
# written again by each child, where a fresh interpreter's import would write it.
_kept = [os.memfd_create("stdout"), os.memfd_create("stderr")]
_saved = [os.dup(1), os.dup(2)]
os.dup2(_kept[0], 1)
os.dup2(_kept[1], 2)
import torch  # noqa: F401  (the whole point)
import importlib, threading
for _m in filter(None, sys.argv[3].split(",")):
    if ":" not in _m:
        importlib.import_module(_m)
sys.stdout.flush()
sys.stderr.flush()
os.dup2(_saved[0], 1)
os.dup2(_saved[1], 2)
def _written(fd):
    os.lseek(fd, 0, 0)
    chunks = list(iter(lambda: os.read(fd, 1 << 16), b""))
    os.close(fd)
    return b"".join(chunks)
_import_output = [_written(fd) for fd in _kept]
for fd in _saved:
    os.close(fd)
_orig.__getitem__, _orig.__contains__, _orig.__iter__ = _get, _has, _iter
# The probes (zygote.PROBES: calls whose result the module keeps for the process), with
# the environment no longer watched: what they read is what the imports made of it (the
# compiler, the cache dirs), not a setting of their own. Their g++ calls are the zygote's,
# counted in no sandbox's log; what they print goes to stderr (stdout's first line is
# this zygote's answer to its parent).
for _m in filter(None, sys.argv[3].split(",")):
    if _m.endswith("=0"):   # zygote.UNMEASURED: a metric's measurement made a no-op
        _mod, _fn = _m[:-2].split(":")
        setattr(importlib.import_module(_mod), _fn, lambda *a, **k: 0.0)
    elif ":" in _m:
        _mod, _fn = _m.split(":")
        _log = os.environ.pop("CC_TESTS_GXX_LOG", None)
        _out = os.dup(1)
        os.dup2(2, 1)
        try:
            getattr(importlib.import_module(_mod), _fn)()
        finally:
            sys.stdout.flush()
            os.dup2(_out, 1)
            os.close(_out)
        if _log is not None:
            os.environ["CC_TESTS_GXX_LOG"] = _log
        # The probe runs the compiler found on PATH: a child with another PATH (a g++
        # hidden, or another one first) finds out for itself, as a plain interpreter.
        _read.add("PATH")
# (A native thread is there already: OpenBLAS's pool, which numpy's import starts; it
# stops it before a fork and starts it again at the child's first BLAS call.)
if threading.active_count() != 1:
    sys.exit("an import started a thread: forking would copy it half-held")
if torch.cuda.is_initialized():
    sys.exit("an import initialised CUDA, which a forked child cannot use")
_reseed = compile(sys.argv[4], "<reseed>", "exec")
# zygote.FROZEN: what the imports made, out of the collector's reach in every child.
if sys.argv[5] == "1":
    import gc
    gc.collect()
    gc.freeze()
import selectors, socket

def _serve(path, parent):
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(16)
    print(json.dumps({"read": sorted(_read),
                      "modules": sorted({m.split(".")[0] for m in sys.modules})}), flush=True)
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
exec(_reseed)  # the generators a fresh interpreter seeds from the OS (zygote.RESEEDED)
os.setsid()  # its own session, so that a timeout can kill what it started too
os.dup2(_fds[0], 1)
os.dup2(_fds[1], 2)
os.close(_fds[0])
os.close(_fds[1])
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
for _fd, _out in zip((1, 2), _import_output):
    while _out:
        _out = _out[os.write(_fd, _out):]
os.chdir(_job["cwd"])
os.environ.clear()
os.environ.update(_job["env"])
sys.path[:] = [""] + [p for p in _job["env"].get("PYTHONPATH", "").split(os.pathsep) if p] + _base_path
sys.argv[:] = ["-c"]
sys.orig_argv[:] = [sys.orig_argv[0], "-c", _job["code"]]
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
"""


def inherited() -> dict[str, Any]:
    """What a child inherits from the process that starts it, beyond its environment and
    working directory: a zygote's children have the test process's as it was when the
    zygote started."""
    status: dict[str, str] = {}
    try:
        with open("/proc/thread-self/status", encoding="ascii") as f:
            for line in f:
                k, _, v = line.partition(":")
                status[k] = v.strip()
    except OSError:
        pass
    return {
        "umask": status.get("Umask"),
        "signals": (status.get("SigBlk"), status.get("SigIgn")),
        "limits": [resource.getrlimit(getattr(resource, n)) for n in sorted(dir(resource))
                   if n.startswith("RLIMIT_")],
        "affinity": sorted(os.sched_getaffinity(0)),
        "priority": os.getpriority(os.PRIO_PROCESS, 0),
        "ids": (os.getresuid(), os.getresgid(), sorted(os.getgroups())),
    }


class Zygote:
    """One zygote: a process that imported torch and forks a child per script."""

    def __init__(self, env: Mapping[str, str], preload: tuple[str, ...] = ()) -> None:
        self.env = dict(env)
        self.preload = preload
        self.inherited = inherited()
        self.dir = tempfile.mkdtemp(prefix="cc-zygote-")
        self.path = os.path.join(self.dir, "sock")
        reseed = "\n".join(f"if {m!r} in sys.modules:\n    import {m}; {stmt}"
                           for m, stmt in RESEEDED.items())
        # Started from / with no PYTHONPATH: it imports torch, and nothing of this checkout.
        server_env = {k: v for k, v in self.env.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, self.path, str(os.getpid()),
                                      ",".join(preload), reseed, "1" if FROZEN else "0"],
                                     env=server_env, cwd="/", stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote did not start (exit status {self.proc.wait()})")
        started = json.loads(line)
        read = set(started["read"])
        self.modules = frozenset(started["modules"])
        self.sensitive = read | {k for k in self.env if k.startswith(_READ_BY_LIBRARIES)}

    def misfit(self, env: Mapping[str, str]) -> str | None:
        """None where a child with ``env`` is what a fresh interpreter would be, else why
        it would not be (it then runs as ``python -c``)."""
        keys = self.sensitive | {k for k in env if k.startswith(_READ_BY_LIBRARIES)}
        keys.discard("PYTHONPATH")  # set in the child's sys.path below
        differ = sorted(k for k in keys if env.get(k) != self.env.get(k))
        if differ:
            return (f"its environment differs from the zygote's in {', '.join(differ)}, which "
                    "torch's import or the libraries it loads read")
        for entry in filter(None, env.get("PYTHONPATH", "").split(os.pathsep)):
            try:
                names = {n.split(".")[0] for n in os.listdir(entry)}
            except OSError:
                continue
            # A sitecustomize (or .pth) on the script's PYTHONPATH would run at a fresh
            # start; a module the zygote imported, found there, would be imported from there.
            shadowed = sorted(names & (self.modules | {"sitecustomize", "usercustomize"}))
            if shadowed:
                return (f"its PYTHONPATH entry {entry} holds {', '.join(shadowed)}, which a "
                        "fresh interpreter would import from there")
        now = inherited()
        changed = sorted(k for k, v in now.items() if v != self.inherited[k])
        if changed:
            return (f"the test process's {', '.join(changed)} changed since the zygote "
                    "started, and a child would have the old one")
        return None

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
# that imported them too (ccutil.choose_process).
#
# PROBES ("module:function", called after the import) are the machine facts such a child
# would find out at its first compile and the module keeps for the process: Inductor's
# list of the vector ISAs this CPU builds and loads. Finding it out runs g++ on a test
# program per ISA and a `python -c` per ISA to dlopen the result (~0.3 s of a core, in
# each of the ~330 compiling children of the suite: 667 such interpreters, 86 s of CPU,
# issue 65). The list depends on the CPU and the compiler only (ATEN_CPU_CAPABILITY is
# read later, at each pick), both the zygote's as much as the child's; cachecompile's CPU
# targets replace the list for their builds (_torch/inductor.vec_isa_limited).
#
# And the hash of torch's own source files that Inductor's and AOTAutograd's cache keys
# hold (``torch_key``: every .py file of torch read and hashed, ~0.2 s of a core in each
# compiling child; the venv's files, the same for every process of the session).
PROBES = ("torch._inductor.cpu_vec_isa:valid_vec_isa_list",
          "torch._inductor.codecache:torch_key")
# Dynamo times each new guard tree for its compile metrics, once per compiled frame, after
# flushing the CPU's caches (~20 ms a frame, 1.5 s of a 28 s cold child of the write
# sweep; Qwen2-VL's 192 frames, 3.6 s). It returns the latency for a log line and a
# counter, which nothing of cachecompile nor of a test reads: the compiling zygote's
# children skip it ("module:function=0": the function made a no-op that returns 0.0).
# CC_TESTS_GUARD_PROFILE=1 keeps it; a plain interpreter (CC_TESTS_ZYGOTE=0, CI's
# fresh-process pass) and a child that imports Dynamo after a hit always run it.
UNMEASURED = () if os.environ.get("CC_TESTS_GUARD_PROFILE") == "1" else (
    "torch._dynamo.guards:profile_guard_manager=0",)
COMPILER = ("torch._dynamo", "torch._inductor.compile_fx", *PROBES, *UNMEASURED)
# A zygote ends its start with gc.freeze(), as a forking server does: what its imports made
# (torch's modules; Dynamo's and Inductor's in the compiling zygote) moves to the collector's
# permanent generation, which no collection in a child traverses. A child's full collections
# walked all of it again: 4-6% of the CPU of a child that traces (a tiny Llama under Dynamo,
# paired, 4.2-4.3 s against 4.0-4.1), up to 10% over whole tests (Qwen2-VL, the guard
# matrix, the write sweep: 171-175 s of CPU against 154-161). What it changes for a child:
# gc.get_objects() and gc.get_referrers() leave frozen objects out (a test that scans them
# calls gc.unfreeze() first), and a cycle through one is never collected. cachecompile asks
# the collector for referrers only on Python 3.10 (entry/frame_records: a callee's qualified
# name, which 3.11's code objects carry), so a 3.10 zygote does not freeze.
# CC_TESTS_GC_FREEZE=0 turns it off. A child run as a plain interpreter (CC_TESTS_ZYGOTE=0,
# CI's fresh-process pass) never has it; pytest's workers freeze after collection on every
# pass (tests/conftest.py), so only the torch matrix's Python 3.10 runs the in-process tests
# unfrozen.
FROZEN = sys.version_info >= (3, 11) and os.environ.get("CC_TESTS_GC_FREEZE") != "0"
_zygotes: dict[tuple[str, ...], list[Zygote]] = {}
_lock = threading.Lock()
_broken: dict[tuple[str, ...], str] = {}


def zygotes(base: Mapping[str, str], preload: tuple[str, ...]) -> list[Zygote] | str:
    """The zygotes that imported ``preload`` after torch, started from ``base`` on first
    use: two plain ones (two hash seeds), one with a preload. A str says why there are
    none (one could not start, or exited)."""
    with _lock:
        servers = _zygotes.get(preload)
        if servers and any(s.proc.poll() is not None for s in servers):
            _broken[preload] = "a zygote exited"
        if not servers and preload not in _broken:
            try:
                # Two plain zygotes, so that a sandbox's consecutive children (a cold run and the
                # warm run after it) hash differently; a compiling child is the only one of its
                # kind in a sandbox as a rule, and its zygote's seed is another one anyway.
                servers = []
                for _ in range(1 if preload else 2):
                    servers.append(Zygote(base, preload))
                    atexit.register(servers[-1].close)
                _zygotes[preload] = servers
            except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
                _broken[preload] = repr(e)
        if preload in _broken:
            return _broken[preload]
        return servers or "no zygote"


def script_misfit(code: str) -> str | None:
    """None where ``code`` may run in a zygote: it imports torch before it does anything
    else (its statements up to that import are imports of the standard library and torch
    only: ``import os, sys, torch`` qualifies, ``import os; os.environ[...] = ...`` before
    torch does not); else why not."""
    try:
        statements = ast.parse(code).body
    except SyntaxError:
        return "it does not parse (python -c reports it)"
    for st in statements:
        if isinstance(st, ast.Import):
            names = [a.name for a in st.names]
        elif isinstance(st, ast.ImportFrom) and st.level == 0 and st.module:
            names = [st.module]
        else:
            return (f"its line {st.lineno} ({ast.unparse(st).splitlines()[0][:60]}) runs "
                    "before any import of torch")
        tops = {n.split(".")[0] for n in names}
        others = sorted(tops - _STDLIB - {"torch"})
        if others:
            return f"it imports {', '.join(others)} before torch (line {st.lineno})"
        if "torch" in tops:
            return None
    return "it never imports torch"
