"""What `cachectl stats` counts: one outcome per lookup, misses by why, and the lookups of
read-only processes (an image layer's), which cannot write the store's index."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import ccutil
import pytest
import torch
from ccutil import Sandbox
from torch import nn

from cachecompile import cache_compile, store
from cachecompile.store import metrics


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.scale = 2  # an int attribute the method reads: Dynamo guards its value

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


def _stats(d: Path) -> dict:
    return store.open_store(d).stats()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_one_outcome_per_lookup_and_misses_by_why(tmp_path: Path, backend: str) -> None:
    d = tmp_path / "cc"
    m = Scaled().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        cache_compile(m.run, backend=backend, cache_dir=d)(x)  # cold
        s = _stats(d)
        # One cold call is one lookup: one miss, not one per key it probed.
        assert (s["hits"], s["misses"]) == (0, {"absent": 1}), s
        cache_compile(m.run, backend=backend, cache_dir=d)(x)  # as a new process: a hit
        m.scale = 3
        out = cache_compile(m.run, backend=backend, cache_dir=d)(x)  # the entry's guard fails
        assert torch.allclose(out, m.run(x))
    s = _stats(d)
    assert (s["hits"], s["misses"]) == (1, {"absent": 1, "guard": 1}), s
    assert s["misses_about"] == {"guard": {"self.scale": 1}}, s
    assert s["hits"] / (s["hits"] + sum(s["misses"].values())) == pytest.approx(1 / 3)


def test_counters_file_format_and_what_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    d = tmp_path / "stats"
    c = metrics.ProcessCounters(root, d)
    c.incr("hits")
    c.incr("hits")
    c.incr("miss:guard")
    c.incr('about:guard:self.cache["k"]')
    text = c.path.read_text()
    assert text.startswith("# HELP cachecompile_counter")
    assert f'pid="{os.getpid()}",name="hits"}} 2' in text
    assert metrics.read_counters(root, d) == {"hits": 2, "miss:guard": 1,
                                              'about:guard:self.cache["k"]': 1}
    assert (d.stat().st_mode & 0o777) == 0o700
    # Another store's lines in the same dir are not this one's.
    other = metrics.ProcessCounters(tmp_path / "elsewhere", d)
    other.incr("hits", 5)
    assert metrics.read_counters(root, d)["hits"] == 2
    # A symlink is not followed: neither a linked file nor a linked stats dir.
    outside = tmp_path / "outside.prom"
    outside.write_text(c.path.read_text())
    (d / "cachecompile-evil-1.prom").symlink_to(outside)
    assert metrics.read_counters(root, d)["hits"] == 2
    link = tmp_path / "linked-stats"
    link.symlink_to(d)
    assert metrics.read_counters(root, link) == {}
    assert metrics.remove_counters(root, d) == 1 and metrics.read_counters(root, d) == {}


def test_a_store_made_again_at_a_path_counts_from_zero(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The read-only counters live outside the store (/tmp), found by its path: a store
    deleted and made again there (a test's tmp dir, a rebuilt image) is another store, and
    its `cachectl stats` must not count its predecessor's hits and misses (it did: CI)."""
    monkeypatch.delenv("CACHECOMPILE_STATS_DIR", raising=False)
    root = tmp_path / "store"
    store.open_store(root)
    first = metrics.stats_dir(root)
    c = metrics.ProcessCounters(root)
    c.incr("miss:absent")
    try:
        assert metrics.read_counters(root) == {"miss:absent": 1}
        instance = root / "v1" / "instance"
        assert len(instance.read_text()) == 32 and (instance.stat().st_mode & 0o777) == 0o400
        store.open_store(root)  # opened again: the same store, the same id and counts
        assert metrics.stats_dir(root) == first
        assert metrics.read_counters(root) == {"miss:absent": 1}
        shutil.rmtree(root)
        assert _stats(root)["misses"] == {}
        assert metrics.read_counters(root) == {} and metrics.stats_dir(root) != first
    finally:
        metrics.remove_counters(root, first)
    # A store made before it had an id keeps its counters where they were (by path).
    (root / "v1" / "instance").unlink()
    assert metrics.stats_dir(root).name == metrics.hashlib.sha256(
        str(root.resolve()).encode()).hexdigest()[:16]


def _cachectl(env: dict[str, str], *args: str) -> ccutil.Ran:
    return ccutil.cachectl(*args, env=env)


