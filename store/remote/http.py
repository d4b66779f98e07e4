"""The HTTP tier: a :class:`~cachecompile.store.remote.base.Remote` over a build-cache HTTP
server in bazel-remote's layout, the one ccache's and sccache's HTTP/WebDAV backends and
Gradle's HTTP cache speak: bazel-remote itself, nginx with its WebDAV module, WsgiDAV,
Apache mod_dav, Artifactory...

``CACHECOMPILE_REMOTE=http://host[:port]/prefix`` (or ``https://``). Under the prefix::

    /ac/<sha256("cachecompile-v1:" + digest)>    the record (cachecompile.store.signing)
    /cas/<sha256 of the file's bytes>            one file's bytes

Both are plain ``GET``, ``PUT`` and ``HEAD``; the record's name is a SHA-256 of our entry
digest (bazel-remote takes 64 hex digits there, and the name space keeps us apart from
ccache or Bazel entries on the same server); a blob's name is the SHA-256 of its bytes,
which bazel-remote checks on every PUT. A server that stores a PUT whole before it
serves it (nginx's WebDAV writes a temp file and renames it) shows every file whole or
not at all; one that does not (WsgiDAV writes in place) may show a half-written file for
a moment, which a reader refuses by its SHA-256 (a miss), as it refuses any damage.

Answers, as Gradle's HTTP cache reads them: a GET or HEAD is 200 (there) or 404 (not
there); a PUT is 2xx (stored) or 413 (too large: this file is not shared, and nothing
else changes). Any other answer, or a request without its whole answer within
``timeout`` (:mod:`.watchdog`; a blob's body: each read within it), is a failure of the
remote: one warning, then the breaker keeps the process local-only (retrying after 1 s,
doubling to 60 s), as on every other tier.

What HTTP cannot do: compare-and-set. A record is created (a HEAD, then a PUT with
``If-None-Match: *``, which a WebDAV server answers with 412 where one is there) and never
replaced, so an unsigned or stale record stays until ``cachectl remote purge`` deletes it
(a WebDAV ``DELETE``). The one exception is a record no node can load (malformed), which
a keyed ``cachectl push`` writes over (``write_record(blind=True)``): it GETs the record
again just before a plain PUT and writes only if the bytes are still those it judged,
which leaves a window of one round trip (docs/remote.md, "Repairing records"). A
malformed record is listed under its entry's digest when the digest can be proven from
its bytes (a 32-digit hex string in it whose ``/ac/`` name is the record's own), else
under its ``/ac/`` name (64 digits), which ``delete`` also takes. Listing (``cachectl remote ls``, ``stats``, ``purge``, ``pull``
without keys) uses WebDAV's ``PROPFIND``: nginx needs its dav-ext module for it, WsgiDAV
has it, bazel-remote has none (it evicts by itself, LRU). There are no pins: the sweep
deletes only blobs older than ``lease`` that no record references, and an upload checks
its blobs again after writing its record, storing any a sweep took meanwhile.

Credentials: ``https://user:password@host/prefix`` or the user in the URL and the
password in ``CACHECOMPILE_REMOTE_PASSWORD`` / ``_FILE`` go as HTTP Basic; a password with
no user name goes as a bearer token (``Authorization: Bearer``). They are sent only in
that header and never appear in a URL we build, a message or a log. Standard library
only (http.client): one keep-alive connection per thread, made again in a forked child.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import logging
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from .. import errors
from ..fsutil import write_new_file
from ..outcomes import Entry
from ..signing import Trust
from . import watchdog
from .base import BlobRemote, RemoteConfig, refuse_readonly, register
from .received import Received

logger = logging.getLogger(__name__)

__all__ = ["HttpRemote", "ac_name", "netloc_of"]

_AC_SPACE = "cachecompile-v1:"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HREF = re.compile(r"<(?:[A-Za-z0-9_-]+:)?href>\s*([^<]*?)\s*</(?:[A-Za-z0-9_-]+:)?href>")
_RESPONSE = re.compile(r"<(?:[A-Za-z0-9_-]+:)?response\b.*?</(?:[A-Za-z0-9_-]+:)?response>",
                       re.DOTALL)
_MODIFIED = re.compile(r"<(?:[A-Za-z0-9_-]+:)?getlastmodified>([^<]*)<")
_LENGTH = re.compile(r"<(?:[A-Za-z0-9_-]+:)?getcontentlength>\s*(\d+)\s*<")
_PROPFIND = (b'<?xml version="1.0" encoding="utf-8"?><D:propfind xmlns:D="DAV:"><D:prop>'
             b"<D:getlastmodified/><D:getcontentlength/></D:prop></D:propfind>")
_MAX_RECORD = 64 * 1024**2
_MAX_LISTING = 256 * 1024**2
# A keep-alive connection the server closed while idle fails the next request at once:
# that request is sent again, once, on a new connection.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
          http.client.CannotSendRequest, http.client.ResponseNotReady)


def ac_name(digest: str) -> str:
    """The ``/ac/`` name of an entry's record."""
    return hashlib.sha256((_AC_SPACE + digest).encode("ascii")).hexdigest()


