"""Inductor's freezing (``config={"freezing": True}``, inference on CPU), cached: a warm
process loads the program with results equal to torch.compile with freezing at every
call, and other weights are a miss that names them (``frozen_state``), never the old
program, not even through the shared-graph path."""

from __future__ import annotations

from pathlib import Path

import pytest
from ccutil import Sandbox

pytestmark = pytest.mark.slow

CHILD = """
import logging, os, torch, transformers
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from cachecompile import cache_compile
torch.manual_seed(int(os.environ.get("SEED", "0")))

class Serve(torch.nn.Module):
    def __init__(self):
        super().__init__()
        cfg = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=128,
                                      max_position_embeddings=64)
        self.bert = transformers.BertModel(cfg).eval()
        self.cached = cache_compile(self._encode, config={"freezing": True})
    def _encode(self, ids):
        return self.bert(input_ids=ids).last_hidden_state

s = Serve()
# torch.compile's results: computed here (and saved, REF_SAVE), or those an earlier process
# with the same weights computed (REF_LOAD): the warm process then compiles nothing but
# its cache's program, and its parity is with the same torch.compile's outputs. NO_REF:
# no torch.compile at all (a process whose check is eager's results for its own weights).
load = os.environ.get("REF_LOAD")
refs = torch.load(load) if load else None
ref = None if load or os.environ.get("NO_REF") else \
    torch.compile(s._encode, options={"freezing": True}, dynamic=True)
same, close, outs = [], [], []
with torch.no_grad():
    for i, seq in enumerate((11, 17, 5)):
        ids = torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(seq))
        out = s.cached(ids)
        if refs is not None or ref is not None:
            want = refs[i] if refs is not None else ref(ids)
            outs.append(want)
            same.append(bool(torch.equal(out, want)))
        close.append(bool(torch.allclose(out, s._encode(ids), atol=1e-4)))
if os.environ.get("REF_SAVE"):
    torch.save(outs, os.environ["REF_SAVE"])
report({"events": [e for e, _ in s.cached.events], "same": same, "close": close})
"""


def test_freezing_is_cached_with_torch_compile_parity(tmp_path: Path) -> None:
    box = Sandbox(tmp_path / "box")
    refs = str(tmp_path / "torch_compile_outputs.pt")
    cold = box.run(CHILD, REF_SAVE=refs)
    assert cold["events"] == ["miss"] and all(cold["same"]) and all(cold["close"]), cold.value
    warm = box.run(CHILD, REF_LOAD=refs)
    assert warm["events"] == ["hit"] and all(warm["same"]) and all(warm["close"]), warm.value
    other = box.run(CHILD, SEED="1", NO_REF="1")
    # Other weights: a miss naming them (not the other weights' graph through the
    # shared-graph path either); its results are its own weights' (eager's: the parity
    # with torch.compile is the first two processes', and a torch.compile here would be a
    # third freezing compile for no other fact).
    assert other["events"] == ["miss"] and other["same"] == [] and len(other["close"]) == 3
    assert all(other["close"]), other.value
    miss = next(ln for ln in other.stderr.splitlines() if "cachecompile miss" in ln)
    assert "frozen_state" in miss, miss
