"""The digest of cachecompile's own code (every key holds it), read from a cache of the
files' stamps where they are unchanged: an edited source file still changes it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cachecompile import _version


def _tree(tmp_path: Path) -> tuple[str, str, str]:
    pkg, store = tmp_path / "pkg", tmp_path / "store"
    for d, names in ((pkg, ("a.py", "sub/b.py")), (store, ("s.py",))):
        for n in names:
            (d / n).parent.mkdir(parents=True, exist_ok=True)
            (d / n).write_text(f"# {n}\nx = 1\n")
    return str(pkg), str(store), str(pkg / "__pycache__")


def _settle(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if the files were written long ago: a file changed just now is never cached.
    monkeypatch.setattr(_version, "_SETTLED_NS", -10**18)


def _plain(pkg: str, store: str) -> str:
    # What the digest is: every source, read (no cache dir to read from).
    return _version.tree_digest(pkg, store, os.path.join(pkg, "no-cache"), write=False)


def test_the_cached_digest_is_the_digest_and_an_edit_changes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg, store, cache = _tree(tmp_path)
    _settle(monkeypatch)
    first = _version.tree_digest(pkg, store, cache, write=True)
    assert first == _plain(pkg, store)
    saved = json.loads((Path(cache) / _version._CACHE).read_text())
    assert saved["digest"] == first
    assert _version.tree_digest(pkg, store, cache, write=False) == first   # from the cache

    # An edit of the same size, as an editor saves it in place: read again (its mtime
    # moved on; set here, since two writes may share a clock tick).
    b = Path(pkg) / "sub" / "b.py"
    st = b.stat()
    b.write_text(b.read_text().replace("x = 1", "x = 2"))
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    edited = _version.tree_digest(pkg, store, cache, write=True)
    assert edited != first and edited == _plain(pkg, store)
    # ... and a store module too, and a new module.
    (Path(store) / "s.py").write_text("# s.py\nx = 3\n")
    (Path(pkg) / "c.py").write_text("y = 1\n")
    again = _version.tree_digest(pkg, store, cache, write=False)
    assert again not in (first, edited) and again == _plain(pkg, store)


def test_a_file_changed_just_now_is_read_not_cached(tmp_path: Path) -> None:
    # Within the clock's granularity an edit may keep every stamp: such a tree is read
    # and no cache is written for it.
    pkg, store, cache = _tree(tmp_path)
    assert _version.tree_digest(pkg, store, cache, write=True) == _plain(pkg, store)
    assert not (Path(cache) / _version._CACHE).exists()


def test_a_cache_that_does_not_fit_is_not_believed(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pkg, store, cache = _tree(tmp_path)
    _settle(monkeypatch)
    real = _plain(pkg, store)
    Path(cache).mkdir()
    path = Path(cache) / _version._CACHE
    # Another tree's stamps, a damaged file, a wrong shape: the sources are read.
    for text in (json.dumps({"stamps": "0" * 32, "digest": "f" * 32}), "{not json",
                 json.dumps(["digest"]), json.dumps({"stamps": None, "digest": 1})):
        path.write_text(text)
        assert _version.tree_digest(pkg, store, cache, write=False) == real
