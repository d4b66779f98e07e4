"""Absence where Python looks a name up, guarded from the lookup itself (issue 47).

Four methods read a name that Python finds only after consulting namespaces that lack it;
a fresh process adds it to one of them, and plain torch.compile (tracing afresh) follows:

- ``type(self).K`` found on the **metaclass**; the class gains ``K``;
- ``self.K`` served by the module's own **``__getattr__``**; the instance gains ``K``;
- ``getattr(helper, "NAME", default)``: the default; the helper module gains ``NAME``;
- a builtin (``abs``) called by a function the method **inlines from another module**;
  that module defines ``abs``.

Dynamo installs no guard on any of these absences (cachecompile derives them from the
lookups Dynamo resolved, :mod:`cachecompile.cold.lookups`). Per backend, three fresh
processes over one store: cold (publishes), changed (must not be served the entry: its
result must be a fresh torch.compile's), unchanged (hits; then the state is changed in
that loaded process, and every call must still give eager's result).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ccutil import Sandbox

pytestmark = pytest.mark.slow

HELPER = '''
import os

if os.environ.get("AB_CHANGE") == "1":
    NAME = 5.0

    def abs(t):          # shadows the builtin for magnitude() below
        return t * 100


def magnitude(t):
    return abs(t) + 1
'''

CASES = '''
import os
import torch
from torch import nn
import ab_helper

CHANGED = os.environ.get("AB_CHANGE") == "1"


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)


class Meta(type):
    K = 2.0


class MetaAttr(Base, metaclass=Meta):
    def run(self, x):
        return self.lin(x) * type(self).K

    @staticmethod
    def change(m):
        MetaAttr.K = 5.0

    @staticmethod
    def undo(m):
        del MetaAttr.K


class OwnGetattr(Base):
    def __getattr__(self, name):
        if name == "K":
            return 2.0
        return super().__getattr__(name)

    def run(self, x):
        return self.lin(x) * self.K

    @staticmethod
    def change(m):
        m.K = 5.0

    @staticmethod
    def undo(m):
        del m.K


class GetattrDefault(Base):
    def run(self, x):
        return self.lin(x) * getattr(ab_helper, "NAME", 2.0)

    @staticmethod
    def change(m):
        ab_helper.NAME = 5.0

    @staticmethod
    def undo(m):
        del ab_helper.NAME


class InlinedBuiltin(Base):
    def run(self, x):
        return ab_helper.magnitude(self.lin(x))

    @staticmethod
    def change(m):
        ab_helper.abs = lambda t: t * 100

    @staticmethod
    def undo(m):
        del ab_helper.abs


ALL = [MetaAttr, OwnGetattr, GetattrDefault, InlinedBuiltin]


def build(cls):
    m = cls().eval()
    if CHANGED and cls is OwnGetattr:
        m.K = 5.0       # the instance attribute, set in this fresh process
    if CHANGED and cls is MetaAttr:
        MetaAttr.K = 5.0
    return m
'''

DRIVER = '''
import os, torch
import ab_cases
from cachecompile import cache_compile

backend = os.environ["AB_BACKEND"]
then_change = os.environ.get("AB_THEN_CHANGE") == "1"
x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
out = {}
for cls in ab_cases.ALL:
    m = ab_cases.build(cls)
    cached = cache_compile(m.run, backend=backend)
    r = {}
    with torch.no_grad():
        try:
            got = cached(x)
        except Exception as e:
            try:    # this release's Dynamo cannot compile it at all (2.12: MetaAttr)
                torch.compile(ab_cases.build(cls).run, backend=backend, fullgraph=True)(x)
            except Exception:
                out[cls.__name__] = {"unsupported": f"{type(e).__name__}: {e}"[:300]}
                continue
            raise
        eager = m.run(x)
        r["ok"] = bool(torch.allclose(got, eager, atol=1e-5))
        r["event"] = cached.events[-1][0]
        if os.environ.get("AB_CHANGE") == "1":
            # The spec: plain torch.compile, tracing afresh in this process.
            plain = torch.compile(m.run, backend=backend, fullgraph=True)(x)
            r["as_torch_compile"] = bool(torch.allclose(got, plain, atol=1e-5))
            r["plain_is_eager"] = bool(torch.allclose(plain, eager, atol=1e-5))
        if then_change:
            # Changed after the first call, in the process that loaded the entry.
            before = eager
            cls.change(m)
            try:
                again = [cached(x) for _ in range(3)]
                eager = m.run(x)
                r["after_change"] = all(bool(torch.allclose(a, eager, atol=1e-5)) for a in again)
                r["change_matters"] = not bool(torch.allclose(before, eager, atol=1e-5))
                r["events"] = [e for e, _ in cached.events]
            finally:
                cls.undo(m)
            r["after_undo"] = bool(torch.allclose(cached(x), m.run(x), atol=1e-5))
    out[cls.__name__] = r
report(out)
'''


def _supported(run: dict[str, Any]) -> dict[str, Any]:
    """The cases this release's Dynamo can compile: one that plain torch.compile(fullgraph=True)
    cannot compile either (torch 2.12 fails on the metaclass attribute) is no case here, as
    in the guard sweep; at most that one."""
    left_out = {case: r["unsupported"] for case, r in run.items() if "unsupported" in r}
    assert set(left_out) <= {"MetaAttr"}, left_out
    return {case: r for case, r in run.items() if case not in left_out}


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_absence_added_in_a_fresh_process_is_never_served(tmp_path: Path, backend: str) -> None:
    (tmp_path / "ab_helper.py").write_text(HELPER)
    (tmp_path / "ab_cases.py").write_text(CASES)
    box = Sandbox(tmp_path)
    cold_all = box.run(DRIVER, AB_BACKEND=backend).value
    cold = _supported(cold_all)
    cold_left_out = set(cold_all) - set(cold)
    # "shared": compiled here, its graph's program shared with an identical one's.
    assert all(r["ok"] and r["event"] in ("miss", "shared") for r in cold.values()), cold
    changed = _supported(box.run(DRIVER, AB_BACKEND=backend, AB_CHANGE="1").value)
    for case, r in changed.items():
        assert r["event"] in ("miss", "shared"), (case, "served the entry traced without "
                                                  "the name", r)
        assert r["plain_is_eager"], (case, r)
        assert r["ok"] and r["as_torch_compile"], (case, r)
    warm = _supported(box.run(DRIVER, AB_BACKEND=backend, AB_THEN_CHANGE="1").value)
    for case, r in warm.items():
        assert r["ok"] and r["event"] == "hit", (case, r)
        assert r["change_matters"], (case, "the change must make a difference")
        assert r["after_change"] and r["after_undo"], (case, r)
        if case in cold_left_out:
            # The entry served here is the one the changed process compiled (K on the
            # class; this release could not compile the unchanged MetaAttr), which reads the
            # float K as a symbolic input under dynamic=True (torch.compile does too): its
            # program computes with the value set now, right (after_change above) with no
            # guard failing.
            continue
        assert len(r["events"]) > 1, (case, "the loaded entry's guards saw the change", r)
