"""Benchmark the artifact store: publish / lookup latency, verify throughput, `cachectl ls`.

    python tools/bench_store.py [--reps 5] [--big-mb 100] [--ls-entries 10000]
    python tools/bench_store.py --scale 1000,10000,100000 [--reps 3] [--code DIR]
                                [--store-dir DIR] [--verbs ls,stats,verify,gc]

Prints a markdown table of medians. Page cache: every read figure is taken warm
(the file was just written and read once), for the store and for `cat` alike.
"""

# The timed closures run inside the loop iteration that defines them, so they
# see the current loop variables: B023 does not apply.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cachecompile.store import (  # noqa: E402
    Hit,
    Store,
    make_key,
    open_store,
    publishing,
    verification,
)


def median_time(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def fmt_s(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--big-mb", type=int, default=100)
    ap.add_argument("--ls-entries", type=int, default=10_000)
    ap.add_argument("--scale", default="",
                    help="comma-separated store sizes: time only ls, ls --json, stats and a "
                         "fresh process's lookup at each, and how each grows")
    ap.add_argument("--code", type=Path, default=None,
                    help="with --scale: time the cachecompile installed under this folder "
                         "(pip install --no-deps --target DIR <checkout>) instead of this one")
    ap.add_argument("--store-dir", type=Path, default=None,
                    help="with --scale: keep the filled stores under this folder and reuse "
                         "them on the next run (a 100,000-entry fill takes minutes); gc's "
                         "evictions are filled back in afterwards")
    ap.add_argument("--gc-readers", type=int, default=4,
                    help="with --scale: processes looking entries up while gc runs")
    ap.add_argument("--verbs", default=",".join(VERBS),
                    help=f"with --scale: which to time, of {','.join(VERBS)}")
    args = ap.parse_args()
    if args.scale:
        verbs = [v.strip() for v in args.verbs.split(",") if v.strip()]
        unknown = set(verbs) - set(VERBS)
        if unknown:
            ap.error(f"unknown --verbs {sorted(unknown)}; known: {','.join(VERBS)}")
        scale([int(n) for n in args.scale.split(",")], args.reps, args.gc_readers, code=args.code,
              store_dir=args.store_dir, verbs=verbs)
        return
    work = Path(tempfile.mkdtemp(prefix="bench_store."))
    rows: list[tuple[str, str, str]] = []
    try:
        st = open_store(work / "cache")
        assert isinstance(st, Store)
        n = 0
        for label, size in (
            ("1 KB", 1 << 10),
            ("1 MB", 1 << 20),
            (f"{args.big_mb} MB", args.big_mb << 20),
        ):
            data = os.urandom(size)
            src = work / f"src-{size}"
            src.write_bytes(data)

            def publish() -> None:
                nonlocal n
                n += 1
                st.put(make_key({"bench": n, "size": size}), {"f.bin": src})

            t_put = median_time(publish, args.reps)
            key = make_key({"bench": n, "size": size})

            def first_get() -> None:
                verification._VERIFIED.clear()  # as in a fresh process: full checksums
                assert isinstance(st.get(key), Hit)

            t_first = median_time(first_get, args.reps)
            assert isinstance(st.get(key), Hit)
            t_warm = median_time(lambda: st.get(key), max(args.reps, 200))
            rows.append((f"publish {label} (from a file, fsync)", fmt_s(t_put), ""))
            rows.append((f"get {label}, first in process (full checksum)", fmt_s(t_first), ""))
            rows.append((f"get {label}, already verified", fmt_s(t_warm), "goal < 1 ms"))
            if size == args.big_mb << 20:
                path = st.get(key).entry.files["f.bin"]  # type: ignore[union-attr]
                subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)  # warm
                t_cat = median_time(
                    lambda: subprocess.run(
                        ["cat", str(path)], stdout=subprocess.DEVNULL, check=True
                    ),
                    args.reps,
                )
                buf = bytearray(4 << 20)

                def raw_read() -> None:
                    with open(path, "rb", buffering=0) as f:
                        while f.readinto(buf):
                            pass

                t_raw = median_time(raw_read, args.reps)
                gbs_verify = size / t_first / 1e9
                gbs_cat = size / t_cat / 1e9
                gbs_raw = size / t_raw / 1e9
                rows.append(
                    (
                        "verify throughput (first get, full XXH3-128)",
                        f"{gbs_verify:.2f} GB/s",
                        f"{gbs_verify / gbs_cat:.0%} of cat, {gbs_verify / gbs_raw:.0%} of read()",
                    )
                )
                rows.append(
                    (
                        "raw read: `cat file > /dev/null` (incl. process start)",
                        f"{gbs_cat:.2f} GB/s",
                        "page cache warm",
                    )
                )
                rows.append(
                    (
                        "raw read: read() into a 4 MiB buffer, in process",
                        f"{gbs_raw:.2f} GB/s",
                        "page cache warm",
                    )
                )

        # open_store + first get in a fresh process (the warm start-up path of cachecompile).
        five = work / "five"
        five.write_bytes(os.urandom(5 << 20))
        k5 = make_key({"bench": "startup"})
        st.put(k5, {"kernels.so": five})
        code = (
            "import time; t=time.perf_counter(); from cachecompile.store import open_store;"
            f"st=open_store({str(st.root)!r}); r=st.get({k5.digest!r}); assert r;"
            "print(time.perf_counter()-t)"
        )
        env = dict(os.environ, PYTHONPATH=str(REPO))
        ts = [
            float(
                subprocess.run(
                    [sys.executable, "-c", code],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
            for _ in range(args.reps)
        ]
        rows.append(
            (
                "fresh process: import + open_store + first get (5 MB)",
                fmt_s(statistics.median(ts)),
                "",
            )
        )

        # `cachectl ls` over many entries, whole process. Filling 10,000 entries with a
        # full fsync each would take minutes and is not what is measured here: skip fsync.
        real_fsync, real_fsync_dir = os.fsync, publishing.fsync_dir
        os.fsync = lambda fd: None
        publishing.fsync_dir = lambda p: None  # type: ignore[assignment]
        big = open_store(work / "many")
        assert isinstance(big, Store)
        for i in range(args.ls_entries):
            big.put(
                make_key({"i": i}),
                {"code.py": f"x = {i}\n".encode()},
                labels={"model": f"m{i % 7}", "function": "forward", "ranks": str(i % 8)},
            )
        os.fsync, publishing.fsync_dir = real_fsync, real_fsync_dir
        cmd = [sys.executable, "-m", "cachecompile.cli.main", "ls", "--cache-dir", str(big.root)]
        subprocess.run(cmd, env=env, capture_output=True, check=True)
        t_ls = median_time(
            lambda: subprocess.run(cmd, env=env, capture_output=True, check=True), args.reps
        )
        t_lsj = median_time(
            lambda: subprocess.run(cmd + ["--json"], env=env, capture_output=True, check=True),
            args.reps,
        )
        rows.append(
            (f"`cachectl ls`, {args.ls_entries} entries (whole process)", fmt_s(t_ls), "goal < 1 s")
        )
        rows.append((f"`cachectl ls --json`, {args.ls_entries} entries", fmt_s(t_lsj), ""))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"| measure (median of {args.reps}) | value | note |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")



def _fill(root: Path, n: int) -> Store:
    """``n`` small entries in seven models, without fsync (filling is not what is timed).
    Entries already on disk are kept (a reused store is only topped up)."""
    real_fsync, real_fsync_dir = os.fsync, publishing.fsync_dir
    os.fsync = lambda fd: None
    publishing.fsync_dir = lambda p: None  # type: ignore[assignment]
    try:
        st = open_store(root)
        assert isinstance(st, Store)
        there = set(st.digests())
        for i in range(n):
            key = make_key({"i": i})
            if key.digest in there:
                continue
            st.put(key, {"code.py": f"x = {i}\n".encode()},
                   labels={"model": f"m{i % 7}", "function": "forward", "ranks": str(i % 8)})
        return st
    finally:
        os.fsync, publishing.fsync_dir = real_fsync, real_fsync_dir


def _env() -> dict[str, str]:
    """The environment of the timed processes: a user's, not a test harness's (with
    PYTHONDONTWRITEBYTECODE every process compiles its imports anew, and with
    PYTHONUNBUFFERED every line printed is a system call)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONUNBUFFERED", None)
    return env


_SPAWN = """
import os, sys
# A small parent: Linux starts a child's peak RSS at its parent's at fork, so the bench
# (holding a filled store) would lend every child its own size.
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, ru = os.wait4(pid, 0)
sys.stderr.write(f"\\nBENCH {ru.ru_utime + ru.ru_stime} {ru.ru_maxrss}\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _child(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall s, CPU s, peak RSS bytes) of one whole process, from its own rusage (read by
    a small parent process: see _SPAWN)."""
    with tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        rc = subprocess.run([sys.executable, "-c", _SPAWN, *cmd], env=env,
                            stdout=subprocess.DEVNULL, stderr=err).returncode
        wall = time.perf_counter() - t
        err.seek(0)
        text = err.read().decode(errors="replace")
        if rc != 0:
            raise RuntimeError(f"{cmd} failed ({rc}): {text[-2000:]!r}")
    cpu, rss = text.rsplit("BENCH ", 1)[1].split()
    return wall, float(cpu), int(rss) * 1024


_READER = """
import random, sys, time
from cachecompile.store import make_key, open_store
st = open_store(sys.argv[1]); n = int(sys.argv[2]); rng = random.Random(int(sys.argv[3]))
end = time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    st.get(make_key({"i": rng.randrange(n)}))   # hits record in the index; evicted: miss
"""


_RUNNER = """
import runpy, sys
# Time the cachecompile under CODE (pip install --target CODE <a checkout>), not this one.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, CODE)
if sys.argv[1] == "-m":
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__")
else:
    code, sys.argv = sys.argv[2], ["-c", *sys.argv[3:]]
    exec(compile(code, "<bench>", "exec"))
"""


def _python(code: Path | None, work: Path) -> list[str]:
    """The interpreter command of the timed processes: this checkout's cachecompile, or
    the one installed under ``code`` (to time a previous version in the same conditions)."""
    if code is None:
        return [sys.executable]
    runner = work / "runner.py"
    runner.write_text(f"CODE = {str(code)!r}\n" + _RUNNER)
    return [sys.executable, str(runner)]


def _gc_under_readers(root: Path, n: int, env: dict[str, str], py: list[str],
                      readers: int = 4, most: int = 5000) -> float:
    """Entries per second that ``cachectl gc`` evicts (half the store, at most ``most``)
    while ``readers`` processes look entries up (and record their hits in the index) as
    fast as they can."""
    procs = [subprocess.Popen([*py, "-c", _READER, str(root), str(n), str(r), "600"],
                              env=env) for r in range(readers)]
    try:
        time.sleep(2.0 if readers else 0.0)  # readers started and looking up
        before = sum(1 for _ in open_store(root).maintenance().digests())
        st = open_store(root)
        assert isinstance(st, Store)
        # Entries are alike in size: evicting a share of the bytes evicts that share of them.
        cap = int(st.stats(recount=True)["bytes"] * (1 - min(n // 2, most) / n))
        wall, _, _ = _child([*py, "-m", "cachecompile.cli.main", "gc", "--max-size",
                             str(cap), "--cache-dir", str(root)], env)
        after = sum(1 for _ in open_store(root).maintenance().digests())
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return (before - after) / wall


VERBS = ("ls", "ls --json", "stats", "verify", "verify --full", "lookup", "gc")


def scale(sizes: list[int], reps: int, gc_readers: int = 4, code: Path | None = None,
          store_dir: Path | None = None, verbs: list[str] | None = None) -> None:
    """Whole-process wall time, CPU time and peak RSS of ``ls``, ``ls --json``, ``stats``,
    ``verify`` and one lookup (import, ``open_store``, ``get`` of an entry) at each store
    size, and the entries/s gc evicts with ``gc_readers`` readers running.

    ``store_dir``: fill the stores there, keep them, and reuse them next time (gc's
    evictions are put back after it ran)."""
    env = _env()
    verbs = list(VERBS) if verbs is None else verbs
    rows: list[tuple[int, dict[str, tuple[float, float, int]], float | None]] = []
    work = Path(tempfile.mkdtemp(prefix="bench_store_scale."))
    py = _python(code, work)
    cli = [*py, "-m", "cachecompile.cli.main"]
    try:
        for n in sizes:
            root = (store_dir if store_dir is not None else work) / f"s{n}"
            t_fill = time.perf_counter()
            _fill(root, n)
            print(f"{n:,} entries filled in {time.perf_counter() - t_fill:.0f} s",
                  file=sys.stderr)
            key = make_key({"i": n // 2}).digest
            lookup = [*py, "-c",
                      "from cachecompile.store import Hit, open_store; "
                      f"assert isinstance(open_store({str(root)!r}).get({key!r}), Hit)"]

            def run(cmd: list[str]) -> tuple[float, float, int]:
                _child(cmd, env)  # warm caches (and the index's totals)
                runs = [_child(cmd, env) for _ in range(reps)]
                return (statistics.median(r[0] for r in runs),
                        statistics.median(r[1] for r in runs), max(r[2] for r in runs))

            commands = {
                "ls": [*cli, "ls", "--cache-dir", str(root)],
                "ls --json": [*cli, "ls", "--json", "--cache-dir", str(root)],
                "stats": [*cli, "stats", "--cache-dir", str(root)],
                "verify": [*cli, "verify", "--cache-dir", str(root)],
                "verify --full": [*cli, "verify", "--full", "--cache-dir", str(root)],
                "lookup": lookup,
            }
            got = {v: run(cmd) for v, cmd in commands.items() if v in verbs}
            rate = _gc_under_readers(root, n, env, py, gc_readers) if "gc" in verbs else None
            rows.append((n, got, rate))
            if store_dir is None:
                shutil.rmtree(root, ignore_errors=True)
            elif rate is not None:
                _fill(root, n)  # put back what gc evicted, for the next run
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def cell(m: tuple[float, float, int]) -> str:
        return f"{fmt_s(m[0])} ({fmt_s(m[1])} CPU, {m[2] / 2**20:.0f} MiB)"

    timed = [v for v in verbs if v != "gc"]
    gc_col = [f"gc with {gc_readers} readers"] if "gc" in verbs else []
    print(f"| entries | {' | '.join([*(f'`{v}`' for v in timed), *gc_col])} |")
    print("|---|" + "---|" * (len(timed) + len(gc_col)))
    for n, got, rate in rows:
        cells = [cell(got[v]) for v in timed]
        if rate is not None:
            cells.append(f"{rate:,.0f} entries/s")
        print(f"| {n:,} | {' | '.join(cells)} |")
    print(f"\n(median of {reps} whole processes: wall (CPU, peak RSS); lookup: a fresh "
          "process's import, open_store and get)")


if __name__ == "__main__":
    main()
