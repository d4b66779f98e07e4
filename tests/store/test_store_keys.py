"""Keys, manifests, paths and the eviction policy: pure functions, no store needed."""

from __future__ import annotations

import json

import pytest

from cachecompile.store import EntryInfo, canonical_json, make_key
from cachecompile.store.errors import AmbiguousKey, KeyNotFound, ManifestError, UnsafePathError
from cachecompile.store.keys import match_prefix
from cachecompile.store.manifest import dump_manifest, parse_manifest, validate_name
from cachecompile.store.policy import lru_evictions, older_than


def test_key_is_order_independent_and_canonical() -> None:
    a = make_key({"b": 1, "a": {"y": [1, 2], "x": None}})
    b = make_key({"a": {"x": None, "y": (1, 2)}, "b": 1})
    assert a.digest == b.digest
    assert len(a.digest) == 32 and all(c in "0123456789abcdef" for c in a.digest)
    assert canonical_json({"b": 1, "a": 2}) == '{"a":2,"b":1}'
    assert a.factors == {"a": {"x": None, "y": [1, 2]}, "b": 1}


def test_key_is_type_sensitive() -> None:
    digests = {make_key({"v": v}).digest for v in (1, 1.0, True, "1", None, [1], {"1": 1})}
    assert len(digests) == 7
    assert make_key({"v": 0.1}).digest != make_key({"v": 0.1000001}).digest


def test_key_is_stable() -> None:
    # The digest is part of the on-disk format: a change here orphans every cache.
    assert make_key({"a": 1}).digest == make_key({"a": 1}).digest
    import xxhash

    assert make_key({"a": 1}).digest == xxhash.xxh3_128_hexdigest(b'{"a":1}')


@pytest.mark.parametrize("bad", [{"x": object()}, {"x": {1: 2}}, {"x": b"bytes"}, {"x": {1.5}}])
def test_key_rejects_unhashable_factors(bad: dict) -> None:
    with pytest.raises(TypeError, match="factor"):
        make_key(bad)


def test_key_needs_mapping() -> None:
    with pytest.raises(TypeError):
        make_key([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["a", "a/b.so", "dir/sub/x.py", ".hidden", "a..b"])
def test_validate_name_accepts(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "/etc/passwd", "../x", "a/../../x", "a/./b", "a//b", "a/", "a\\b", "a\x00b", 3]
)
def test_validate_name_rejects(name: object) -> None:
    with pytest.raises(UnsafePathError):
        validate_name(name)


def _manifest(files: dict) -> bytes:
    return dump_manifest(key="0" * 32, factors={"a": 1}, labels={}, meta={}, created=1.0,
                         files=files)


def test_manifest_roundtrip() -> None:
    text = _manifest({"a.so": {"size": 3, "xxh3_128": "f" * 32}})
    doc = parse_manifest(text, expect_key="0" * 32)
    assert doc["files"]["a.so"]["size"] == 3 and doc["factors"] == {"a": 1}


def test_manifest_rejects_traversal_and_garbage() -> None:
    with pytest.raises(UnsafePathError):
        parse_manifest(_manifest({"../evil": {"size": 1, "xxh3_128": "0" * 32}}))
    with pytest.raises(UnsafePathError):
        parse_manifest(_manifest({"/abs": {"size": 1, "xxh3_128": "0" * 32}}))
    with pytest.raises(UnsafePathError):  # "a" as file and as directory
        parse_manifest(_manifest({"a": {"size": 1, "xxh3_128": "0" * 32},
                                  "a/b": {"size": 1, "xxh3_128": "0" * 32}}))
    with pytest.raises(ManifestError, match="JSON"):
        parse_manifest(b"{not json")
    with pytest.raises(ManifestError):
        parse_manifest(_manifest({"a": {"size": -1, "xxh3_128": "0"}}))
    with pytest.raises(ManifestError, match="does not match"):
        parse_manifest(_manifest({}), expect_key="1" * 32)
    doc = json.loads(_manifest({}))
    doc["format"] = 99
    with pytest.raises(ManifestError, match="format"):
        parse_manifest(json.dumps(doc))


def _info(key: str, size: int, last_used: float) -> EntryInfo:
    return EntryInfo(key=key, size_bytes=size, created=0.0, last_used=last_used, hits=0)


def test_lru_policy_evicts_least_recently_used_until_under_cap() -> None:
    es = [_info("a", 40, 3.0), _info("b", 40, 1.0), _info("c", 40, 2.0)]
    assert lru_evictions(es, 120) == []
    assert [e.key for e in lru_evictions(es, 100)] == ["b"]
    assert [e.key for e in lru_evictions(es, 40)] == ["b", "c"]
    assert [e.key for e in lru_evictions(es, 0)] == ["b", "c", "a"]


def test_lru_policy_skips_pinned() -> None:
    es = [_info("a", 40, 3.0), _info("b", 40, 1.0), _info("c", 40, 2.0)]
    assert [e.key for e in lru_evictions(es, 80, pinned={"b"})] == ["c"]
    # Pinned entries alone over the cap: every unpinned one goes, pinned stay.
    assert [e.key for e in lru_evictions(es, 10, pinned={"a", "b"})] == ["c"]


def test_older_than() -> None:
    es = [_info("a", 1, 10.0), _info("b", 1, 20.0)]
    assert [e.key for e in older_than(es, 15.0)] == ["a"]


def test_a_key_prefix_resolves_to_one_digest_or_says_why_not() -> None:
    """The one resolver of a prefix, for the local store and the remote tier alike."""
    digests = ["ab01", "ab02", "cd03"]
    assert match_prefix(" CD ", digests) == "cd03"      # spaces and case ignored
    with pytest.raises(AmbiguousKey) as amb:
        match_prefix("ab", digests)
    assert amb.value.matches == ["ab01", "ab02"]
    with pytest.raises(KeyNotFound, match="no remote entry matches 'ef'"):
        match_prefix("ef", digests, "remote entry")
    with pytest.raises(KeyNotFound, match="no entry matches ''"):
        match_prefix("", digests)                       # an empty prefix matches nothing
