"""What the remote tiers' tests share: a real server of each tier, a clean environment, a
tiered store, its warnings."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachecompile import store
from cachecompile.store.tiered import TieredStore

# Everything a tier reads from the environment: unset, so that a test sets what it means.
REMOTE_VARS = ("CACHECOMPILE_REMOTE", "CACHECOMPILE_SIGNING_KEY", "CACHECOMPILE_TRUST_REMOTE",
               "CACHECOMPILE_DIR", "CACHECOMPILE_READONLY", "CACHECOMPILE_VERIFY_KEYS",
               "CACHECOMPILE_REMOTE_PASSWORD", "CACHECOMPILE_REMOTE_PASSWORD_FILE")


def clean_remote_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in REMOTE_VARS:
        monkeypatch.delenv(var, raising=False)


def tiered(root: Path, url: str) -> TieredStore:
    """The store at ``root`` with the remote (or chain) ``url`` behind it."""
    st = store.open_store(root, remote=url)
    assert isinstance(st, TieredStore)
    return st


def store_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings the store (its tiers included) logged."""
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("cachecompile.store.") and r.levelno >= logging.WARNING]


# Every tier a test can ask :func:`remote_tier` for (a chain: several, joined by commas).
TIERS = ("redis", "moto", "s3rver", "file", "http", "oci")


@contextlib.contextmanager
def remote_tier(workdir: Path, kind: str) -> Iterator[tuple[Any, dict[str, str]]]:
    """A real server of a remote tier on loopback, and the environment a node uses to
    reach it (``CACHECOMPILE_REMOTE``, and the ``AWS_*`` variables for S3). ``kind``:
    ``redis``; ``moto`` (also ``s3``) or ``s3rver`` (the prefix ``fleet``); ``file``, a
    shared directory (the server is the :class:`fs_util.SharedDir`; the URL is mount
    point ``a``'s, ``srv.url("b")`` the other node's); ``http``, nginx with WebDAV (the
    prefix ``fleet/cc``); or a chain of them, nearest first (``"file,moto"``: the server
    is the list of the levels' servers, the URL the chain)."""
    levels = [k.strip() for k in kind.split(",")]
    if len(levels) > 1:
        with contextlib.ExitStack() as stack:
            made = [stack.enter_context(remote_tier(workdir / f"level{i}-{k}", k))
                    for i, k in enumerate(levels)]
            env: dict[str, str] = {}
            for _, e in made:
                env.update(e)
            env["CACHECOMPILE_REMOTE"] = ",".join(e["CACHECOMPILE_REMOTE"] for _, e in made)
            yield [srv for srv, _ in made], env
        return
    if kind == "file":
        from fs_util import shared_dir

        with shared_dir(workdir / "share") as share:
            yield share, {"CACHECOMPILE_REMOTE": share.url("a")}
        return
    srv: Any
    if kind == "redis":
        from redis_util import RedisServer

        srv = RedisServer(workdir / "redis").start()
        env = {"CACHECOMPILE_REMOTE": srv.url()}
    elif kind in ("moto", "s3"):
        from s3_util import MotoServer

        srv = MotoServer(workdir / "moto").start()
        env = {**srv.env(), "CACHECOMPILE_REMOTE": f"s3://{srv.bucket()}/fleet"}
    elif kind == "s3rver":
        from s3_util import S3rver

        srv = S3rver(workdir / "s3rver").start()
        env = {**srv.env(), "CACHECOMPILE_REMOTE": f"s3://{srv.bucket}/fleet"}
    elif kind == "http":
        from http_util import NginxServer

        srv = NginxServer(workdir / "nginx").start()
        env = {"CACHECOMPILE_REMOTE": srv.url("fleet/cc")}
    elif kind == "wsgidav":
        from http_util import WsgiDavServer

        srv = WsgiDavServer(workdir / "wsgidav").start()
        env = {"CACHECOMPILE_REMOTE": srv.url("fleet/cc")}
    elif kind == "oci":
        from oci_util import Registry

        srv = Registry(workdir / "registry").start()
        env = {"CACHECOMPILE_REMOTE": srv.url("fleet/cc")}
    else:
        raise ValueError(f"no remote tier {kind!r}")
    try:
        yield srv, env
    finally:
        srv.stop()
