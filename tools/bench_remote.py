"""Remote tier benchmark: warm start from a remote hit vs a local hit, and throughput.

    python tools/bench_remote.py                 # --reps 5 --big-mb 200
    python tools/bench_remote.py --url redis://127.0.0.1:6379/0   # an existing server
    python tools/bench_remote.py --tiers --entry-mb 80    # local vs Redis, S3, file://, HTTP

Without ``--url`` it starts its own ``redis-server`` on a free loopback port (no
persistence) and stops it at the end; ``--tiers`` also starts a moto S3 server
(tests/s3_util.py; the test extras install it).

1. Warm start of the demo model (``python -m cachecompile.demo``'s child, prefill +
   decode, Inductor): whole fresh processes, time from spawn to first output, each with
   empty Inductor/Triton/tmp dirs. "local hit": the store already holds the entries.
   "remote hit": an EMPTY local store and the remote: every entry is downloaded,
   verified (SHA-256, XXH3) and published locally before it is loaded.
2. Throughput for one large entry (``--big-mb``, random bytes): upload (SHA-256 +
   chunked SETs), raw download (GETs + SHA-256 into a file) and a full tiered ``get``
   (download + verify + local publish with fsync).
3. ``--tiers``: one entry of ``--entry-mb`` (random bytes) looked up by a whole fresh
   process (spawn to Hit: import, open the store, download, verify, publish locally)
   from a local store that holds it, and from an empty one with Redis, S3, a shared
   directory (file://) or an nginx HTTP cache (where nginx is installed) behind it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cachecompile import store  # noqa: E402
from cachecompile.demo.__main__ import _fresh_env, _run  # noqa: E402
from cachecompile.store import Hit, make_key  # noqa: E402
from cachecompile.store.remote import RedisRemote, open_remote  # noqa: E402
from cachecompile.store.signing import Trust  # noqa: E402
from cachecompile.store.tiered import TieredStore  # noqa: E402


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not on PATH (bash .ci/system-deps.sh), or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--dir", str(workdir), "--logfile", str(workdir / "redis.log")])
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def warm_start(base: Path, url: str, reps: int) -> dict[str, list[float]]:
    env_remote = {"CACHECOMPILE_REMOTE": url, "CACHECOMPILE_SIGNING_KEY": "bench-key"}
    seeded = base / "seeded"
    # Cold: compile, publish locally, upload (the child waits for the upload at exit).
    _run("cold", {**_fresh_env(base, "cold", seeded), **env_remote}, 5)
    out: dict[str, list[float]] = {"local hit": [], "local hit, remote configured": [],
                                   "remote hit": []}
    for i in range(reps):
        env = _fresh_env(base, f"local{i}", seeded)
        env.pop("CACHECOMPILE_REMOTE", None)
        r = _run("warm", env, 5)
        assert not any("miss" in v for v in r["events"].values()), r["events"]
        out["local hit"].append(r["first_output_s"])

        r = _run("warm", {**_fresh_env(base, f"localr{i}", seeded), **env_remote}, 5)
        out["local hit, remote configured"].append(r["first_output_s"])

        empty = base / f"empty{i}"
        r = _run("warm", {**_fresh_env(base, f"remote{i}", empty), **env_remote}, 5)
        assert not any("miss" in v for v in r["events"].values()), r["events"]
        assert not r["dynamo_imported"]
        out["remote hit"].append(r["first_output_s"])
    return out


def throughput(base: Path, url: str, mb: int) -> dict[str, float]:
    trust = Trust(key=b"bench-key")
    src = store.open_store(base / "big-src", remote="")
    key = make_key({"bench": "big", "mb": mb, "t": time.time()})
    blob = base / "big.bin"
    with open(blob, "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    entry = src.put(key, {"big.bin": blob})
    size = entry.size_bytes / 1e6
    remote = RedisRemote(url, trust=trust)
    remote.ping()
    t0 = time.perf_counter()
    assert remote.upload(entry)
    up = time.perf_counter() - t0
    dest = base / "big-raw"
    dest.mkdir()
    t0 = time.perf_counter()
    assert remote.download(entry.key, dest) is not None
    down = time.perf_counter() - t0
    dst = store.open_store(base / "big-dst", remote="")
    assert isinstance(dst, store.Store)
    tiered = TieredStore(dst, RedisRemote(url, trust=trust))
    t0 = time.perf_counter()
    assert isinstance(tiered.get(key), Hit)
    full = time.perf_counter() - t0
    return {"MB": size, "upload MB/s": size / up, "download MB/s": size / down,
            "remote-hit get MB/s": size / full}


FRESH_GET = """
import sys, time, json
t0 = time.perf_counter()
from cachecompile import store
st = store.open_store(sys.argv[1])
hit = st.get(sys.argv[2])
assert isinstance(hit, store.Hit), hit
print(json.dumps({"get_s": time.perf_counter() - t0}))
"""


def tiers(base: Path, redis_url: str, mb: int, reps: int) -> dict[str, list[float]]:
    """Whole fresh processes: spawn to Hit of one ``mb`` MB entry, per tier."""
    sys.path.insert(0, str(REPO / "tests"))
    from http_util import DAV_EXT, NginxServer, nginx_exe
    from s3_util import MotoServer

    srv = MotoServer(base / "moto").start()
    web = (NginxServer(base / "nginx").start() if nginx_exe() and DAV_EXT.is_file()
           else None)
    try:
        os.environ.update(srv.env())  # this process uploads the entry too
        env = {**os.environ, "CACHECOMPILE_SIGNING_KEY": "bench-key"}
        (base / "share").mkdir(mode=0o700)
        urls = {"Redis": redis_url, "S3 (moto)": f"s3://{srv.bucket()}/bench",
                "file://": f"file://{base / 'share'}"}
        if web is not None:
            urls["HTTP (nginx)"] = web.url("bench")
        seed = base / "tier-seed"
        with open(base / "entry.bin", "wb") as f:
            for _ in range(mb):
                f.write(os.urandom(1 << 20))
        key = make_key({"bench": "tiers", "mb": mb, "t": time.time()})
        local = store.open_store(seed, remote="")
        entry = local.put(key, {"weights.bin": base / "entry.bin"})
        for url in urls.values():
            assert open_remote(url, Trust(key=b"bench-key")).upload(entry)
        out: dict[str, list[float]] = {"local hit": [], **{f"{n} hit": [] for n in urls}}
        for i in range(reps):
            runs = [("local hit", seed, "")] + [
                (f"{n} hit", base / f"tier-{n[:2]}-{i}", u) for n, u in urls.items()]
            for name, root, url in runs:
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-c", FRESH_GET, str(root), key.digest],
                               check=True, capture_output=True,
                               env={**env, "CACHECOMPILE_REMOTE": url})
                out[name].append(time.perf_counter() - t0)
        return out
    finally:
        srv.stop()
        if web is not None:
            web.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--big-mb", type=int, default=200)
    ap.add_argument("--url", default=None, help="an existing Redis (default: start one)")
    ap.add_argument("--skip-warm", action="store_true", help="only the throughput figures")
    ap.add_argument("--tiers", action="store_true",
                    help="only: a fresh process's hit of one entry, local vs each tier")
    ap.add_argument("--entry-mb", type=int, default=80)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        base = Path(tmp)
        proc = None
        url = args.url
        if url is None:
            proc, url = start_redis(base)
        try:
            if args.tiers:
                print(f"one {args.entry_mb} MB entry, whole fresh processes (spawn to Hit), "
                      f"median of {args.reps}:")
                res = tiers(base, url, args.entry_mb, args.reps)
                local = statistics.median(res["local hit"])
                for name, xs in res.items():
                    med = statistics.median(xs)
                    print(f"  {name:<16} {med:6.2f} s  ({med / local:.2f}x local)  "
                          f"[{', '.join(f'{x:.2f}' for x in xs)}]")
                return 0
            if not args.skip_warm:
                print(f"warm start, demo model, whole fresh processes, median of {args.reps}:")
                res = warm_start(base, url, args.reps)
                local = statistics.median(res["local hit"])
                for name, xs in res.items():
                    med = statistics.median(xs)
                    print(f"  {name:<30} {med:6.2f} s  ({med / local:.2f}x local)  "
                          f"[{', '.join(f'{x:.2f}' for x in xs)}]")
            print(f"throughput, one {args.big_mb} MB entry, loopback:")
            for k, v in throughput(base, url, args.big_mb).items():
                print(f"  {k:<22} {v:8.0f}")
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
