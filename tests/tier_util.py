"""What the remote tiers' tests share: a clean environment, a tiered store, its warnings."""

from __future__ import annotations

import logging
from pathlib import Path

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