class _Status(Exception):
    """An answer outside the rules (see the module docstring)."""

    def __init__(self, method: str, what: str, status: int, reason: str) -> None:
        super().__init__(f"{what}: {method} answered {status} {reason}".rstrip())
        self.status = status


@register
class HttpRemote(BlobRemote):
    """One HTTP cache and prefix: the half of
    :class:`~cachecompile.store.remote.base.BlobRemote` that differs by server, over
    ``/ac/`` and ``/cas/`` (see the module docstring)."""

    kind = "http"
    schemes: tuple[str, ...] = ("http", "https")
    default_timeout = 5.0  # seconds of a stall (connect: at most 2)
    default_prefix = ""

    @classmethod
    def parse_url(cls, parts: urllib.parse.SplitResult, ours: Mapping[str, str],
                  rest: list[tuple[str, str]], *, credentials: bool) -> tuple[str, str]:
        if rest:
            raise ValueError(f"unknown parameters {sorted(k for k, _ in rest)} (http:// "
                             "takes mode, chunk, timeout, backoff and lease)")
        if not parts.hostname:
            raise ValueError(f"{parts.scheme}:// takes a host: {parts.scheme}://host[:port]/prefix")
        if "prefix" in ours:
            raise ValueError(f"on {parts.scheme}:// the prefix is the URL's path")
        netloc = netloc_of(parts)
        prefix = "/".join(p for p in parts.path.split("/") if p)
        if any(p in (".", "..") for p in prefix.split("/")):
            raise ValueError("the prefix may not hold '.' or '..'")
        return f"{parts.scheme}://{netloc}", prefix

    @classmethod
    def display_of(cls, target: str, prefix: str) -> str:
        return f"{target}/{prefix}" if prefix else target

    def __init__(self, config: RemoteConfig | str, trust: Trust | None = None) -> None:
        super().__init__(config, trust)
        target = urllib.parse.urlsplit(self.config.target)
        self._https = target.scheme == "https"
        self._host = target.hostname or ""
        self._port = target.port
        self._base = "/" + (urllib.parse.quote(self.config.prefix) + "/"
                            if self.config.prefix else "")
        self._auth = _authorization(self.config.username, self.config.password)
        self._local = threading.local()
        self._ssl: ssl.SSLContext | None = None

    # -- plumbing ----------------------------------------------------------------------
    def reset_client(self) -> None:
        # The connections of the process that made them are not the child's (a socket
        # shared by two processes interleaves their requests): the child starts with
        # none. Dropped, not closed: the forking thread's connection is still the
        # parent's, and dropping it only closes this process's copy of the descriptor.
        self._local = threading.local()

    def _conn(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and fresh:
            conn.close()
            conn = None
        if conn is None:
            t = self.config.timeout
            if self._https:
                if self._ssl is None:
                    self._ssl = ssl.create_default_context()  # SSL_CERT_FILE is honoured
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=t,
                                                   context=self._ssl)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=t)
            self._local.conn = conn
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def _url(self, kind: str, name: str = "") -> str:
        return f"{self._base}{kind}/{name}"

    def _send(self, method: str, path: str, body: Any = None,
              headers: Mapping[str, str] | None = None) -> http.client.HTTPResponse:
        """One request on this thread's connection (sent again once on a new connection
        if the kept-alive one had been closed); the response, body unread."""
        hdrs = {"User-Agent": "cachecompile", **(headers or {})}
        if self._auth:
            hdrs["Authorization"] = self._auth
        for attempt in (0, 1):
            conn = self._conn(fresh=attempt > 0)
            # Connecting waits at most 2 s; a stall after that, ``timeout``.
            conn.timeout = min(self.config.timeout, 2.0) if conn.sock is None else conn.timeout
            try:
                if conn.sock is None:
                    conn.connect()
                    conn.sock.settimeout(self.config.timeout)  # type: ignore[attr-defined]
                box = getattr(self._local, "box", None)
                if box is not None:  # what the request's deadline shuts down (the response
                    box[0] = conn.sock  # keeps the socket where the connection lets it go)
                if hasattr(body, "seek"):
                    body.seek(0)
                conn.request(method, path, body=body, headers=hdrs)
                return conn.getresponse()
            except _STALE:
                self._drop()
                if attempt:
                    raise
            except BaseException:
                self._drop()
                raise
        raise AssertionError("unreachable")

    def _call(self, what: str, fn: Callable[[], Any], *, bounded: bool = True) -> Any:
        """``fn()`` with the breaker: a transport error or an answer outside the rules
        (:class:`_Status`) trips it, with one warning, and is a RemoteError. ``bounded``:
        the whole request within ``timeout`` (a trickling server's socket is shut down
        then); a blob's body is bounded by stalls only (each read within ``timeout``)."""
        self.guard(what)
        box: list[socket.socket | None] = [None]   # the request's socket
        self._local.box = box
        ticket = watchdog.start(self.config.timeout, lambda: _shut(box[0])) if bounded else None
        try:
            out = fn()
            if ticket is not None and ticket.fired:  # what was read is cut short
                raise TimeoutError(what)
        except (errors.CorruptEntryError, errors.UntrustedEntryError):
            self.breaker.ok()
            raise
        except (_Status, OSError, http.client.HTTPException, ValueError) as e:
            self._drop()
            detail = (f"{what}: no whole answer in {self.config.timeout:g} s"
                      if ticket is not None and ticket.fired else
                      str(e) if isinstance(e, _Status) else
                      f"{what} failed: {type(e).__name__}: {e}")
            if isinstance(e, ssl.SSLError) and "WRONG_VERSION_NUMBER" in str(e):
                detail += " (the server speaks plain HTTP: name it http:// or oci+http://)"
            err = errors.RemoteError(f"remote cache {self.config.display}: {detail}")
            self.breaker.failed(err)
            raise err from None
        finally:
            self._local.box = None
            if ticket is not None:
                ticket.cancel()
        self.breaker.ok()
        return out

    def _small(self, method: str, kind: str, name: str, what: str) -> bytes | None:
        """GET (or HEAD) a small object: its bytes (b"" for HEAD), None on 404."""

        def go() -> bytes | None:
            r = self._send(method, self._url(kind, name))
            with _closing(r):
                if r.status != 200:
                    if r.status == 404:
                        r.read()  # drained: the connection serves the next request
                        return None
                    raise _Status(method, what, r.status, r.reason)
                if method == "HEAD":
                    r.read()
                    return str(r.getheader("Content-Length") or "").encode()
                data = r.read(_MAX_RECORD + 1)
                if len(data) > _MAX_RECORD:
                    raise errors.CorruptEntryError(name[:32], "the record is far too big")
                length = r.getheader("Content-Length") or ""
                if length.isdigit() and len(data) < int(length):
                    # The transfer was cut short: the tier's fault, not a damaged entry.
                    raise http.client.IncompleteRead(data, int(length) - len(data))
                return data

        got = self._call(what, go)
        return None if got is None else bytes(got)

    def _put(self, kind: str, name: str, body: Any, size: int, what: str,
             headers: Mapping[str, str] | None = None) -> int:
        """PUT: its status if 2xx, 412 or 413 (the caller decides); else a failure."""

        def put() -> int:
            r = self._send("PUT", self._url(kind, name), body,
                           {"Content-Length": str(size),
                            "Content-Type": "application/octet-stream", **(headers or {})})
            with _closing(r):
                r.read()
                return int(r.status)

        def go() -> int:
            status = put()
            if status == 409:
                # WebDAV: the collection is not there yet (nginx makes it itself with
                # create_full_put_path; WsgiDAV, Apache want a MKCOL first).
                self._make_collections(kind)
                status = put()
            if 200 <= status < 300 or status in (412, 413):
                return status
            raise _Status("PUT", what, status, http.client.responses.get(status, ""))

        # A blob's body may take longer than ``timeout`` to send: bounded by stalls.
        return int(self._call(what, go, bounded=kind != "cas"))

    def _make_collections(self, kind: str) -> None:
        """MKCOL the prefix's folders and ``kind/``, top down (405: there already)."""
        parts = [p for p in self._base.split("/") if p] + [kind]
        for i in range(1, len(parts) + 1):
            r = self._send("MKCOL", "/" + "/".join(parts[:i]) + "/")
            with _closing(r):
                r.read()
                if not (200 <= r.status < 300 or r.status in (405, 409)):
                    raise _Status("MKCOL", f"make the collection {kind}/", r.status, r.reason)

    # -- reads ---------------------------------------------------------------------------
    def ping(self) -> bool:
        # A record that is never written: 404 (or 200) says the server answers by the rules.
        self._small("HEAD", "ac", "0" * 64, "check the server")
        return True

    def contains(self, digest: str) -> bool:
        return self._small("HEAD", "ac", ac_name(digest), "head record") is not None

    def read_record(self, digest: str) -> tuple[bytes, object] | None:
        raw = self._small("GET", "ac", ac_name(digest), "get record")
        return None if raw is None else (raw, raw)

    def fetch_blob(self, digest: str, name: str, sha: str, size: int, chunk: int,
                   target: Path, mode: int,
                   progress: Callable[[int], None] | None) -> tuple[int, str]:
        if not _HEX64.fullmatch(sha):
            raise errors.CorruptEntryError(digest, f"{name!r} has no valid SHA-256")
        resp, own = self._call("get blob", lambda: self._open_blob(sha))
        if resp is None:
            raise errors.CorruptEntryError(digest, f"the blob of {name!r} is gone")
        got = Received(progress)
        try:
            with _closing(resp):
                write_new_file(target, got.passing(self._body(resp, self.config.chunk)), mode)
        except BaseException:
            if not own:
                self._drop()  # the body was not read to its end: the connection is spent
            raise
        finally:
            if own:
                resp.close()
        return got.result

    def _open_blob(self, sha: str) -> tuple[http.client.HTTPResponse | None, bool]:
        """(the response whose body is blob ``sha``, None if it is not there; whether it is
        on a connection of its own, not this thread's kept-alive one: a redirect's,
        :meth:`_redirected`)."""
        r = self._send("GET", self._url("cas", sha))
        moved = self._redirected(r)
        if moved is not None:
            return moved, True
        if r.status == 404:
            with _closing(r):
                r.read()
            return None, False
        if r.status != 200:
            with _closing(r):
                raise _Status("GET", "get blob", r.status, r.reason)
        return r, False

    def _redirected(self, r: http.client.HTTPResponse) -> http.client.HTTPResponse | None:
        """Where a server that redirects blob downloads sent this one (its response, on a
        connection of its own); None for an answer that is no redirect. An HTTP cache
        does not redirect: a 3xx is an answer outside the rules."""
        return None

    def _body(self, resp: http.client.HTTPResponse, chunk: int) -> Iterator[bytes]:
        """A response's body, chunk by chunk, each read within ``timeout`` (a stall)."""
        while data := self._call("read blob", lambda: resp.read(chunk), bounded=False):
            yield data

    def _listing(self, kind: str) -> list[tuple[str, float, int]]:
        """(name, Last-Modified, size) of every file under ``kind/``, by PROPFIND."""

        def go() -> list[tuple[str, float, int]]:
            r = self._send("PROPFIND", self._url(kind),
                           _PROPFIND, {"Depth": "1", "Content-Type": "application/xml"})
            with _closing(r):
                if r.status == 404:
                    r.read()
                    return []  # nothing was ever stored there
                if r.status != 207:
                    raise _Status("PROPFIND", f"list {kind} (WebDAV PROPFIND: listing needs "
                                  "a WebDAV server; nginx needs its dav-ext module)",
                                  r.status, r.reason)
                text = r.read(_MAX_LISTING).decode("utf-8", "replace")
            out = []
            for block in _RESPONSE.findall(text):
                href = _HREF.search(block)
                if href is None:
                    continue
                name = urllib.parse.unquote(href.group(1)).rstrip("/").rsplit("/", 1)[-1]
                if not _HEX64.fullmatch(name):
                    continue
                when = _MODIFIED.search(block)
                length = _LENGTH.search(block)
                try:
                    stamp = parsedate_to_datetime(when.group(1)).timestamp() if when else 0.0
                except (TypeError, ValueError):
                    stamp = 0.0
                out.append((name, stamp, int(length.group(1)) if length else 0))
            return out

        return list(self._call(f"list {kind}", go))

    def raw_records(self) -> Iterator[tuple[str, bytes | None]]:
        """(digest, raw) of every record; a record whose digest its bytes cannot prove
        (garbage, a torn write that lost it, a record copied under another entry's name)
        comes under its ``/ac/`` name: a row that ``cachectl remote ls`` shows as
        malformed, and that :meth:`delete` removes."""
        for name in [n for n, _, _ in self._listing("ac")]:
            raw = self._small("GET", "ac", name, "get record")
            if raw is not None:
                yield _digest_in(raw, name) or name, raw

    def info(self) -> dict[str, Any]:
        blobs = self._listing("cas")
        return {"objects": len(blobs), "stored_bytes": sum(s for _, _, s in blobs)}

    # -- writes --------------------------------------------------------------------------
    def replace_refused(self) -> str:
        return ("an HTTP cache cannot compare and set, so a record on it is never replaced "
                "but a malformed one by a keyed `cachectl push` (cachectl remote purge "
                "deletes it)")

    def write_record(self, digest: str, data: bytes, tag: object | None, *,
                     blind: bool = False) -> bool:
        if tag is not None:
            if not blind:
                return False  # never replaced (replace_refused): judge again, and keep it
            # A record the caller proved malformed: written over only if it is still those
            # very bytes when read again just now (HTTP has no compare-and-set: a window of
            # one round trip, docs/remote.md). Else judge again.
            now = self.read_record(digest)
            if now is None or now[0] != tag:
                return False
            status = self._put("ac", ac_name(digest), data, len(data), "replace record")
            if status == 413:
                raise errors.StoreError(f"remote cache {self.config.display}: the record of "
                                        f"{digest} is too large for the server (413)")
            return 200 <= status < 300
        if self.contains(digest):
            return False
        status = self._put("ac", ac_name(digest), data, len(data), "put record",
                           {"If-None-Match": "*"})
        if status == 413:
            raise errors.StoreError(f"remote cache {self.config.display}: the record of "
                                    f"{digest} is too large for the server (413)")
        if status == 412:
            # Another node's record, or ours: a PUT whose answer was lost on a closed
            # keep-alive connection is sent again, and then finds itself there.
            got = self.read_record(digest)
            return got is not None and got[0] == data
        return True

    def put_blobs(self, entry: Entry, sha: dict[str, str],
                  progress: Callable[[int], None] | None) -> dict[str, int]:
        chunks: dict[str, int] = {}
        sizes = {sha[n]: os.path.getsize(entry.files[n]) for n in sha}
        for s in sorted(set(sha.values())):
            size = self.stored_whole(s, sizes[s])
            if size is not None:
                chunks[s] = max(size, 1)  # dedup: stored already, whole
        for n in sorted(sha):
            s = sha[n]
            if s not in chunks:
                chunks[s] = self.put_blob(entry.files[n], s, progress)
        return chunks

    sizes_blobs = True

    def stored_size(self, sha: str) -> int | None:
        there = self._small("HEAD", "cas", sha, "head blob")
        # A server that names no length (chunked) cannot show a blob whole: stored again.
        return None if there is None or not there.isdigit() else int(there)

    def put_blob(self, path: Path, sha: str,
                 progress: Callable[[int], None] | None = None) -> int:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            status = self._put("cas", sha, f, size, "put blob")
        if status == 413:
            # Gradle's rule: too large for this server is no failure of the remote (the
            # breaker stays closed): this entry is not shared, the next may be.
            raise errors.StoreError(f"remote cache {self.config.display}: a file of {size} "
                                    "bytes is too large for the server (413): entry not shared")
        if progress is not None:
            progress(size)
        self.bad_blobs.discard(sha)
        return max(size, 1)

    def delete(self, digest: str) -> bool:
        """Remove the record of ``digest``, or the record stored under the ``/ac/`` name
        ``digest`` (64 digits: a malformed record :meth:`raw_records` could not name)."""
        refuse_readonly(self.config)
        name = digest if _HEX64.fullmatch(digest) else ac_name(digest)
        return self._delete("ac", name, "delete record")

    def _delete(self, kind: str, name: str, what: str) -> bool:
        def go() -> bool:
            r = self._send("DELETE", self._url(kind, name))
            with _closing(r):
                r.read()
                if r.status == 404:
                    return False
                if 200 <= r.status < 300:
                    return True
                raise _Status("DELETE", what, r.status, r.reason)

        return bool(self._call(what, go))

    def sweep(self) -> int:
        """Delete blobs no record references that are older than ``lease`` (there are no
        pins on HTTP; an upload's recheck stores again any blob it lost)."""
        refuse_readonly(self.config)
        blobs = self._listing("cas")
        used = self.referenced_blobs()
        now = time.time()
        deleted = 0
        for name, stamp, _ in blobs:
            if name not in used and now - stamp >= self.config.lease:
                deleted += self._delete("cas", name, "delete blob")
        return deleted

    def close(self) -> None:
        self._drop()


