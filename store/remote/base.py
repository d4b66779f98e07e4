"""What every remote tier is and shares: the :class:`Remote` protocol the tiered store and
``cachectl`` type against, the URL's settings, the circuit breaker, and
:class:`BlobRemote`: the one upload and download flow, which every remote runs over its
own keys, objects or files (Redis, S3, a shared directory, an HTTP cache).

The rules, the same on every remote:

* An entry is a signed *record* (:mod:`cachecompile.store.signing`) plus its files as
  blobs addressed by SHA-256, so identical files are stored once and a planted blob
  cannot pass for another.
* An upload pins its blobs, writes them, then writes the record last and only if the
  record is still the one it judged (a conditional write), so an entry is visible whole
  or not at all and two uploaders never tear or blindly replace it.
* A download checks the record's signature before it fetches a byte, and every file's
  SHA-256 after.
* Any failure trips the breaker: ONE warning, then every call is a quick
  :class:`~cachecompile.store.errors.RemoteError` (the process goes on local-only) until
  one call is let through again after a backoff (1 s, doubling, at most 60 s).
* A forked child never uses its parent's client: a client's sockets (and an S3 client's
  I/O runtime and its epoll instance) are shared with the parent across ``fork``, so a
  child that used them would hang and could crash the parent. Every remote re-creates its
  client in a child (:meth:`BlobRemote.forked`, run by ``os.register_at_fork`` and, should
  a fork skip Python's hooks, by a pid check before each call); a server's class says how
  in one hook, :meth:`BlobRemote.reset_client`.
"""

from __future__ import annotations

import abc
import inspect
import logging
import os
import re
import stat
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from .. import errors, settings
from ..config import parse_size
from ..outcomes import Entry
from ..signing import Record, Trust, make_record, parse_record, sha256_file
from .deadline import call_with_deadline
from .judging import RecordState, may_replace, record_state

logger = logging.getLogger(__name__)

__all__ = ["BlobRemote", "Breaker", "Listed", "RecordState", "Remote", "RemoteConfig",
           "Uploaded", "call_with_deadline", "may_replace", "open_levels", "open_remote",
           "record_state", "redact", "register", "split_levels"]

MAX_CHUNK = 64 * 1024**2  # Redis caps a value at 512 MB; big values stall the server
# 4 MiB: redis-py's reply parser copies big values; 4 MiB GETs ran 600 MB/s on loopback,
# 16 MiB ones 440 (tools/bench_remote.py), and smaller ones add round trips.
DEFAULT_CHUNK = 4 * 1024**2
# How long an upload's pins keep ``purge`` off its blobs after their last refresh. A
# killed upload's blobs are swept this long after it died, not before.
DEFAULT_LEASE = 600.0
CAS_TRIES = 5  # records rewritten under us this often in a row: give up this upload
_OURS = ("mode", "chunk", "timeout", "backoff", "prefix", "lease")
# The remotes by URL scheme: each server's class registers its own (:func:`register`),
# as ccache's k_remote_storage_implementations lists its backends; the package
# (cachecompile.store.remote) imports every server's module, so the registry is whole
# before anything here parses a URL.
_REMOTES: dict[str, type[BlobRemote]] = {}
R = TypeVar("R", bound="BlobRemote")
T = TypeVar("T")

@dataclass(frozen=True)
class Uploaded:
    """What an upload did: true if it wrote the record.

    ``found`` is the record that was there before: the one replaced, or the one kept.
    ``refused``: why a record we would have replaced was kept all the same (the server
    cannot replace one safely); empty otherwise.
    """

    written: bool
    found: RecordState
    refused: str = ""

    def __bool__(self) -> bool:
        return self.written


@dataclass(frozen=True)
class Listed:
    """One record under the remote's prefix, as ``cachectl remote ls`` lists it: parsed
    (``record``, not yet trusted), or not (``problem`` says why: a torn write, garbage, a
    record of a format this version cannot read). ``size``: the record's own bytes."""

    key: str
    size: int
    record: Record | None = None
    problem: str = ""

    @property
    def state(self) -> str:
        """``malformed``, ``unsigned`` or ``signed`` (whether it verifies is the reader's
        business: a row is listed whatever key it is signed with)."""
        if self.record is None:
            return "malformed"
        return "signed" if self.record.sig else "unsigned"


# ``password=`` in a query (redis-py reads it there too), however it is cased.
_QUERY_SECRET = re.compile(r"[?&]password=", re.IGNORECASE)
# A user name shown as it is: plain ones only (a "user" that is really a password, or
# that holds part of one, is masked with the password).
_PLAIN_USER = re.compile(r"[A-Za-z0-9._-]{1,64}")
PASSWORD_VARS = (settings.REMOTE_PASSWORD.name, settings.REMOTE_PASSWORD_FILE.name)


