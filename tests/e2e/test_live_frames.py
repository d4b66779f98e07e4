"""A frame compiled live in a warm process is published with every guard a cold capture of
it has (issue 60).

The method breaks its graph, then reads a global (``SCALE``: Dynamo guards its value) and
``getattr(helper, "NAME", 1.0)`` (absent: the guards that keep it absent are built from the
lookups Dynamo made, recorded while it traced). A warm process with another ``SCALE``
compiles the resume frame live and publishes it as a frame variant; a cold process with that
``SCALE`` compiles the same frame in its first call. Both variants must carry the same
guards, and a later process where ``helper`` gained ``NAME`` must not be served either.
(Before, the warm process's live capture did not record lookups, its variant lacked "helper
has no NAME", and that process got ``y*5 + 1`` where eager gives ``y*5 + 5``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ccutil import Sandbox

pytestmark = pytest.mark.slow

MODEL = '''
import os
import torch
from torch import nn
import helper

SCALE = int(os.environ.get("SCALE", "3"))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def run(self, x):
        y = self.lin(x)
        torch._dynamo.graph_break()
        return y * SCALE + getattr(helper, "NAME", 1.0)
'''

RUN = '''
import os, re, sys, torch
import helper, model
if os.environ.get("ADD"):
    helper.NAME = 5.0
from cachecompile import cache_compile
from cachecompile.entry.frame_records import read_frames
from cachecompile.entry.meta import EntryMeta
from cachecompile.store import open_store

m = model.Net().eval()
cached = cache_compile(m.run, fullgraph=False, backend="{backend}")
x = torch.ones(2, 4)
with torch.no_grad():
    got, want = cached(x), m.run(x)
served = {{}}
for variants in cached._runners.values():
    for v in variants:
        if v.frames is not None:
            served.update({{k: list(n) for k, n in v.frames.served().items()}})
# Every stored variant of the resume frame: where it was stored, and its guards (kind and
# what each reads, without the value it wants).
st = open_store()
frames = []
for info in st.entries():
    meta = EntryMeta.from_json(st.manifest(info.key)["meta"])
    for r in read_frames(meta.frames):
        for var in r.variants:
            # (Dynamo numbers the names it generates per process: __builtins_dict___4.)
            frames.append({{"head": meta.head, "guards": sorted(re.sub(r"\\d+", "N",
                f"{{g['kind']}} {{g.get('expr', g.get('name', ''))}}") for g in var.guards)}})
report({{"ok": bool(torch.allclose(got, want)), "got": float(got.sum()),
        "want": float(want.sum()), "events": [e[0] for e in cached.events],
        "served": served, "frames": frames}})
'''


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_a_frame_compiled_live_carries_every_guard_of_a_cold_capture(
        tmp_path: Path, backend: str) -> None:
    run = RUN.format(backend=backend)
    fleet, alone = Sandbox(tmp_path / "fleet"), Sandbox(tmp_path / "alone")
    for box in (fleet, alone):
        (box.root / "model.py").write_text(MODEL)
        (box.root / "helper.py").write_text("")
    cold = fleet.run(run, SCALE="3")
    assert cold["ok"] and cold["events"] == ["miss"], cold.value
    warm = fleet.run(run, SCALE="5")     # the resume frame's guard on SCALE fails: live
    assert warm["ok"] and warm["events"] == ["hit"], warm.value
    assert any(n[1] == 1 for n in warm["served"].values()), warm["served"]
    published = [f for f in warm["frames"] if f["head"]]
    assert len(published) == 1, warm["frames"]

    fresh = alone.run(run, SCALE="5")    # the same frame, in a cold process's first call
    assert fresh["ok"] and fresh["events"] == ["miss"], fresh.value
    [captured] = fresh["frames"]
    assert published[0]["guards"] == captured["guards"], (
        "guards only the cold capture has: "
        f"{sorted(set(captured['guards']) - set(published[0]['guards']))}; "
        f"only the live one: {sorted(set(published[0]['guards']) - set(captured['guards']))}")

    # helper gains NAME: neither variant may serve it; the frame compiles live again.
    added = fleet.run(run, SCALE="5", ADD="1")
    assert added["ok"], (added["got"], added["want"], added["served"])
    again = fleet.run(run, SCALE="5", ADD="1")     # ... and is served from then on
    assert again["ok"] and any(n[0] == 1 and n[1] == 0 for n in again["served"].values()), \
        again["served"]
