"""The test session's g++ memo: ccache's idea, for the suite's own compiler wrapper.

Run by the session's logging g++ wrapper (ccutil.logging_gxx) with the compiler's
arguments. The wrapper has already logged the call, so the tests' counts of compiler
calls (cold "builds kernels", warm "zero compiler calls") are exactly what they were:
this file changes what a call *costs*, never whether it happened.

A call that writes one output (``-o OUT``) is keyed by its arguments with every input
file replaced by its content (the kernel's source, the ``-include`` header and the
precompiled header beside it, objects being linked) and the output by its suffix. A
second call with the same key, from any process of the session and whatever cache dir
it writes into, gets the bytes the first one's g++ wrote. Inductor's kernel sources
name their headers by absolute path under torch's install, which is constant within a
session, and the memo lives in the session's temporary dir: nothing crosses sessions.

Why: a test whose subject is the compiler (``fresh_inductor=True``: empty Inductor
dirs, so a live compile in a warm process is seen) rebuilt every kernel and the
precompiled header from scratch, 5-30 s of g++ each, though another test had already
built the same bytes (issue 36). ``CC_TESTS_GXX_MEMO=0`` turns it off.

Stdlib only, started with ``python -S -E``: it runs before every g++ call.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

# Suffixes of the files a call reads whose *content* decides its output; anything else
# that names an existing path (-I dirs, -L dirs) is constant within a session.
_INPUTS = (".cpp", ".cc", ".c", ".h", ".hpp", ".i", ".o", ".so", ".a", ".pch", ".gch")


# A file this big (Inductor's precompiled header, ~150 MB, an input of every kernel's
# compile) keeps its digest in the memo, keyed by what stat says of it: hashing it again
# cost ~0.15 s of a core per g++ call, ~50 s over the suite (issue 36). A rewrite changes
# size or mtime/ctime, and a file replaced by rename has another inode. What one clock
# tick can hide (gcc writes a header's final bytes in place, at the same size, as its
# last step) is why a digest is kept only for a file older than _SETTLED seconds: as
# ccache does with the include files it records.
_KEEP_DIGEST = 1 << 20
_SETTLED = 2.0


def _digest(path: str, memo_dir: str | None = None) -> str:
    kept = None
    if memo_dir is not None:
        st = os.stat(path)
        if st.st_size >= _KEEP_DIGEST:
            stamp = (f"{os.path.abspath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0"
                     f"{st.st_mtime_ns}\0{st.st_ctime_ns}")
            kept = os.path.join(memo_dir, "digests",
                                hashlib.sha256(stamp.encode()).hexdigest())
            try:
                with open(kept) as f:
                    known = f.read()
                if len(known) == 64:
                    return known
            except OSError:
                pass
            if time.time() - st.st_mtime_ns / 1e9 < _SETTLED:
                kept = None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if kept is not None:
        try:
            os.makedirs(os.path.dirname(kept), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(kept), prefix=".digest.")
            with os.fdopen(fd, "w") as f:
                f.write(digest)
            os.replace(tmp, kept)
        except OSError:
            pass  # kept next time, or never: the key is the same either way
    return digest


def memo_key(args: list[str], memo_dir: str | None = None) -> tuple[str, str] | None:
    """(key, output path) for a memoisable call, else None (run g++ as it is).

    ``memo_dir``: where big inputs' digests are kept (see _digest); None hashes every
    input again."""
    if "-o" not in args or args.count("-o") != 1:
        return None
    i = args.index("-o")
    if i + 1 >= len(args):
        return None
    out = args[i + 1]
    h = hashlib.sha256()
    for j, arg in enumerate(args):
        if j == i + 1:
            h.update(b"OUT" + os.path.splitext(out)[1].encode())
        elif arg.endswith(_INPUTS) and os.path.isfile(arg):
            h.update(b"FILE" + _digest(arg, memo_dir).encode())
            # gcc reads header.h.gch (or .pch) beside an -include'd header, if present.
            for ext in (".gch", ".pch"):
                if os.path.isfile(arg + ext):
                    h.update(ext.encode() + _digest(arg + ext, memo_dir).encode())
        elif arg.endswith(_INPUTS):
            return None  # an input we cannot read: let g++ say so
        else:
            h.update(b"ARG" + arg.encode())
        h.update(b"\0")
    return h.hexdigest(), out


def _put(src: str, dst: str) -> None:
    """Copy src to dst whole: written beside dst, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dst)) or ".",
                               prefix=".gxx-memo.")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        shutil.copymode(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def compiler(args: list[str]) -> list[str]:
    """The real g++ command for ``args``: a link of a shared object uses gold where the
    machine has it (``CC_TESTS_GXX_LINKER=`` keeps g++'s default linker).

    Every Inductor kernel is a shared object linked against libtorch_cpu (~430 MB): GNU
    ld's default (bfd) took 0.35 s of each ~1 s kernel build reading its symbols, gold
    0.15 s (issue 36). The object g++ compiles is the same; only the linker that writes
    the .so differs, as it may between the machines of a fleet.
    """
    linker = os.environ.get("CC_TESTS_GXX_LINKER", "gold")
    if (linker and "-shared" in args and not {"-c", "-E", "-S"} & set(args)
            and not any(a.startswith("-fuse-ld=") for a in args)
            and shutil.which(f"ld.{linker}")):
        return ["g++", f"-fuse-ld={linker}", *args]
    return ["g++", *args]


def _gxx(args: list[str]) -> int:
    cmd = compiler(args)
    rc = subprocess.call(cmd)
    if rc != 0 and cmd[1:] != args:
        # Where the other linker fails, the call as Inductor made it decides.
        rc = subprocess.call(["g++", *args])
    return rc


def main(memo_dir: str, args: list[str]) -> int:
    found = memo_key(args, memo_dir) if os.environ.get("CC_TESTS_GXX_MEMO", "1") != "0" else None
    if found is None:
        return _gxx(args)
    key, out = found
    kept = os.path.join(memo_dir, key)
    if os.path.isfile(kept):
        try:
            _put(kept, out)
        except OSError:
            return _gxx(args)  # g++ gives the error, if any
        _note(memo_dir, "hit", kept)
        return 0
    rc = _gxx(args)
    if rc == 0 and os.path.isfile(out):
        os.makedirs(memo_dir, exist_ok=True)
        _put(out, kept)
        cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(kept + ".cpu", "w") as f:
            f.write(f"{cpu.ru_utime + cpu.ru_stime:.2f}\n")
        _note(memo_dir, "miss", kept)
    return rc


def _note(memo_dir: str, what: str, kept: str) -> None:
    # One line per memoised call: what docs/performance.md's "g++ saved" figure reads.
    try:
        with open(kept + ".cpu") as f:
            cpu = f.read().strip()
    except OSError:
        cpu = "?"
    with open(os.path.join(memo_dir, "log"), "a") as f:
        f.write(f"{what} {cpu} {os.path.basename(kept)[:12]}\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))


def summary(memo_dir: str) -> str | None:
    """One line on what the memo did this session (conftest prints it), or None."""
    try:
        with open(os.path.join(memo_dir, "log")) as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    seconds = {"hit": 0.0, "miss": 0.0}
    counts = {"hit": 0, "miss": 0}
    for what, cpu, _ in (r for r in rows if len(r) == 3):
        counts[what] = counts.get(what, 0) + 1
        try:
            seconds[what] = seconds.get(what, 0.0) + float(cpu)
        except ValueError:
            pass
    return (f"g++ memo: {counts['miss']} compiles built ({seconds['miss']:.0f} s of CPU), "
            f"{counts['hit']} served from the memo (about {seconds['hit']:.0f} s of CPU saved)")
