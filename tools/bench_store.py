"""Benchmark the artifact store: publish / lookup latency, verify throughput, `cachectl ls`.

    python tools/bench_store.py [--reps 5] [--big-mb 100] [--ls-entries 10000]
    python tools/bench_store.py --scale 1000,10000,100000 [--reps 3]

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


def median_time(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
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
    args = ap.parse_args()
    if args.scale:
        scale([int(n) for n in args.scale.split(",")], args.reps)
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
        os.fsync = lambda fd: None  # type: ignore[assignment]
        publishing.fsync_dir = lambda p: None  # type: ignore[assignment]
        big = open_store(work / "many")
        assert isinstance(big, Store)
        for i in range(args.ls_entries):
            big.put(
                make_key({"i": i}),
                {"code.py": f"x = {i}\n".encode()},
                labels={"model": f"m{i % 7}", "function": "forward", "ranks": str(i % 8)},
            )
        os.fsync, publishing.fsync_dir = real_fsync, real_fsync_dir  # type: ignore[assignment]
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
    """``n`` small entries in seven models, without fsync (filling is not what is timed)."""
    real_fsync, real_fsync_dir = os.fsync, publishing.fsync_dir
    os.fsync = lambda fd: None  # type: ignore[assignment]
    publishing.fsync_dir = lambda p: None  # type: ignore[assignment]
    try:
        st = open_store(root)
        assert isinstance(st, Store)
        for i in range(n):
            st.put(make_key({"i": i}), {"code.py": f"x = {i}\n".encode()},
                   labels={"model": f"m{i % 7}", "function": "forward", "ranks": str(i % 8)})
        return st
    finally:
        os.fsync, publishing.fsync_dir = real_fsync, real_fsync_dir  # type: ignore[assignment]


def scale(sizes: list[int], reps: int) -> None:
    """Whole-process wall time of ``ls``, ``ls --json``, ``stats`` and one lookup (import,
    ``open_store``, ``get`` of an entry) at each store size: what grows with the store."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cli = [sys.executable, "-m", "cachecompile.cli.main"]
    rows: list[tuple[int, float, float, float, float]] = []
    work = Path(tempfile.mkdtemp(prefix="bench_store_scale."))
    try:
        for n in sizes:
            root = work / f"s{n}"
            _fill(root, n)
            key = make_key({"i": n // 2}).digest
            lookup = [sys.executable, "-c",
                      "from cachecompile.store import Hit, open_store; "
                      f"assert isinstance(open_store({str(root)!r}).get({key!r}), Hit)"]

            def run(cmd: list[str]) -> float:
                subprocess.run(cmd, env=env, capture_output=True, check=True)  # warm caches
                return median_time(lambda: subprocess.run(cmd, env=env, capture_output=True,
                                                          check=True), reps)

            rows.append((n, run([*cli, "ls", "--cache-dir", str(root)]),
                         run([*cli, "ls", "--json", "--cache-dir", str(root)]),
                         run([*cli, "stats", "--cache-dir", str(root)]), run(lookup)))
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"| entries | `ls` | `ls --json` | `stats` | lookup (fresh process) | (median of {reps}, "
          "whole processes) |")
    print("|---|---|---|---|---|---|")
    base = rows[0]
    for r in rows:
        growth = "" if r is base else (f"x{r[0] / base[0]:.0f} entries: ls x{r[1] / base[1]:.1f}, "
                                       f"stats x{r[3] / base[3]:.1f}, lookup x{r[4] / base[4]:.1f}")
        print(f"| {r[0]:,} | {fmt_s(r[1])} | {fmt_s(r[2])} | {fmt_s(r[3])} | {fmt_s(r[4])} | "
              f"{growth} |")


if __name__ == "__main__":
    main()
