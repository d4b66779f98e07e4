"""The OCI registry tier: a :class:`~cachecompile.store.remote.base.Remote` over any registry
that speaks the OCI distribution spec (distribution/``registry:2``, Harbor, Zot, ECR, GCR,
ACR, Artifactory...): the registries a Kubernetes fleet already runs, with their auth,
replication and garbage collection.

``CACHECOMPILE_REMOTE=oci://registry.example.com/team/compile-cache`` (HTTPS), or
``oci+http://host:port/repo`` for a registry on plain HTTP. As Docker does, ``oci://`` to a
loopback host (``localhost``, ``127.0.0.1``, ``::1``) speaks plain HTTP; ``oci+https://``
forces TLS there too. Under the repository, an entry is one manifest tagged
``cc-<digest>`` whose config is the signed record and whose layers are its files' blobs,
addressed by SHA-256 (:mod:`.oci_format`); a blob the repository holds already is not sent
again (a HEAD by digest), so identical files are stored once per repository.

Requests, as the distribution spec writes them: ``HEAD``/``GET /v2/<repo>/manifests/<tag>``
(a lookup: one GET, the record is inline in the manifest), ``GET /v2/<repo>/blobs/<digest>``
(following a redirect to the registry's storage, as ECR and GCR answer), a monolithic
upload (``POST .../blobs/uploads/`` then ``PUT <location>?digest=``), ``PUT`` of the
manifest, ``GET /v2/<repo>/tags/list`` (``cachectl remote ls``), ``DELETE`` of a manifest
by digest (``cachectl remote purge``; the registry must allow deletes:
``REGISTRY_STORAGE_DELETE_ENABLED=true`` on distribution). Blobs no manifest references
are the registry's to collect (``registry garbage-collect``): :meth:`OciRemote.sweep`
deletes nothing.

Auth, as registries do it: the first request goes anonymous; a ``401`` names a ``Basic``
realm (the URL's user and password, or ``CACHECOMPILE_REMOTE_PASSWORD``) or a ``Bearer``
one, whose token service is asked for a token scoped to this repository (``pull`` with
``mode=ro``, else ``pull,push``), with the user and password if given. The token is
kept until a request is refused again. Credentials and tokens go only in the
``Authorization`` header, never in a URL, a message or a log.

What a registry cannot do: compare-and-set a tag. A record is created (a HEAD, then a
PUT) and never replaced but when it is malformed, by a keyed ``cachectl push``, as on
the HTTP tier (:mod:`.http`, whose connection, deadline and breaker this tier shares).
Registries check every blob's digest on upload, so a blob is never stored damaged; one
whose size the registry misstates is stored again (:meth:`BlobRemote.stored_whole`).
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import io
import json
import logging
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import errors
from ..signing import Trust, parse_record
from .base import RemoteConfig, refuse_readonly, register
from .http import HttpRemote, _authorization, _closing, _Status, netloc_of
from .oci_format import INDEX_TYPE, MANIFEST_TYPE, digest_of_tag, manifest_for, record_in, tag_of

logger = logging.getLogger(__name__)

__all__ = ["OciRemote"]

# The distribution spec's repository name.
_REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
_NEXT = re.compile(r"<([^>]+)>\s*;\s*rel=\"?next\"?")
_MAX_REDIRECTS = 3
_MAX_TOKEN = 1024**2


@register
class OciRemote(HttpRemote):
    """One repository of an OCI registry (see the module docstring)."""

    kind = "oci"
    schemes: tuple[str, ...] = ("oci", "oci+http", "oci+https")
    default_prefix = ""

    @classmethod
    def parse_url(cls, parts: urllib.parse.SplitResult, ours: Mapping[str, str],
                  rest: list[tuple[str, str]], *, credentials: bool) -> tuple[str, str]:
        if rest:
            raise ValueError(f"unknown parameters {sorted(k for k, _ in rest)} (oci:// "
                             "takes mode, timeout, backoff and lease)")
        if not parts.hostname:
            raise ValueError(f"{parts.scheme}:// takes a registry: "
                             f"{parts.scheme}://registry[:port]/repository")
        if "prefix" in ours or "chunk" in ours:
            raise ValueError("on oci:// the repository is the URL's path, and blobs go whole")
        repo = parts.path.strip("/")
        if not _REPO.fullmatch(repo):
            raise ValueError(f"{repo!r} is not a repository name (lower-case letters, "
                             "digits, '.', '_', '-', separated by '/'): "
                             f"{parts.scheme}://registry/team/compile-cache")
        plain = parts.scheme == "oci+http" or (parts.scheme == "oci"
                                               and parts.hostname in _LOOPBACK)
        netloc = netloc_of(parts)
        return f"{'http' if plain else 'https'}://{netloc}", repo

    @classmethod
    def display_of(cls, target: str, prefix: str) -> str:
        scheme, _, netloc = target.partition("://")
        host = urllib.parse.urlsplit(target).hostname
        plain_by_default = host in _LOOPBACK  # oci:// means plain HTTP there, as in Docker
        shown = "oci" if (scheme == "https") != plain_by_default else f"oci+{scheme}"
        return f"{shown}://{netloc}/{prefix}"

    def __init__(self, config: RemoteConfig | str, trust: Trust | None = None) -> None:
        super().__init__(config, trust)
        self._auth = ""  # HttpRemote's fixed header: a registry says what it wants (401)
        self._authz = ""  # the Authorization header the registry accepted last
        self._repo = self.config.prefix

    # -- plumbing ------------------------------------------------------------------------
    def _url(self, kind: str, name: str = "") -> str:
        if kind == "v2":
            return "/v2/"
        where = {"ac": "manifests/", "cas": "blobs/sha256:", "uploads": "blobs/uploads/",
                 "tags": "tags/list", "manifest": "manifests/"}[kind]
        return f"/v2/{self._repo}/{where}{name}"

    def _send(self, method: str, path: str, body: Any = None,
              headers: Mapping[str, str] | None = None) -> http.client.HTTPResponse:
        """One request with the registry's auth: sent again once after a 401, with the
        credentials or token its challenge asks for."""
        hdrs = dict(headers or {})
        if "/manifests/" in path:
            hdrs.setdefault("Accept", f"{MANIFEST_TYPE}, {INDEX_TYPE}")
        for attempt in (0, 1):
            if self._authz:
                hdrs["Authorization"] = self._authz
            r = super()._send(method, path, body, hdrs)
            if r.status != 401:
                return r
            if attempt:
                with _closing(r):
                    r.read()
                who = f" for user {self.config.username!r}" if self.config.username else ""
                raise _Status(method, f"the registry refused our credentials{who} (check the "
                              "user name and password, or the token service's grant)", 401,
                              "Unauthorized")
            challenge = r.getheader("WWW-Authenticate") or ""
            with _closing(r):
                r.read()
            self._authz = self._authorize(challenge)
        raise AssertionError("unreachable")

    def _authorize(self, challenge: str) -> str:
        """The Authorization header a 401's challenge asks for (the token dance for
        ``Bearer``); _Status if we have nothing it would take."""
        scheme, _, params = challenge.strip().partition(" ")
        fields = dict(_CHALLENGE.findall(params))
        user, password = self.config.username, self.config.password
        if scheme.lower() == "basic":
            if user is None or password is None:
                raise _Status("GET", "the registry wants " + (
                    "a user name and password: oci://USER@registry/repository, the password "
                    "in CACHECOMPILE_REMOTE_PASSWORD(_FILE)" if user is None and password is None
                    else f"a password for user {user!r} (CACHECOMPILE_REMOTE_PASSWORD or "
                         "_PASSWORD_FILE)" if password is None
                    else "a user name with the password: oci://USER@registry/repository"),
                    401, "Unauthorized")
            return _authorization(user, password)
        if scheme.lower() != "bearer" or not fields.get("realm"):
            raise _Status("GET", f"the registry asks for {scheme or 'no'} auth, which this "
                          "tier does not speak (Basic and Bearer tokens)", 401, "Unauthorized")
        action = "pull" if self.config.readonly else "pull,push"
        query = {"scope": f"repository:{self._repo}:{action}"}
        if fields.get("service"):
            query["service"] = fields["service"]
        realm = fields["realm"]
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        req = urllib.request.Request(url, headers={"User-Agent": "cachecompile"})
        if user is not None or password is not None:
            # Basic, also with a password alone (a token service wants a user field).
            req.add_header("Authorization", _authorization(user or "", password))
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout) as resp:
                doc = json.loads(resp.read(_MAX_TOKEN))
        except urllib.error.HTTPError as e:
            what = ("the registry's token service failed" if e.code not in (401, 403)
                    else "the registry's token service wants a user name and password: "
                         "oci://USER@registry/repository" if user is None and password is None
                    else "the registry's token service refused our credentials (check the "
                         "user name and password)")
            raise _Status("GET", what, e.code, str(e.reason)) from None
        except (ValueError, UnicodeDecodeError):
            raise _Status("GET", "the registry's token service answered no JSON", 502,
                          "") from None
        tok = doc.get("token") or doc.get("access_token") if isinstance(doc, dict) else None
        if not isinstance(tok, str) or not tok:
            raise _Status("GET", "the registry's token service gave no token", 502, "")
        return f"Bearer {tok}"

    def _path_of(self, location: str) -> str:
        """The path and query of a Location on our registry (an upload's); ValueError
        for one elsewhere (a blob's redirect goes through :meth:`_follow`)."""
        loc = urllib.parse.urlsplit(location)
        ours = urllib.parse.urlsplit(self.config.target)
        if loc.netloc and loc.netloc != ours.netloc:
            raise ValueError(f"the registry sent an upload to another host ({loc.netloc})")
        return loc.path + (f"?{loc.query}" if loc.query else "")

    # -- reads ---------------------------------------------------------------------------
    def ping(self) -> bool:
        def go() -> bool:
            r = self._send("GET", self._url("v2"))
            with _closing(r):
                r.read()
                if r.status != 200:
                    raise _Status("GET", "check the registry (/v2/)", r.status, r.reason)
            return True

        return bool(self._call("check the registry", go))

    def contains(self, digest: str) -> bool:
        return self._small("HEAD", "ac", tag_of(digest), "head manifest") is not None

    def read_record(self, digest: str) -> tuple[bytes, object] | None:
        """(the record, the manifest's bytes as the tag a blind repair compares). A
        manifest that leads to no record gives bytes that are no record: the entry is
        malformed, as a torn record is on other tiers (a miss, and ``push`` repairs it)."""
        raw = self._small("GET", "ac", tag_of(digest), "get manifest")
        if raw is None:
            return None
        return record_in(raw, digest, lambda h: self._small("GET", "cas", h, "get record")), raw

    def _redirected(self, r: http.client.HTTPResponse) -> http.client.HTTPResponse | None:
        """A blob's redirect to the registry's storage, followed (ECR and GCR answer so)."""
        if r.status not in (301, 302, 303, 307, 308):
            return None
        where = r.getheader("Location") or ""
        with _closing(r):
            r.read()
        return self._follow(where)

    def _follow(self, location: str) -> http.client.HTTPResponse:
        """GET a blob where the registry redirected us (its storage: a presigned URL that
        must not get our credentials), on a connection of its own."""
        for _ in range(_MAX_REDIRECTS):
            loc = urllib.parse.urlsplit(location)
            if loc.scheme not in ("http", "https") or not loc.hostname:
                raise ValueError("the registry redirected a blob to no HTTP URL")
            cls = http.client.HTTPSConnection if loc.scheme == "https" else http.client.HTTPConnection
            conn = cls(loc.hostname, loc.port, timeout=self.config.timeout)
            conn.request("GET", loc.path + (f"?{loc.query}" if loc.query else ""),
                         headers={"User-Agent": "cachecompile"})
            r = conn.getresponse()
            if r.status in (301, 302, 303, 307, 308):
                location = r.getheader("Location") or ""
                r.close()
                continue
            if r.status != 200:
                r.close()
                raise _Status("GET", "get blob from the registry's storage", r.status, r.reason)
            return r
        raise ValueError("the registry redirected a blob too many times")

    def raw_records(self) -> Iterator[tuple[str, bytes | None]]:
        for tag in self._tags():
            digest = digest_of_tag(tag)
            if digest is not None:
                got = self.read_record(digest)
                yield digest, None if got is None else got[0]

    def _tags(self) -> list[str]:
        """Every tag of the repository (the tags list, page by page)."""
        tags: list[str] = []
        path: str | None = self._url("tags", "?n=1000")
        while path is not None:
            page, path = self._call("list tags", functools.partial(self._tag_page, path))
            tags += [str(t) for t in page]
        return tags

    def _tag_page(self, path: str) -> tuple[list[str], str | None]:
        """One page of the tags list, and the path of the next (its ``Link``)."""
        r = self._send("GET", path)
        with _closing(r):
            body = r.read(64 * 1024**2)
            if r.status == 404:
                return [], None  # nothing was ever pushed to it
            if r.status != 200:
                raise _Status("GET", "list tags", r.status, r.reason)
            nxt = _NEXT.search(r.getheader("Link") or "")
        doc = json.loads(body)
        return list(doc.get("tags") or []), self._path_of(nxt.group(1)) if nxt else None

    def info(self) -> dict[str, Any]:
        return {"objects": sum(digest_of_tag(t) is not None for t in self._tags())}

    # -- writes --------------------------------------------------------------------------
    def replace_refused(self) -> str:
        return ("a registry cannot compare and set a tag, so a record on it is never "
                "replaced but a malformed one by a keyed `cachectl push` (cachectl remote "
                "purge deletes it)")

    def write_record(self, digest: str, data: bytes, tag: object | None, *,
                     blind: bool = False) -> bool:
        if tag is not None:
            if not blind:
                return False
            now = self.read_record(digest)  # still the malformed bytes judged? (a window)
            if now is None or now[1] != tag:
                return False
        elif self.contains(digest):
            return False
        rec = parse_record(data, digest)
        record_sha = hashlib.sha256(data).hexdigest()
        if self.stored_whole(record_sha, len(data)) is None:
            self._upload(io.BytesIO(data), len(data), record_sha, "put record")
        manifest = manifest_for(data, rec)

        def go() -> None:
            r = self._send("PUT", self._url("manifest", tag_of(digest)), manifest,
                           {"Content-Type": MANIFEST_TYPE,
                            "Content-Length": str(len(manifest))})
            with _closing(r):
                r.read()
                if not 200 <= r.status < 300:
                    raise _Status("PUT", "put manifest", r.status, r.reason)

        self._call("put manifest", go)
        return True

    def put_blob(self, path: Path, sha: str,
                 progress: Callable[[int], None] | None = None) -> int:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            self._upload(f, size, sha, "put blob")
        if progress is not None:
            progress(size)
        self.bad_blobs.discard(sha)
        return max(size, 1)

    def _upload(self, body: Any, size: int, sha: str, what: str) -> None:
        """A monolithic upload: POST for a location, then PUT the bytes there."""

        def start() -> str:
            r = self._send("POST", self._url("uploads"), b"", {"Content-Length": "0"})
            with _closing(r):
                r.read()
                if r.status != 202 or not r.getheader("Location"):
                    raise _Status("POST", f"{what}: start the upload", r.status, r.reason)
                return self._path_of(str(r.getheader("Location")))

        where = str(self._call(what, start))
        where += ("&" if "?" in where else "?") + f"digest=sha256:{sha}"

        def put() -> int:
            r = self._send("PUT", where, body, {"Content-Length": str(size),
                                                "Content-Type": "application/octet-stream"})
            with _closing(r):
                r.read()
                if r.status == 413:
                    return 413
                if r.status != 201:
                    raise _Status("PUT", what, r.status, r.reason)
                return 201

        if self._call(what, put, bounded=False) == 413:
            raise errors.StoreError(f"remote cache {self.config.display}: a file of {size} "
                                    "bytes is too large for the registry (413): entry not "
                                    "shared")

    def delete(self, digest: str) -> bool:
        """Delete the manifest of ``digest`` (by its digest, as registries take it)."""
        refuse_readonly(self.config)
        raw = self._small("GET", "ac", tag_of(digest), "get manifest")
        if raw is None:
            return False
        ref = "sha256:" + hashlib.sha256(raw).hexdigest()

        def go() -> bool:
            r = self._send("DELETE", self._url("manifest", ref))
            with _closing(r):
                r.read()
                if r.status == 404:
                    return False
                if r.status == 405:
                    raise _Status("DELETE", "delete manifest (the registry allows no "
                                  "deletes: REGISTRY_STORAGE_DELETE_ENABLED=true on "
                                  "distribution)", r.status, r.reason)
                if not 200 <= r.status < 300:
                    raise _Status("DELETE", "delete manifest", r.status, r.reason)
                return True

        return bool(self._call("delete manifest", go))

    def sweep(self) -> int:
        """Nothing: blobs no manifest references are the registry's garbage collection's
        (``registry garbage-collect``; Harbor, ECR and the rest run their own)."""
        refuse_readonly(self.config)
        logger.info("remote cache %s: blobs no entry references are left to the registry's "
                    "garbage collection", self.config.display)
        return 0