def netloc_of(parts: urllib.parse.SplitResult) -> str:
    """``host[:port]`` of a URL without its credentials (an IPv6 host in brackets)."""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port}" if parts.port else host


class _closing:
    """Close a response on the way out of a ``with`` (an error midway included)."""

    def __init__(self, r: http.client.HTTPResponse) -> None:
        self.r = r

    def __enter__(self) -> http.client.HTTPResponse:
        return self.r

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.r.close()


def _authorization(user: str | None, password: str | None) -> str:
    """The Authorization header's value: Basic with a user, Bearer with a password alone."""
    if password is None and user is None:
        return ""
    if user is None:
        return f"Bearer {password}"
    token = base64.b64encode(f"{user}:{password or ''}".encode()).decode("ascii")
    return f"Basic {token}"


# An entry digest as a record's JSON writes it (its body's "key", the manifest's...).
_DIGEST_TEXT = re.compile(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")


def _digest_in(raw: bytes, name: str) -> str | None:
    """The digest of the entry whose record is stored as ``/ac/<name>``, proven from the
    record's bytes: a 32-digit hex string in it whose ``/ac/`` name is ``name`` (a torn
    record keeps its digest as long as one copy of it survived); None if none is."""
    seen: set[bytes] = set()
    for m in _DIGEST_TEXT.finditer(raw):
        text = m.group()
        if text in seen:
            continue
        seen.add(text)
        digest = text.decode("ascii")
        if ac_name(digest) == name:
            return digest
    return None


def _shut(sock: socket.socket | None) -> None:
    """Stop a request whose deadline passed: its socket shut down, the blocked read ends
    (the connection is dropped by the request, which sees a failure)."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