def redact(url: str) -> str:
    """``url`` with its password masked, however malformed the rest of it is.

    The one function every remote URL goes through before it reaches a message, a log or
    an exception. String operations only (no parse that could fail or split the URL
    somewhere else): the credentials are everything between ``://`` and the URL's
    *last* ``@``, since a password may hold ``/``, ``#``, ``?`` and ``@``; a
    ``password=`` query value is masked to the end of the URL (its end cannot be trusted
    either). So an ``@`` anywhere else in a URL must be written ``%40``.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    head, at, tail = rest.rpartition("@")
    if at:
        if _QUERY_SECRET.search(head):
            return f"{scheme}{sep}***"  # the "@" may be inside a query's password
        user, colon, _ = head.partition(":")
        shown = f"{user}:***" if colon and _PLAIN_USER.fullmatch(user) else "***"
        rest = f"{shown}@{tail}"
    q = _QUERY_SECRET.search(rest)
    if q is not None:
        rest = rest[:q.end()] + "***"
    return f"{scheme}{sep}{rest}"


def _split_secret(url: str) -> tuple[str, str | None, str | None]:
    """(the URL without its credentials, user name, password): split where
    :func:`redact` masks, so that nothing a parse of the rest says can hold them. The
    user name and password are percent-decoded (a correctly encoded URL means what it
    did); a raw one is taken as it is."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, None, None
    head, at, tail = rest.rpartition("@")
    if not at:
        return url, None, None
    if _QUERY_SECRET.search(head):
        raise ValueError("an '@' after a password= parameter: percent-encode the password "
                         "(%40 for '@'), or put it in CACHECOMPILE_REMOTE_PASSWORD")
    user, colon, password = head.partition(":")
    return (f"{scheme}://{tail}", urllib.parse.unquote(user) or None,
            urllib.parse.unquote(password) if colon else None)


def _scrub(text: str, url: str) -> str:
    """``text`` without the credentials of ``url`` (raw or decoded), should a message
    quote them after all."""
    scheme, sep, rest = url.partition("://")
    head, at, _ = rest.rpartition("@")
    if not (sep and at):
        return text
    for secret in sorted({head, *head.split(":", 1), urllib.parse.unquote(head)},
                         key=len, reverse=True):
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def _password_from_env(env: Mapping[str, str]) -> str | None:
    """``CACHECOMPILE_REMOTE_PASSWORD``, or the first line of the file
    ``CACHECOMPILE_REMOTE_PASSWORD_FILE`` names (a mounted secret); not both."""
    value = settings.REMOTE_PASSWORD.get(env) or None
    path = settings.REMOTE_PASSWORD_FILE.get(env) or None
    if value is not None and path is not None:
        raise errors.RemoteConfigError(f"both {PASSWORD_VARS[0]} and {PASSWORD_VARS[1]} are "
                                       "set: keep one")
    if path is None:
        return value
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise errors.RemoteConfigError(f"{PASSWORD_VARS[1]}={path}: cannot read it ({why}); "
                                       "fix the path, or unset it") from None
    return text.rstrip("\r\n") or None


