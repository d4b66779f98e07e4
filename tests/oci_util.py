"""A real OCI registry for tests, on a free loopback port: the distribution registry
(``registry:2``; Debian's ``docker-registry``, installed by .ci/system-deps.sh), with
deletes enabled, optionally behind htpasswd (Basic) auth; and a token-auth front for the
Bearer dance (a realm that grants tokens, in front of the real registry). ``skopeo``
(Debian) checks interop. Without them the tests skip, naming the package; CI
(CACHECOMPILE_REQUIRE_REGISTRY=1, .ci/run) fails instead.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import os
import secrets
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest
from redis_util import ServerProcess, free_port

REGISTRY_SKIP = ("the OCI registry is not installed: apt-get install docker-registry skopeo "
                 "(as .ci/system-deps.sh does) to run the OCI-tier tests against it")


def _need(exe: str) -> str:
    found = shutil.which(exe)
    if found is None:
        if os.environ.get("CACHECOMPILE_REQUIRE_REGISTRY"):
            pytest.fail(f"CACHECOMPILE_REQUIRE_REGISTRY is set (CI): {REGISTRY_SKIP}")
        pytest.skip(REGISTRY_SKIP)
    return found


def skopeo() -> str:
    return _need("skopeo")


def _bcrypt(password: str) -> str:
    """An htpasswd line's hash (the registry takes bcrypt only): the ``htpasswd`` tool
    where it is installed, else the C library's crypt (cost 4: the registry checks it on
    every request)."""
    tool = shutil.which("htpasswd")
    if tool is not None:
        out = subprocess.run([tool, "-nbBC", "4", "u", password], check=True,
                             capture_output=True, text=True).stdout
        return out.strip().split(":", 1)[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # gone in Python 3.13, where htpasswd is needed

    return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))


class Registry(ServerProcess):
    """The distribution registry serving ``dir/data``. ``password``: htpasswd auth for
    user ``fleet``."""

    def __init__(self, workdir: Path, *, password: str | None = None) -> None:
        exe = _need("docker-registry")
        super().__init__(workdir, "docker-registry", "registry.log")
        self.exe = exe
        self.password = password
        self.data = self.dir / "data"

    def url(self, repo: str = "team/cc", **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"oci://127.0.0.1:{self.port}/{repo}" + (f"?{query}" if query else "")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Registry:
        auth = ""
        if self.password is not None:
            users = self.dir / "htpasswd"
            users.write_text(f"fleet:{_bcrypt(self.password)}\n")
            auth = f"auth:\n  htpasswd: {{realm: test, path: {users}}}\n"
        conf = self.dir / "config.yml"
        conf.write_text(f"""version: 0.1
log: {{level: warn}}
storage:
  filesystem: {{rootdirectory: {self.data}}}
  delete: {{enabled: true}}
http:
  addr: 127.0.0.1:{self.port}
  secret: {secrets.token_hex(8)}
{auth}""")
        log = open(self.log_file, "ab")  # the server keeps it
        self.proc = subprocess.Popen([self.exe, "serve", str(conf)],
                                     stdout=log, stderr=log)
        log.close()
        self.wait_up(self._up, timeout=20)
        return self

    def _up(self) -> bool:
        try:
            urllib.request.urlopen(f"http://{self.address}/v2/", timeout=0.5).close()
        except urllib.error.HTTPError:
            pass
        return True


class TokenFront:
    """Bearer-token auth in front of a real registry, as Docker Hub, Harbor and GHCR do
    it: a request without a valid token gets 401 with ``WWW-Authenticate: Bearer
    realm=...,service=...,scope=...``; the realm grants a token for the user ``fleet``
    and ``password`` (Basic); a request with it is forwarded to the registry.
    ``grants`` keeps the scopes asked for."""

    def __init__(self, registry: Registry, password: str) -> None:
        self.registry = registry
        self.password = password
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.grants: list[str] = []
        self.refused = 0
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.path.startswith("/token"):
                    want = "Basic " + base64.b64encode(
                        f"fleet:{front.password}".encode()).decode()
                    if self.headers.get("Authorization") != want:
                        front.refused += 1
                        return self._reply(401, b"{}", {})
                    front.grants.append(self.path)
                    return self._reply(200, b'{"token": "%s"}' % front.token.encode(),
                                       {"Content-Type": "application/json"})
                if self.headers.get("Authorization") != f"Bearer {front.token}":
                    realm = f"http://127.0.0.1:{front.port}/token"
                    return self._reply(401, b"{}", {"WWW-Authenticate": (
                        f'Bearer realm="{realm}",service="test-registry",'
                        'scope="repository:team/cc:pull"')})
                conn = http.client.HTTPConnection("127.0.0.1", front.registry.port, timeout=30)
                hdrs = {k: v for k, v in self.headers.items()
                        if k.lower() not in ("authorization", "host", "connection")}
                conn.request(self.command, self.path, body=body or None, headers=hdrs)
                r = conn.getresponse()
                data = r.read()
                out = {k: v for k, v in r.getheaders()
                       if k.lower() not in ("content-length", "connection",
                                            "transfer-encoding")}
                if "Location" in out:  # the registry's upload location, on this front
                    out["Location"] = out["Location"].replace(
                        front.registry.address, f"127.0.0.1:{front.port}")
                conn.close()
                self._reply(r.status, data, out)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, repo: str = "team/cc") -> str:
        return f"oci://127.0.0.1:{self.port}/{repo}"

    def start(self) -> TokenFront:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
