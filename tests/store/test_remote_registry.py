"""Each remote parses its own URL and registers its schemes; the shared parser
(store/remote/base.py) dispatches through the registry and knows no server by name."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import pytest
from memory_remote import MemoryRemote

from cachecompile.store import errors
from cachecompile.store.remote import (
    FileRemote,
    HttpRemote,
    OciLayoutRemote,
    OciRemote,
    RedisRemote,
    S3Remote,
    base,
    open_levels,
    open_remote,
)
from cachecompile.store.remote.base import BlobRemote, RemoteConfig, register
from cachecompile.store.signing import Trust

REPO = Path(__file__).resolve().parents[2]


def test_each_scheme_opens_its_own_remote() -> None:
    assert type(open_remote("redis://localhost:6379/0")) is RedisRemote
    assert type(open_remote("unix:///run/redis.sock")) is RedisRemote
    s3 = open_remote("s3://bucket/team")
    assert type(s3) is S3Remote and s3.config.display == "s3://bucket/team"
    assert S3Remote.from_url("s3://bucket").config.prefix == "cachecompile"
    assert RedisRemote.from_url("redis://h:1/0?prefix=p").config.prefix == "p"
    with pytest.raises(errors.RemoteConfigError, match="not a redis URL"):
        RedisRemote.from_url("s3://bucket/team")
    assert type(open_remote("file:///mnt/shared/cc")) is FileRemote
    web = open_remote("https://cache.internal:8443/team/cc?mode=ro")
    assert type(web) is HttpRemote and web.readonly
    assert web.config.display == "https://cache.internal:8443/team/cc"
    assert type(open_remote("oci://registry.internal/team/cc")) is OciRemote
    assert type(open_remote("oci-layout:///srv/warm")) is OciLayoutRemote
    with pytest.raises(errors.RemoteConfigError,
                       match=r"only file://, http://, https://, oci://, oci\+http://, "
                             r"oci\+https://, oci-layout://, redis://, rediss://, unix:// "
                             r"and s3:// URLs"):
        open_remote("ftp://host/x")
    # A chain of levels is opened level by level, never as one remote.
    with pytest.raises(errors.RemoteConfigError, match="a chain of 2 levels"):
        open_remote("file:///mnt/cc,s3://bucket/p")
    assert [type(r) for r in open_levels("file:///mnt/cc, s3://bucket/p")] == [FileRemote,
                                                                               S3Remote]
    with pytest.raises(errors.RemoteConfigError, match="named twice"):
        open_levels("file:///mnt/cc,file:///mnt/cc?mode=ro")


def test_a_registered_server_is_parsed_and_opened_without_base_knowing_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_REMOTES", dict(base._REMOTES))  # undone after the test

    # The server's records and blobs are the in-memory remote's: its URL is its own.
    class Echo(MemoryRemote):
        kind = "echo"
        schemes = ("echo",)

        def __init__(self, config: RemoteConfig | str, trust: Trust | None = None) -> None:
            super().__init__(trust or Trust.from_env(),
                             config=RemoteConfig.parse(config) if isinstance(config, str)
                             else config)

        @classmethod
        def parse_url(cls, parts: urllib.parse.SplitResult, ours: Mapping[str, str],
                      rest: list[tuple[str, str]], *, credentials: bool) -> tuple[str, str]:
            if rest:
                raise ValueError("echo takes no parameters")
            return parts.netloc, parts.path.strip("/") or "echoes"

        @classmethod
        def display_of(cls, target: str, prefix: str) -> str:
            return f"echo://{target}/{prefix}"

    register(Echo)
    config = RemoteConfig.parse("echo://:s3cret@box/here?mode=ro&timeout=2")
    assert (config.kind, config.target, config.prefix, config.readonly, config.timeout) == (
        "echo", "box", "here", True, 2.0)
    assert config.display == "echo://box/here" and config.password == "s3cret"
    assert type(Echo.from_url("echo://box")) is Echo and Echo.from_url("echo://box").config.prefix == "echoes"
    with pytest.raises(errors.RemoteConfigError, match="echo takes no parameters"):
        RemoteConfig.parse("echo://box?x=1")
    with pytest.raises(ValueError, match="served by Echo already"):
        register(type("Other", (Echo,), {"schemes": ("echo",)}))


def test_no_server_is_named_outside_its_own_module() -> None:
    # base.py dispatches through the registry: no `kind == "s3"` branch, no scheme table.
    for path in [*(REPO / "store").rglob("*.py"), *(REPO / "cachecompile").rglob("*.py")]:
        if path.name in ("s3.py", "redis.py") and path.parent.name == "remote":
            continue
        text = path.read_text()
        for needle in ('kind == "s3"', 'kind == "redis"', '"s3": ', '"rediss"'):
            assert needle not in text, f"{path.relative_to(REPO)} names a server: {needle}"


def test_a_server_that_lacks_a_hook_is_refused_before_its_first_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # BlobRemote's hooks are abstract: a server class missing one is refused when it is
    # registered (its module imported), and cannot be made, instead of raising
    # NotImplementedError at the first upload or download.
    monkeypatch.setattr(base, "_REMOTES", dict(base._REMOTES))  # undone after the test
    hooks = {"parse_url", "display_of", "read_record", "raw_records", "write_record",
             "put_blobs", "fetch_blob", "ping", "contains", "delete",
             "sweep", "info", "close"}
    assert BlobRemote.__abstractmethods__ == hooks
    assert not MemoryRemote.__abstractmethods__  # the fake implements every one

    # A server written from the in-memory one, all but one hook.
    namespace = {k: v for k, v in vars(MemoryRemote).items() if k in hooks - {"fetch_blob"}}
    forgetful = cast("type[BlobRemote]", type("Forgetful", (BlobRemote,),
                                               {**namespace, "kind": "forgetful",
                                                "schemes": ("forgetful",)}))
    with pytest.raises(TypeError, match=r"Forgetful does not implement fetch_blob "):
        register(forgetful)
    assert "forgetful" not in base._REMOTES
    with pytest.raises(TypeError, match="fetch_blob"):
        forgetful(RemoteConfig(url="forgetful://x", target="x", kind="forgetful"),
                  Trust.from_env())
