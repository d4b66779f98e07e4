"""What the trust factors of the key cost a warm start (issue 31): the digest of
cachecompile's own code and the global compiler settings, each timed in fresh processes
that have imported what a warm process imports (torch, cachecompile's key), never Inductor.

    python tools/bench_key_factors.py --runs 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, time
import torch
from cachecompile.key import factors
t0 = time.perf_counter()
factors.versions()            # first call: reads and hashes cachecompile's sources
t1 = time.perf_counter()
factors.compiler_config()     # no config module imported: nothing to read
t2 = time.perf_counter()
import torch._inductor.config as c
c.coordinate_descent_tuning = True
t3 = time.perf_counter()
factors.compiler_config()     # a process that did import and change Inductor's config
t4 = time.perf_counter()
print(json.dumps({"code_digest_ms": (t1 - t0) * 1e3, "compiler_config_ms": (t2 - t1) * 1e3,
                  "compiler_config_imported_ms": (t4 - t3) * 1e3}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=15)
    a = ap.parse_args()
    rows = [json.loads(subprocess.run([sys.executable, "-c", CHILD], check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1])
            for _ in range(a.runs)]
    for k in rows[0]:
        vals = sorted(r[k] for r in rows)
        print(f"{k:30s} median {statistics.median(vals):6.2f} ms  "
              f"min {vals[0]:6.2f}  max {vals[-1]:6.2f}  ({a.runs} fresh processes)")


if __name__ == "__main__":
    main()