@dataclass(frozen=True)
class RemoteConfig:
    """Where the remote is and how to use it, parsed from its URL.

    ``redis://host:port/db``, ``rediss://``, ``unix://`` or ``s3://bucket/prefix`` (the
    endpoint, keys and region from the usual ``AWS_*`` variables). Our own query
    parameters are taken out before the URL reaches the client: ``mode=ro`` (consume,
    never publish), ``chunk=4M`` (Redis: value size; S3: multipart part size, at least
    5M), ``timeout=5`` (seconds: a stall; a whole request or command within about
    twice that, per tier: docs/remote.md), ``backoff=1`` (first retry delay), ``prefix``
    (Redis key prefix, ``cachecompile:v1``; on S3 the URL's path), ``lease=600`` (seconds
    an upload's pins hold off ``purge``).
    """

    url: str  # as given, with its password masked (:func:`redact`): safe to show
    target: str  # what the client is given: the URL without credentials or our parameters, or the bucket
    kind: str = "redis"
    readonly: bool = False
    chunk: int = DEFAULT_CHUNK
    timeout: float = 5.0
    backoff: float = 1.0
    max_backoff: float = 60.0
    prefix: str = "cachecompile:v1"
    lease: float = DEFAULT_LEASE
    extra: dict[str, str] = field(default_factory=dict)
    # The URL for logs, as the remote's class shows it (parse fills it in).
    shown: str = ""
    # The credentials, given to the client apart from the URL; never in a repr.
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str, env: Mapping[str, str] | None = None) -> RemoteConfig:
        """Parse a remote URL; RemoteConfigError (a ValueError) names what is wrong, with
        the password masked (``redis://:***@host``): it ends up in logs and terminals.

        The credentials are taken out (:func:`redact`'s rule) before anything parses the
        rest, so no parse error can quote them. The password may instead come from
        ``CACHECOMPILE_REMOTE_PASSWORD`` or ``CACHECOMPILE_REMOTE_PASSWORD_FILE`` (in
        ``env``, default the process's environment).
        """
        try:
            return cls._parse(url, os.environ if env is None else env)
        except (ValueError, TypeError) as e:  # RemoteConfigError included
            raise errors.RemoteConfigError(
                f"remote {redact(url)} (CACHECOMPILE_REMOTE or --remote): "
                f"{_scrub(str(e), url)}") from None

    @classmethod
    def _parse(cls, url: str, env: Mapping[str, str]) -> RemoteConfig:  # noqa: C901 (today's exception: one branch per remote URL form)
        public, username, password = _split_secret(url)
        parts = urllib.parse.urlsplit(public)
        remote = _REMOTES.get(parts.scheme)
        if remote is None:
            schemes = [f"{k}://" for k in _REMOTES]
            raise ValueError(f"only {', '.join(schemes[:-1])} and {schemes[-1]} URLs are "
                             "supported")
        if parts.fragment or "#" in public:
            raise ValueError("a '#' is no part of a remote URL (percent-encode it: %23)")
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        ours: dict[str, str] = {}
        rest: list[tuple[str, str]] = []
        for k, v in query:
            if k.lower() == "password":
                if password is not None:
                    raise ValueError("the password is given twice (before the '@' and as "
                                     "password=)")
                password = v
            elif k in _OURS:
                ours[k] = v
            else:
                rest.append((k, v))
        from_env = _password_from_env(env)
        if from_env is not None:
            if remote.credentials_elsewhere:
                raise errors.RemoteConfigError(
                    f"{' / '.join(PASSWORD_VARS)} is for Redis, HTTP and OCI registries; "
                    f"{remote.credentials_elsewhere}: unset it")
            if password is not None:
                raise errors.RemoteConfigError(
                    f"the password is given twice: in the URL and in {PASSWORD_VARS[0]} "
                    f"or {PASSWORD_VARS[1]}; keep one")
            password = from_env
        mode = ours.get("mode", "rw").lower()
        if mode not in ("rw", "ro"):
            raise ValueError(f"mode must be rw or ro, not {mode!r}")
        chunk = parse_size(ours["chunk"]) if "chunk" in ours else DEFAULT_CHUNK
        if not 0 < chunk <= MAX_CHUNK:
            raise ValueError("chunk must be between 1 byte and 64M")
        lease = float(ours.get("lease", DEFAULT_LEASE))
        if not lease >= 1 or not float(ours.get("timeout", 1)) > 0:
            raise ValueError("lease must be at least 1 second, and timeout over 0")
        target, prefix = remote.parse_url(parts, ours, rest,
                                          credentials=username is not None or password is not None)
        return cls(url=redact(url), target=target, kind=remote.kind, readonly=mode == "ro",
                   shown=redact(remote.display_of(target, prefix)),
                   chunk=chunk, timeout=float(ours.get("timeout", remote.default_timeout)),
                   backoff=float(ours.get("backoff", 1.0)), prefix=prefix, lease=lease,
                   username=username, password=password)

    @property
    def remote(self) -> type[BlobRemote]:
        """The class that serves this URL's scheme (RemoteConfigError if none does)."""
        for remote in _REMOTES.values():
            if remote.kind == self.kind:
                return remote
        raise errors.RemoteConfigError(f"no remote serves {self.kind!r} URLs")

    @property
    def display(self) -> str:
        """The URL without a password or parameters, for logs."""
        return self.shown or redact(self.target)


