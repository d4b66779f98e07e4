"""The whole manifest is integrity-checked: meta, factors, labels and the file list.

A one-character edit in ``meta`` (which kernel serves which call, the guards) used to
pass ``cachectl verify`` and then break or mislead every warm process. Each edit here
is made on disk, then looked at as a fresh process would: a lookup in a subprocess
(the entry is corrupt, quarantined, one warning) and ``cachectl verify`` (non-zero).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from store import Hit, make_key, open_store

KEY = {"model": "m", "fn": "forward"}
META = {"program": {"kernels": {"abc": "kernels/abc.so"}}, "guards": [{"text": "x == 1"}]}


def _edit_meta(doc: dict[str, Any]) -> None:
    doc["meta"]["program"]["kernels"]["abc"] = "kernels/abd.so"


def _edit_factors(doc: dict[str, Any]) -> None:
    doc["factors"]["fn"] = "forwarc"


def _edit_files(doc: dict[str, Any]) -> None:
    doc["files"]["kernels/abc.so"]["size"] += 0  # same size ...
    doc["files"]["kernels/abc.so"]["xxh3_128"] = "0" * 32  # ... another checksum


def _edit_labels(doc: dict[str, Any]) -> None:
    doc["labels"]["model"] = "n"


LOOKUP = """
import json, sys, warnings, logging
logging.basicConfig(level=logging.WARNING)
from store import open_store, make_key, Hit
st = open_store(sys.argv[1])
out = st.get(make_key(json.loads(sys.argv[2])))
print(json.dumps({"hit": isinstance(out, Hit), "kind": getattr(out, "kind", None),
                  "reason": getattr(out, "reason", None)}))
"""


@pytest.mark.parametrize("edit", [_edit_meta, _edit_factors, _edit_files, _edit_labels],
                         ids=["meta", "factors", "files", "labels"])
def test_an_edited_manifest_is_corrupt(tmp_path: Path, child_env: dict[str, str],
                                       edit: Callable[[dict[str, Any]], None]) -> None:
    root = tmp_path / "cache"
    st = open_store(root)
    e = st.put(make_key(KEY), {"kernels/abc.so": b"\x7fELF" * 64, "program.py": b"x = 1"},
               labels={"model": "m", "function": "forward"}, meta=META)
    other = st.put(make_key({"other": 1}), {"a": b"a"})
    mpath = e.path / "manifest.json"
    doc = json.loads(mpath.read_text())
    edit(doc)
    mpath.chmod(0o600)
    mpath.write_text(json.dumps(doc, indent=1, sort_keys=True))

    verify = subprocess.run([sys.executable, "-m", "store.cli", "verify", "--cache-dir",
                             str(root)], env=child_env, capture_output=True, text=True,
                            timeout=60)
    assert verify.returncode != 0, verify.stdout + verify.stderr
    assert e.key[:12] in verify.stdout + verify.stderr

    look = subprocess.run([sys.executable, "-c", LOOKUP, str(root), json.dumps(KEY)],
                          env=child_env, capture_output=True, text=True, timeout=60)
    assert look.returncode == 0, look.stderr
    res = json.loads(look.stdout.strip().splitlines()[-1])
    assert not res["hit"] and res["kind"] == "corrupt", res
    assert "integrity" in res["reason"] or "checksum" in res["reason"], res
    assert look.stderr.count("quarantin") == 1, look.stderr
    assert not e.path.exists(), "the corrupt entry is quarantined"
    assert isinstance(open_store(root).get(other.key), Hit), "other entries are untouched"


def test_an_untouched_manifest_verifies_and_hits(tmp_path: Path) -> None:
    st = open_store(tmp_path / "cache")
    e = st.put(make_key(KEY), {"program.py": b"x = 1"}, meta=META)
    assert st.verify().ok
    hit = st.get(make_key(KEY))
    assert isinstance(hit, Hit) and hit.entry.meta == META
    assert e.key == hit.entry.key
