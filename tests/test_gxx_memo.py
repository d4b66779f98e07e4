"""The suite's g++ memo (tests/gxx_memo.py): what it keys on and what it runs.

The memo decides what a test's compile costs, never what it builds: a key must change
with any input's bytes, also where it keeps a big input's digest between calls."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import gxx_memo
import pytest


def _args(tmp_path: Path) -> list[str]:
    return [str(tmp_path / "k.cpp"), "-include", str(tmp_path / "pch.h"), "-O3", "-shared",
            "-fPIC", "-o", str(tmp_path / "k.so"), "-ltorch"]


# Older than _SETTLED, as a header built earlier in the session is.
_PAST_NS = time.time_ns() - 60 * 10**9


def _settled(path: Path) -> None:
    os.utime(path, ns=(_PAST_NS, _PAST_NS))


def test_a_big_inputs_kept_digest_follows_its_bytes(tmp_path: Path) -> None:
    memo = tmp_path / "memo"
    (tmp_path / "k.cpp").write_text("int f() { return 1; }\n")
    (tmp_path / "pch.h").write_text("#pragma once\n")
    gch = tmp_path / "pch.h.gch"
    gch.write_bytes(b"a" * (2 << 20))
    _settled(gch)
    first = gxx_memo.memo_key(_args(tmp_path), str(memo))
    assert first is not None
    assert len(list((memo / "digests").iterdir())) == 1   # the header's digest, kept
    assert gxx_memo.memo_key(_args(tmp_path), str(memo)) == first
    assert gxx_memo.memo_key(_args(tmp_path)) == first   # the same key as hashing it again

    time.sleep(0.05)  # another clock tick for the rewrite's ctime
    gch.write_bytes(b"b" * (2 << 20))  # other bytes, the same size and (below) mtime
    _settled(gch)  # only its ctime tells the rewrite
    second = gxx_memo.memo_key(_args(tmp_path), str(memo))
    assert second is not None and second[0] != first[0]
    assert gxx_memo.memo_key(_args(tmp_path)) == second


def test_a_fresh_big_input_is_hashed_and_not_kept(tmp_path: Path) -> None:
    # Written just now: gcc may still patch its first bytes within the same clock tick.
    memo = tmp_path / "memo"
    (tmp_path / "k.cpp").write_text("int f() { return 1; }\n")
    (tmp_path / "pch.h").write_text("#pragma once\n")
    (tmp_path / "pch.h.gch").write_bytes(b"a" * (2 << 20))
    assert gxx_memo.memo_key(_args(tmp_path), str(memo)) == gxx_memo.memo_key(_args(tmp_path))
    assert not (memo / "digests").exists()


@pytest.mark.skipif(shutil.which("ld.gold") is None, reason="no ld.gold on this machine")
def test_links_use_gold_and_compiles_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CC_TESTS_GXX_LINKER", raising=False)
    link = ["k.cpp", "-shared", "-fPIC", "-o", "k.so"]
    assert gxx_memo.compiler(link) == ["g++", "-fuse-ld=gold", *link]
    for args in (["k.cpp", "-c", "-o", "k.o"], ["h.hpp", "-E", "-o", "h.i"],
                 ["-x", "c++-header", "h.h", "-o", "h.h.gch"],
                 ["k.cpp", "-shared", "-fuse-ld=bfd", "-o", "k.so"]):
        assert gxx_memo.compiler(args) == ["g++", *args]
    monkeypatch.setenv("CC_TESTS_GXX_LINKER", "")
    assert gxx_memo.compiler(link) == ["g++", *link]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
def test_a_link_the_other_linker_fails_is_made_as_asked(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A linker on PATH that g++ refuses (-fuse-ld=broken): the call as made still builds.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ld.broken").write_text("#!/bin/sh\nexit 1\n")
    (bindir / "ld.broken").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CC_TESTS_GXX_LINKER", "broken")
    (tmp_path / "k.cpp").write_text('extern "C" int f() { return 1; }\n')
    args = [str(tmp_path / "k.cpp"), "-shared", "-fPIC", "-o", str(tmp_path / "k.so")]
    assert gxx_memo.compiler(args)[1] == "-fuse-ld=broken"
    assert gxx_memo.main(str(tmp_path / "memo"), args) == 0
    assert (tmp_path / "k.so").stat().st_size > 0
    # Built once: the same call is now the memo's.
    (tmp_path / "k.so").unlink()
    assert gxx_memo.main(str(tmp_path / "memo"), args) == 0
    assert (tmp_path / "memo" / "log").read_text().split()[::3] == ["miss", "hit"]