class Breaker:
    """Trips on a remote failure; lets one call through again after a growing backoff."""

    def __init__(self, name: str, backoff: float, max_backoff: float) -> None:
        self.name = name
        self.base = backoff
        self.max = max_backoff
        self.down_since: float | None = None
        self.retry_at = 0.0
        self.delay = backoff
        self.failures = 0
        # cachectl raises every failure to its user as one error line: no warning too.
        self.quiet = False
        self._warned = False
        self._lock = threading.Lock()
        # The clock the backoff runs on: a test moves it instead of sleeping.
        self.clock: Callable[[], float] = time.monotonic

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def allow(self) -> bool:
        with self._lock:
            return self.down_since is None or self.clock() >= self.retry_at

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            now = self.clock()
            if self.down_since is None:
                self.down_since = now
                self.delay = self.base
                if not self._warned and not self.quiet:
                    # One warning per process: a flapping remote must not flood the log.
                    self._warned = True
                    logger.warning("remote cache %s failed (%s: %s): continuing local-only; "
                                   "it is retried with backoff", self.name,
                                   type(exc).__name__, _first_line(exc))
                else:
                    logger.info("remote cache %s failed again (%s: %s)", self.name,
                                type(exc).__name__, _first_line(exc))
            else:
                self.delay = min(self.delay * 2, self.max)
            self.retry_at = now + self.delay
            logger.debug("remote cache %s: next try in %.1f s", self.name, self.delay)

    def ok(self) -> None:
        if self.down_since is None:
            return
        with self._lock:
            if self.down_since is not None:
                logger.info("remote cache %s is back after %.1f s", self.name,
                            self.clock() - self.down_since)
                self.down_since = None

    def reset_after_fork(self) -> None:
        """A forked child's breaker: closed, with a lock of its own (another thread may
        have held the parent's at the fork, and no thread would ever release it here).
        ``quiet`` and ``clock`` stay as they were set."""
        self._lock = threading.Lock()
        self.down_since = None
        self.retry_at = 0.0
        self.delay = self.base
        self.failures = 0
        self._warned = False

    def guard(self, what: str) -> None:
        """Raise the quick RemoteError of an open breaker."""
        if not self.allow():
            raise errors.RemoteError(f"remote cache {self.name} is unavailable (waiting "
                                     f"before the next try; {what} not sent)")


def _first_line(exc: BaseException) -> str:
    # Object-store clients put the whole HTTP exchange in their messages.
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


@runtime_checkable
class Remote(Protocol):
    """A remote tier: what the tiered store and ``cachectl``'s remote verbs use.

    Every method raises :class:`~cachecompile.store.errors.RemoteError` on a failure of
    the remote (the breaker has logged it); writes on a ``mode=ro`` remote raise
    ReadOnlyStoreError.
    """

    config: RemoteConfig
    trust: Trust
    breaker: Breaker

    @property
    def readonly(self) -> bool: ...

    @property
    def available(self) -> bool:
        """False while the breaker is open and its backoff has not elapsed (no network)."""
        ...

    def ping(self) -> bool: ...

    def contains(self, digest: str) -> bool: ...

    def record(self, digest: str) -> Record | None:
        """The parsed record of ``digest`` (not yet trusted), or None if absent."""
        ...

    def records(self) -> Iterator[Record]:
        """Every parsable record (unverified); malformed ones are logged and skipped."""
        ...

    def listing(self) -> Iterator[Listed]:
        """Every record, malformed ones included (``cachectl remote ls`` and ``purge``),
        each under its entry's digest, or, on a server that stores records under another
        name (HTTP), under that name where the record's bytes cannot prove its digest."""
        ...

    def download(self, digest: str, dest: Path,
                 progress: Callable[[int], None] | None = None) -> Record | None:
        """Fetch a trusted entry's files into ``dest`` (a fresh dir); None if absent.

        Raises UntrustedEntryError before any byte of a file is fetched if the record is
        not trusted; CorruptEntryError if a file is short, missing or fails its SHA-256.
        The caller discards ``dest`` on error.
        """
        ...

    def upload(self, entry: Entry, *, overwrite: bool = False, repair: bool = False,
               resign: bool = False,
               progress: Callable[[int], None] | None = None) -> Uploaded:
        """Publish a local entry unless the remote record should stay (:func:`may_replace`)."""
        ...

    def delete(self, digest: str) -> bool:
        """Remove the record of ``digest`` (an entry's digest, or the key :meth:`listing`
        gave a record that names no entry); its blobs go with the next :meth:`sweep`."""
        ...

    def sweep(self) -> int:
        """Delete blobs no record references and no upload has pinned; how many."""
        ...

    def info(self) -> dict[str, Any]:
        """What the server says about its space, for ``cachectl remote stats``."""
        ...

    def close(self) -> None: ...


def refuse_readonly(config: RemoteConfig) -> None:
    if config.readonly:
        raise errors.ReadOnlyStoreError(f"remote cache {config.display} is read-only (mode=ro)")


