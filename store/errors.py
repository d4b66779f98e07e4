"""Typed errors of the artifact store.

Lookups never raise for the normal path: they return ``Hit`` or ``Miss``.
Everything below is a *fault*, raised so that the integration layer can turn it
into a warning and a recompile, and so that ``cachectl`` can map it to an exit code.

::

    StoreError                      base of every store fault
    ├── StoreInputError             a value a user gave is not valid: a size, a variable's
    │   (also ValueError)           number, a key, a bundle's file name (cachectl: usage)
    ├── StoreNotFound               no store at the given root (cachectl never creates one)
    ├── InsecureStoreError          root/entry owned by someone else, group/world-writable,
    │                               or a directory inside the root that is a symlink
    ├── ReadOnlyStoreError          a write on a read-only store
    ├── StoreFullError              ENOSPC / EDQUOT while publishing (nothing half-written is left)
    ├── LockTimeout                 a lock was not acquired in time (carries ``path``)
    ├── CorruptEntryError           an entry failed verification (carries ``digest``, ``reason``)
    ├── PublishConflict             a put kept losing its key to entries deleted at once
    ├── ManifestError               a manifest is not valid JSON or has the wrong shape
    │   └── UnsafePathError         a manifest/file name escapes its entry (absolute, ``..``, symlink)
    ├── KeyNotFound                 no entry matches a key or prefix (also a ``LookupError``)
    │   └── AmbiguousKey            a prefix matches more than one entry
    ├── RemoteError                 the remote tier failed: refused, a timeout, a partial read
    ├── RemoteConfigError           the remote's URL is malformed (never holds its password)
    │   (also ValueError)
    ├── UntrustedEntryError         an entry of a remote or a bundle lacks a valid signature
    └── UnsafeArchiveError          a bundle is malformed or malicious (tar-slip, a link...)

Outside the tree, deliberately (tests/test_error_tree.py reads this list)::

    SettingWarning (UserWarning)    a CACHECOMPILE_* variable that does not parse; its
                                    default is used (settings.py)
    Bad (verification.py)           why an entry being inspected is not a hit; caught by
                                    the lookup that raised it and turned into a miss
    _Gone (remote/s3.py)            an object is not there (HTTP 404), told apart from a
                                    failure of the remote; control flow inside s3.py
    _NoDatabase (index.py)          a read-only view's index file does not exist yet: an
                                    empty index, not a fault; control flow inside index.py
    _Status (remote/http.py)        an HTTP answer outside the tier's rules; caught in
                                    http.py's bounded call, which raises the tier's error
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "AmbiguousKey",
    "CorruptEntryError",
    "InsecureStoreError",
    "KeyNotFound",
    "LockTimeout",
    "ManifestError",
    "PublishConflict",
    "ReadOnlyStoreError",
    "RemoteConfigError",
    "RemoteError",
    "SettingWarning",
    "StoreError",
    "StoreFullError",
    "StoreInputError",
    "StoreNotFound",
    "UnsafeArchiveError",
    "UnsafePathError",
    "UntrustedEntryError",
]

SHARED_HINT = (
    "to use a deliberately shared team cache, make the root group-owned by a group you "
    "belong to and not world-writable, then set CACHECOMPILE_SHARED_GROUP=1 "
    "(or pass shared_group=True to open_store)"
)


LINK_HINT = (
    "the store never follows a symlink below its root (it could lead to files anyone can "
    "write); remove the link and let cachecompile recreate the directory"
)


class StoreError(Exception):
    """Base class of every fault raised by the store."""


class StoreInputError(StoreError, ValueError):
    """A value a user gave the store is not valid: a size, a number in a variable, a key, a
    bundle's file name. cachectl says it as a usage error (exit 2)."""


class SettingWarning(UserWarning):
    """A ``CACHECOMPILE_*`` variable whose value does not parse: its default is used
    (``cachecompile.store.settings``; once per variable and value)."""


class StoreNotFound(StoreError):
    """The root holds no store: a mistyped path must not be created and reported empty."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"no cache at {self.path}: {problem}")


class InsecureStoreError(StoreError):
    """The root or an entry could be written by someone other than this user."""

    def __init__(self, path: Path | str, problem: str, hint: str = SHARED_HINT) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"refusing insecure cache path {self.path}: {problem}; {hint}")


class ReadOnlyStoreError(StoreError):
    """A write (publish, delete, gc...) was attempted on a read-only store."""


class StoreFullError(StoreError):
    """The filesystem ran out of space or quota while publishing."""


class LockTimeout(StoreError):
    """A store lock could not be acquired within its timeout."""

    def __init__(self, path: Path | str, timeout: float) -> None:
        self.path = Path(path)
        self.timeout = timeout
        super().__init__(f"timed out after {timeout:g}s waiting for lock {self.path}")


class CorruptEntryError(StoreError):
    """An entry failed verification (checksum, size, missing file)."""

    def __init__(self, digest: str, reason: str) -> None:
        self.digest = digest
        self.reason = reason
        super().__init__(f"entry {digest} is corrupt: {reason}")


class PublishConflict(StoreError):
    """A ``put`` lost the race for its key to another writer's entry, and that entry was
    deleted before it could be handed out, again and again (a writer and a deleter of the
    same key in a tight loop): nothing was published by this call."""


class ManifestError(StoreError):
    """A manifest is unreadable, not JSON, or does not have the expected shape."""


class UnsafePathError(ManifestError):
    """A file name would escape its entry directory."""


class KeyNotFound(StoreError, LookupError):
    """No entry matches the given key or prefix."""


class AmbiguousKey(KeyNotFound):
    """A key prefix matches more than one entry."""

    def __init__(self, prefix: str, matches: list[str]) -> None:
        self.prefix = prefix
        self.matches = matches
        shown = ", ".join(m[:12] for m in matches[:5])
        super().__init__(f"prefix {prefix!r} matches {len(matches)} entries ({shown}...)")


# -- the remote tier and bundles


class RemoteError(StoreError):
    """The remote tier failed: connection refused, a timeout, OOM, a partial read."""


class RemoteConfigError(StoreError, ValueError):
    """The remote's URL (``CACHECOMPILE_REMOTE``, ``--remote``) is malformed. Its message
    never holds the URL's password."""


class UntrustedEntryError(StoreError):
    """An entry from a remote or a bundle lacks a valid signature, or trust was not given."""

    def __init__(self, digest: str, reason: str) -> None:
        self.digest = digest
        self.reason = reason
        super().__init__(f"refusing entry {digest}: {reason}")


class UnsafeArchiveError(StoreError):
    """A bundle is malformed or malicious (tar-slip, a link, a device, a bad checksum)."""
