"""One parser of each: sizes (cap, --max-size, a remote's chunk=), env numbers and switches,
and one "explain a miss" for cachectl and cachecompile's log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cachecompile.store import config, explain, make_key, open_store
from cachecompile.store.remote import RemoteConfig


@pytest.mark.parametrize(("text", "size"), [
    ("512", 512), ("1K", 1024), ("4M", 4 << 20), ("1.5GiB", 3 << 29), ("64kb", 64 << 10),
    (" 10G ", 10 << 30), (7, 7)])
def test_parse_size(text: str | int, size: int) -> None:
    assert config.parse_size(text) == size


def test_a_remote_chunk_is_a_size_like_any_other() -> None:
    assert RemoteConfig.parse("redis://h:1/0?chunk=1.5K").chunk == 1536
    with pytest.raises(ValueError, match="not a size"):
        RemoteConfig.parse("redis://h:1/0?chunk=lots")


def test_env_numbers(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("CC_TEST_N", raising=False)
    assert config.env_int("CC_TEST_N") is None and config.env_int("CC_TEST_N", 3) == 3
    monkeypatch.setenv("CC_TEST_N", " 12 ")
    assert config.env_int("CC_TEST_N") == 12 and config.env_float("CC_TEST_N", 1.0) == 12.0
    monkeypatch.setenv("CC_TEST_N", "four")
    with pytest.raises(ValueError, match="CC_TEST_N='four' is not an integer"):
        config.env_int("CC_TEST_N")
    with caplog.at_level(logging.WARNING, logger="cachecompile.store.config"):
        assert config.env_int("CC_TEST_N", 5, lenient=True) == 5
        assert config.env_float("CC_TEST_N", 2.5) == 2.5
    assert sum("CC_TEST_N" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize(("value", "on"), [("1", True), ("Yes", True), ("on", True),
                                           ("0", False), ("", False), ("no", False)])
def test_env_flag(value: str, on: bool) -> None:
    assert config.env_flag("X", {"X": value}) is on


def test_nearest_names_the_entry_with_fewest_differing_factors(tmp_path: Path) -> None:
    st = open_store(tmp_path / "c")
    base = {"model": "M", "cfg": {"dtype": "f16", "bs": 1}, "signature": [[4, 8]]}
    near = st.put(make_key({**base, "variant": 3}), {"a": b"1"},
                  labels={"model": "M", "function": "f"})
    st.put(make_key({**base, "cfg": {"dtype": "bf16", "bs": 2}}), {"a": b"2"},
           labels={"model": "M", "function": "f"})
    st.put(make_key({**base, "signature": [[4, 16]]}), {"a": b"3"},
           labels={"model": "Other", "function": "f"})
    want = {**base, "signature": [[4, 16]]}
    found = explain.nearest(st, want, {"model": "M", "function": "f"})
    # The variant slot is not compared; the other model's entry is not a candidate.
    assert found is not None and found.key == near.key and found.differ == ["signature"]
    assert explain.nearest(st, want, {"model": "M"}, exclude=near.key, limit=1) is not None
    assert explain.nearest(st, want, {"model": "nobody"}) is None