class BlobRemote(abc.ABC):
    """What every remote shares: its settings, trust, breaker, and the one upload and
    download flow. A server's module (redis.py, s3.py, file.py, http.py) implements the
    half that differs: the abstract methods below (its URL, its records and blobs, and
    the rest of :class:`Remote`: ping, contains, delete, sweep, info, close), so that a
    class that lacks one is refused when it is registered (:func:`register`), cannot be
    made, and fails mypy, rather than failing at its first call; and, if it holds a
    client a forked child must not share, :meth:`reset_client` (optional: nothing by
    default), and :meth:`replace_refused` where it cannot compare and set.

    ``tag`` is whatever the server compares a conditional write with: the record's bytes
    on Redis, file:// and HTTP (which cannot compare: it reads again), its ETag on S3.
    """

    kind = ""  # the RemoteConfig.kind it serves
    schemes: tuple[str, ...] = ()  # the URL schemes it parses (:func:`register`)
    default_timeout = 5.0  # seconds (what ``timeout=`` bounds is the server's business)
    # Where this server's credentials come from, if not from the URL or
    # CACHECOMPILE_REMOTE_PASSWORD(_FILE) (which it then refuses): a phrase for the error.
    credentials_elsewhere = ""
    default_prefix = "cachecompile"

    @classmethod
    def from_url(cls: type[R], url: str, trust: Trust | None = None) -> R:
        """The remote ``url`` names (RemoteConfigError if it is malformed or not one of
        this class's schemes); no network yet."""
        return cls(RemoteConfig.parse(url), trust)

    @classmethod
    @abc.abstractmethod
    def parse_url(cls, parts: urllib.parse.SplitResult, ours: Mapping[str, str],
                  rest: list[tuple[str, str]], *, credentials: bool) -> tuple[str, str]:
        """This server's half of parsing its URL: (the target its client is given, the
        prefix of its keys or objects). ``ours``: our own parameters (mode, chunk...),
        already checked; ``rest``: the others; ``credentials``: whether a user or
        password was given. ValueError says what is wrong (without the password: it
        was taken out before)."""

    @classmethod
    @abc.abstractmethod
    def display_of(cls, target: str, prefix: str) -> str:
        """The URL for logs, from what :meth:`parse_url` made of it (no parameters;
        :func:`redact` masks a password after)."""

    def __init__(self, config: RemoteConfig | str, trust: Trust | None = None) -> None:
        self.config = RemoteConfig.parse(config) if isinstance(config, str) else config
        if self.config.kind != self.kind:
            raise errors.RemoteConfigError(f"{self.config.display} is not a {self.kind} URL")
        self.trust = trust if trust is not None else Trust.from_env()
        self.breaker = Breaker(self.config.display, self.config.backoff, self.config.max_backoff)
        # Blobs this process downloaded and found damaged: an upload rewrites them instead
        # of trusting that they are stored (content addressing alone keeps bad bytes).
        self.bad_blobs: set[str] = set()
        # The process whose client this is: a forked child makes its own (forked()).
        self._pid = os.getpid()
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.display!r}, readonly={self.readonly})"

    @property
    def readonly(self) -> bool:
        return self.config.readonly

    @property
    def available(self) -> bool:
        """False while the breaker is open and its backoff has not elapsed (no network)."""
        self.forked()
        return self.breaker.allow()

    # -- forks ---------------------------------------------------------------------------
    def reset_client(self) -> None:
        """The hook a server's class overrides: forget the client this process inherited
        from the one that forked it, and any lock it is made under, so that the next call
        makes a new one here. Never close or use the inherited client: its sockets (and an
        S3 client's I/O runtime) are the parent's, still in use there. Runs in the child,
        with one thread, right after the fork."""
        return None  # optional: a server that holds no client has nothing to forget

    def forked(self) -> None:
        """Make this remote the current process's: in a forked child, a fresh breaker and
        (:meth:`reset_client`) a client of its own on the next call. Nothing in the
        process that made it. Run for every live remote by ``os.register_at_fork``, and by
        :meth:`guard` should a fork have skipped Python's hooks."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self.breaker.reset_after_fork()
        self.reset_client()
        logger.debug("remote cache %s: a new client in forked process %d",
                     self.config.display, self._pid)

    def guard(self, what: str) -> None:
        """What every remote call does first: make the remote this process's if it was
        forked (:meth:`forked`), then raise the quick RemoteError of an open breaker."""
        self.forked()
        self.breaker.guard(what)

    # -- the half that differs by server -------------------------------------------------
    def replace_refused(self) -> str:
        """Why this server may not have a record replaced (it cannot compare and set:
        a replacement would be a blind overwrite), or "" where it may. Asked only before
        a replacement, so nodes that never replace never pay for finding out."""
        return ""

    @abc.abstractmethod
    def read_record(self, digest: str) -> tuple[bytes, object] | None:
        """The raw record and its tag, or None if absent."""

    @abc.abstractmethod
    def raw_records(self) -> Iterator[tuple[str, bytes | None]]:
        """(digest, raw record) of every record under the prefix; None for one that went
        between the listing and its read. :meth:`records` and :meth:`listing` are built
        on it. A server whose record names are not digests (HTTP's ``/ac/`` hashes) gives
        a record whose bytes do not prove its digest under its own name."""

    @abc.abstractmethod
    def write_record(self, digest: str, data: bytes, tag: object | None, *,
                     blind: bool = False) -> bool:
        """Write the record if it is still the one tagged ``tag`` (None: still absent).

        ``blind``: the server cannot compare and set (:meth:`replace_refused`), and the
        caller has proven the record tagged ``tag`` malformed: write over it if it is
        still that record when read again just before (a window of one round trip in
        which another node's record would be overwritten; docs/remote.md). A server that
        compares and sets ignores it."""

    # Whether :meth:`stored_size` tells a blob's size on the server (file://, S3, HTTP).
    # Redis needs it not: a blob is whole once its marker is set, after its chunks.
    sizes_blobs = False

    def stored_size(self, sha: str) -> int | None:
        """The size of blob ``sha`` on the server; None where it has none."""
        raise NotImplementedError

    def put_blob(self, path: Path, sha: str,
                 progress: Callable[[int], None] | None = None) -> int:
        """Store the file ``path`` as blob ``sha`` (over what is there); its chunk size."""
        raise NotImplementedError

    def stored_whole(self, sha: str, size: int) -> int | None:
        """Blob ``sha``'s size on the server if it is there whole (``size`` bytes, and
        not found damaged by a download here), else None: a PUT cut short leaves part of
        a blob under its final name on a server that writes in place (WebDAV)."""
        if sha in self.bad_blobs:
            return None
        there = self.stored_size(sha)
        return there if there == size else None

    def heal_blobs(self, entry: Entry, raw: bytes) -> int:
        """Store again each blob the record ``raw`` found on the server references that
        ``entry`` holds and the server holds damaged (:meth:`stored_whole`). Blobs are
        named by their content, so the right bytes over them are safe whoever signed the
        record, and a fleet's entry is healed by the next node that publishes it. How many."""
        if not self.sizes_blobs:
            return 0
        try:
            wanted = set(parse_record(raw, entry.key).sha256.values())
        except errors.ManifestError:
            return 0
        healed = 0
        for name in sorted(entry.manifest["files"]):
            path = entry.files[name]
            sha, size = sha256_file(path), os.path.getsize(path)
            if sha in wanted and self.stored_whole(sha, size) is None:
                logger.warning("remote cache %s: blob %s of entry %s is damaged on the "
                               "server (not %d bytes): storing it again", self.config.display,
                               sha[:12], entry.key[:12], size)
                self.put_blob(path, sha)  # which forgets it was bad
                healed += 1
        return healed

    @abc.abstractmethod
    def put_blobs(self, entry: Entry, sha: dict[str, str],
                  progress: Callable[[int], None] | None) -> dict[str, int]:
        """Pin, then store every blob of ``entry`` the remote lacks (``sha``: file ->
        SHA-256); each blob's chunk size for the record."""

    def recheck_blobs(self, entry: Entry, sha: dict[str, str]) -> None:
        """After the record is written: store again any blob a purge (or the server's
        eviction) took meanwhile. S3 and file:// cannot check a pin and delete in one step:
        a purge that read our pin's absence just before we pinned may have taken a blob we
        reused. (Redis's sweep script never deletes a pinned blob: nothing to do.)"""
        for n in sorted(sha) if self.sizes_blobs else ():
            if self.stored_size(s := sha[n]) is None:
                logger.info("blob %s of %s went while we uploaded: storing it again", s[:12],
                            entry.key[:12])
                self.put_blob(entry.files[n], s)

    @abc.abstractmethod
    def fetch_blob(self, digest: str, name: str, sha: str, size: int, chunk: int,
                   target: Path, mode: int,
                   progress: Callable[[int], None] | None) -> tuple[int, str]:
        """Stream one blob into ``target`` (a new file); (bytes, SHA-256 hex)."""

    # -- the rest of Remote, by server ----------------------------------------------------
    @abc.abstractmethod
    def ping(self) -> bool: ...

    @abc.abstractmethod
    def contains(self, digest: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, digest: str) -> bool:
        """Remove the record of ``digest`` (:meth:`Remote.delete`)."""

    @abc.abstractmethod
    def sweep(self) -> int:
        """Delete blobs no record references and no upload has pinned; how many."""

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """What the server says about its space, for ``cachectl remote stats``."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # -- the shared flow -----------------------------------------------------------------
    def record(self, digest: str) -> Record | None:
        """The parsed record of ``digest`` (not yet trusted), or None if absent."""
        got = self.read_record(digest)
        return None if got is None else parse_record(got[0], digest)

    def records(self) -> Iterator[Record]:
        """Every parsable record (unverified); malformed ones are logged and skipped."""
        return parse_records(self.raw_records())

    def listing(self) -> Iterator[Listed]:
        """Every record, malformed ones included, each parsed once (not yet trusted)."""
        for digest, raw in self.raw_records():
            if raw is None:
                continue
            try:
                yield Listed(digest, len(raw), parse_record(raw, digest))
            except errors.ManifestError as e:
                yield Listed(digest, len(raw), None, str(e))

    def upload(self, entry: Entry, *, overwrite: bool = False, repair: bool = False,
               resign: bool = False,
               progress: Callable[[int], None] | None = None) -> Uploaded:
        """The one upload: judge the record there, store the blobs, write the record last,
        and only if it is still the one judged (else judge again, :data:`CAS_TRIES` times)."""
        try:
            return self._upload_entry(entry, overwrite, repair, resign, progress)
        finally:  # an upload that ended, however, holds its blobs no more
            self.release_pins()

    def release_pins(self) -> None:
        """Drop the pins this thread's upload took (file://); a crashed one's expire."""
        return None  # optional: a server without pins, or whose pins expire, has none

    def _upload_entry(self, entry: Entry, overwrite: bool, repair: bool, resign: bool,
                      progress: Callable[[int], None] | None) -> Uploaded:
        refuse_readonly(self.config)
        digest = entry.key
        got = self.read_record(digest)
        raw, tag = got if got is not None else (None, None)
        found = record_state(self.trust, digest, raw)
        judge = dict(overwrite=overwrite, repair=repair, resign=resign)
        if not may_replace(self.trust, found, **judge):
            self._kept(digest, found)
            if raw is not None:
                self.heal_blobs(entry, raw)
            return Uploaded(False, found)
        blind = False
        if tag is not None and (why := self.replace_refused()):
            if not self._may_write_blind(found, repair):
                logger.info("not replacing remote entry %s (%s): %s", digest, found, why)
                if raw is not None:
                    self.heal_blobs(entry, raw)
                return Uploaded(False, found, why)
            blind = True
        names = sorted(entry.manifest["files"])
        sha = {n: sha256_file(entry.files[n]) for n in names}
        executable = [n for n in names if os.stat(entry.files[n]).st_mode & stat.S_IXUSR]
        chunks = self.put_blobs(entry, sha, progress)
        rec = make_record(entry.manifest, sha,
                          {s: chunks[s] for s in sorted(set(sha.values()))}, self.trust,
                          executable)
        data = rec.to_bytes()
        for _ in range(CAS_TRIES):
            if self.write_record(digest, data, tag, blind=blind):
                self.recheck_blobs(entry, sha)
                logger.debug("uploaded %s (%d files, replacing: %s)", digest, len(names), found)
                return Uploaded(True, found)
            # Another node wrote the record since we looked: judge what is there now.
            got = self.read_record(digest)
            raw, tag = got if got is not None else (None, None)
            found = record_state(self.trust, digest, raw)
            if not may_replace(self.trust, found, **judge):
                self._kept(digest, found)
                return Uploaded(False, found)
            blind = False
            if tag is not None and (why := self.replace_refused()):
                if not self._may_write_blind(found, repair):
                    logger.info("not replacing remote entry %s (%s): %s", digest, found, why)
                    return Uploaded(False, found, why)
                blind = True
        raise errors.RemoteError(f"remote cache {self.config.display}: the record of {digest} "
                                 f"changed {CAS_TRIES} times while we wrote it")

    def download(self, digest: str, dest: Path,
                 progress: Callable[[int], None] | None = None) -> Record | None:
        """The one download (see :meth:`Remote.download`)."""
        got = self.read_record(digest)
        if got is None:
            return None
        rec = parse_record(got[0], digest)
        self.trust.check(rec.body, rec.sig, digest)
        for name, frec in rec.manifest["files"].items():
            sha = rec.sha256[name]
            size = int(frec["size"])
            chunk = rec.chunks.get(sha)
            if chunk is None and size:
                raise errors.CorruptEntryError(digest, f"record has no chunk size for {name!r}")
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                n, actual = self.fetch_blob(digest, name, sha, size, chunk or 1, target,
                                            0o700 if name in rec.executable else 0o600,
                                            progress)
            except errors.CorruptEntryError:
                self.bad_blobs.add(sha)
                raise
            if n != size or actual != sha:
                self.bad_blobs.add(sha)
                raise errors.CorruptEntryError(digest, f"file {name!r} fails its SHA-256 "
                                                       f"({n} of {size} bytes)")
        return rec

    def referenced_blobs(self) -> set[str]:
        """The SHA-256 of every blob a parsable record references (what a sweep keeps)."""
        return {s for rec in self.records() for s in rec.sha256.values()}

    def _may_write_blind(self, found: RecordState, repair: bool) -> bool:
        """Whether a server that cannot compare and set may have this record written
        over all the same: only one no node can load (malformed), and only by a keyed
        repair (``cachectl push`` with the fleet's key, an operator's act), never by a
        serving node's background upload. The window it leaves is
        :meth:`write_record`'s."""
        return found == "malformed" and repair and self.trust.key is not None

    def _kept(self, digest: str, found: RecordState) -> None:
        if found == "foreign":
            logger.info("not replacing remote entry %s: it is signed, and not with %s",
                        digest, "our key" if self.trust.key else "a key we have")
        else:
            logger.debug("remote has %s already (%s)", digest, found)


def parse_records(raws: Iterator[tuple[str, bytes | None]]) -> Iterator[Record]:
    """Records from (digest, raw) pairs; malformed ones are logged and skipped."""
    for digest, raw in raws:
        if raw is None:
            continue
        try:
            yield parse_record(raw, digest)
        except errors.ManifestError as e:
            logger.warning("remote entry %s is malformed: %s", digest, e)


# Every remote this process made (weakly: a closed store's remote goes): a forked child
# makes each one its own before anything else runs in it.
_LIVE: weakref.WeakSet[BlobRemote] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for remote in list(_LIVE):
        remote.forked()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere there is no fork to survive
    os.register_at_fork(after_in_child=_after_fork_in_child)


def register(cls: type[R]) -> type[R]:
    """Register a remote class for its :attr:`~BlobRemote.schemes` (a class decorator).
    A class that leaves a hook of :class:`BlobRemote` abstract is refused here, when its
    module is imported, rather than at its first call."""
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise TypeError(f"{cls.__name__} does not implement {missing} (BlobRemote's hooks)")
    for scheme in cls.schemes:
        if _REMOTES.get(scheme, cls) is not cls:
            raise ValueError(f"{scheme}:// is served by {_REMOTES[scheme].__name__} already")
        _REMOTES[scheme] = cls
    return cls


# Where one level's URL ends and the next begins in a chain: a comma before a scheme. A
# comma elsewhere (in a password, a query value) stays in its URL.
_NEXT_LEVEL = re.compile(r",\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def split_levels(url: str) -> list[str]:
    """The levels of ``CACHECOMPILE_REMOTE="file:///mnt/cc,s3://bucket/p"``, nearest
    first (one URL is a chain of one)."""
    return [u.strip() for u in _NEXT_LEVEL.split(url.strip()) if u.strip()]


def open_levels(url: str, trust: Trust | None = None) -> list[Remote]:
    """Every level of a chain, nearest first (RemoteConfigError names the level that is
    malformed); no network yet."""
    levels = split_levels(url)
    if not levels:
        raise errors.RemoteConfigError("CACHECOMPILE_REMOTE or --remote names no remote")
    shown = [RemoteConfig.parse(u).display for u in levels]
    if len(set(shown)) != len(shown):
        raise errors.RemoteConfigError(f"remote chain {', '.join(shown)}: a level is named "
                                       "twice")
    return [open_remote(u, trust) for u in levels]


def open_remote(url: str | RemoteConfig, trust: Trust | None = None) -> Remote:
    """The remote a URL names (RemoteConfigError if it is malformed, or a chain of
    several levels: :func:`open_levels` opens those); no network yet."""
    if isinstance(url, str) and len(split_levels(url)) > 1:
        raise errors.RemoteConfigError(
            f"remote {redact(url)} is a chain of {len(split_levels(url))} levels; name one "
            "level here (--remote URL)")
    config = RemoteConfig.parse(url) if isinstance(url, str) else url
    return config.remote(config, trust)
