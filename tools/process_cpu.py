"""Where the test suite's CPU goes, process by process (issue 65).

``install VENV LOG`` writes a ``sitecustomize.py`` into the venv's site-packages: every
Python process of that venv (pytest's workers, the tests' children, zygote forks, torchrun
ranks, Inductor's probes) then appends one line to LOG at exit: pid, parent pid, wall
seconds, its own CPU seconds, its waited-for children's CPU, the test it ran under
(``PYTEST_CURRENT_TEST``), its command line and whether it imported torch. ``report LOG``
sums them by test and by kind of process; ``uninstall VENV`` removes the file. A process
that leaves through ``os._exit`` (xdist's workers, gloo's ranks) writes no line, and g++ is
no Python process: the suite's total CPU is ``/usr/bin/time``'s, g++'s the memo's summary.

    python tools/process_cpu.py install .venv /tmp/proc.log
    python -m pytest -n logical --maxschedchunk=1 -q
    python tools/process_cpu.py report /tmp/proc.log
    python tools/process_cpu.py uninstall .venv

What it found first (2026-12-03): 667 interpreters that imported no torch, 86 s of CPU,
were Inductor's vector-ISA probes (a ``python -c`` per ISA dlopening a test build, in every
compiling child), now run once per zygote (tests/zygote.py, ``PROBES``).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

HOOK = '''# Written by tools/process_cpu.py (measurement only): one line per process at exit.
import atexit as _atexit, os as _os, sys as _sys, time as _time, resource as _resource
_cc_t0 = _time.time()
def _cc_process_line():
    try:
        r = _resource.getrusage(_resource.RUSAGE_SELF)
        c = _resource.getrusage(_resource.RUSAGE_CHILDREN)
        cmd = " ".join(_sys.argv)[:150].replace("\\t", " ").replace("\\n", " ")
        test = _os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
        with open(@LOG@, "a") as f:
            f.write("%d\\t%d\\t%.2f\\t%.2f\\t%.2f\\t%s\\t%s\\t%s\\n" % (
                _os.getpid(), _os.getppid(), _time.time() - _cc_t0, r.ru_utime + r.ru_stime,
                c.ru_utime + c.ru_stime, test, cmd,
                "torch" if "torch" in _sys.modules else "-"))
    except Exception:
        pass
_atexit.register(_cc_process_line)
'''


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise SystemExit(f"no site-packages under {venv}")
    return found[0]


def _kind(cmd: str, torch: bool) -> str:
    first = cmd.split()[0].rsplit("/", 1)[-1] if cmd else "?"
    if "torch.distributed.run" in cmd:
        first = "torchrun"
    elif "cachecompile.cli" in cmd:
        first = "cachectl"
    return f"{'torch' if torch else 'no torch'} {first}"


def _most(sums: dict[str, float], top: int) -> list[tuple[str, float]]:
    return sorted(sums.items(), key=lambda kv: -kv[1])[:top]


def report(log: Path, top: int) -> str:
    by_test: dict[str, float] = collections.defaultdict(float)
    by_kind: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    total = 0.0
    rows = 0
    for line in log.read_text().splitlines():
        f = line.split("\t")
        if len(f) != 8:
            continue
        cpu = float(f[3])
        rows += 1
        total += cpu
        by_test[f[5]] += cpu
        kind = _kind(f[6], f[7] == "torch")
        by_kind[kind] += cpu
        count[kind] += 1
    out = [f"{rows} processes, {total:.0f} s of their own CPU", "", "by kind of process:"]
    out += [f"  {v:8.1f} s  {count[k]:5d}  {k}" for k, v in _most(by_kind, top)]
    out += ["", "by test:"]
    out += [f"  {v:8.1f} s  {k}" for k, v in _most(by_test, top)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    inst = sub.add_parser("install", help="log every process of VENV into LOG")
    inst.add_argument("venv", type=Path)
    inst.add_argument("log", type=Path)
    uninst = sub.add_parser("uninstall", help="remove the hook from VENV")
    uninst.add_argument("venv", type=Path)
    rep = sub.add_parser("report", help="sum LOG by test and by kind of process")
    rep.add_argument("log", type=Path)
    rep.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.cmd == "install":
        hook = _site_packages(args.venv) / "sitecustomize.py"
        if hook.exists() and "tools/process_cpu.py" not in hook.read_text():
            raise SystemExit(f"{hook} exists and is not this tool's: not overwritten")
        hook.write_text(HOOK.replace("@LOG@", repr(str(args.log.resolve()))))
        print(f"installed {hook}; processes log to {args.log}")
    elif args.cmd == "uninstall":
        hook = _site_packages(args.venv) / "sitecustomize.py"
        if hook.exists() and "tools/process_cpu.py" in hook.read_text():
            hook.unlink()
            print(f"removed {hook}")
    else:
        print(report(args.log, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