MODEL = """
import torch
from torch import nn
from cachecompile import cache_compile


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.scale = 2
        self.cached = cache_compile(self.run, backend="aot_eager", dynamic=False)

    def run(self, x):
        return torch.tanh(self.lin(x)) * self.scale
"""

SERVE = """
import torch
from scaled import Scaled
m = Scaled().eval()
with torch.no_grad():
    m.cached(torch.randn(2, 4))
    m.cached(torch.randn(3, 4))
    m.scale = 3
    m2 = Scaled().eval()
    m2.scale = 3
    m2.cached(torch.randn(2, 4))
report({"events": [e for e, _ in m.cached.events + m2.cached.events]})
"""


def test_a_read_only_process_counts_where_cachectl_stats_reads(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    (box.root / "scaled.py").write_text(MODEL)
    box.run("import torch\nfrom scaled import Scaled\nm = Scaled().eval()\n"
            "with torch.no_grad():\n    m.cached(torch.randn(2, 4))\nreport(1)")
    s = json.loads(_cachectl(box.env(), "stats", "--json").stdout)
    assert (s["hits"], s["misses"]) == (0, {"absent": 1})
    # As docs/deploy.md serves: read-only, no stats dir named (the per-user default).
    ro = box.env(CACHECOMPILE_READONLY="1")
    r = box.run(SERVE, CACHECOMPILE_READONLY="1")
    assert r["events"] == ["hit", "miss", "miss"], r.value  # compiled, not published
    s = json.loads(_cachectl(ro, "stats", "--json").stdout)
    assert s["hits"] == 1 and s["misses"] == {"absent": 2, "guard": 1}, s
    assert s["misses_about"] == {"guard": {"self.scale": 1}, "absent": {"signature": 1}}, s
    assert s["readonly_processes"] == {"hits": 1, "misses": 2}, s
    text = _cachectl(ro, "stats").stdout
    assert "read-only processes" in text and "self.scale" in text, text
    # --zero on a read-only store clears the read-only processes' counters.
    assert _cachectl(ro, "stats", "--zero").returncode == 0
    s = json.loads(_cachectl(ro, "stats", "--json").stdout)
    assert s["readonly_processes"] == {"hits": 0, "misses": 0}, s


def test_a_read_only_consumer_of_an_empty_path_is_counted_there_and_warns_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/deploy.md's read-only consumer, before anything was published at its path:
    `cachectl stats PATH` shows its lookups (it said "no store"), and three misses are one
    warning (each was a "cache index update failed" warning, and a CacheFaultWarning)."""
    import logging
    import warnings

    from cachecompile.errors import CacheFaultWarning

    monkeypatch.setenv("CACHECOMPILE_READONLY", "1")
    monkeypatch.setenv("CACHECOMPILE_STATS_DIR", str(tmp_path / "stats"))
    monkeypatch.delenv("CACHECOMPILE_REMOTE", raising=False)
    empty = tmp_path / "never-published"
    m = Scaled().eval()
    cached = cache_compile(m.run, backend="aot_eager", cache_dir=empty, dynamic=False)
    caplog.set_level(logging.WARNING, logger="cachecompile")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in (2, 3, 4):
            cached(torch.randn(n, 4))
    assert [e for e, _ in cached.events] == ["miss"] * 3
    faults = [str(w.message) for w in caught if issubclass(w.category, CacheFaultWarning)]
    assert len(faults) == 1 and "read-only" in faults[0], faults
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not empty.exists()  # a read-only consumer writes nothing there

    r = ccutil.cachectl("stats", "--cache-dir", str(empty), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert (s["entries"], s["hits"], s["misses"]) == (0, 0, {"absent": 3}), s
    assert s["readonly_processes"] == {"hits": 0, "misses": 3}, s
    assert s["readonly_stats_dir"] == str(tmp_path / "stats") and "no_store" in s, s
    text = ccutil.cachectl("stats", "--cache-dir", str(empty)).stdout
    assert "nothing was published here" in text and str(tmp_path / "stats") in text, text
    # A path no process counted lookups of is still a mistyped one.
    typo = ccutil.cachectl("stats", "--cache-dir", str(tmp_path / "nevre-published"))
    assert typo.returncode == 2 and "no cache at" in typo.stderr, typo
