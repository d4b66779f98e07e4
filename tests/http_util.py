"""Real HTTP cache servers for tests, on free loopback ports: nginx with its WebDAV
modules (Debian's ``nginx`` and ``libnginx-mod-http-dav-ext``, installed by
.ci/system-deps.sh) and WsgiDAV (PyPI, in the test extras, served by cheroot).

Both speak what the HTTP tier needs: GET, PUT, HEAD, DELETE and PROPFIND. nginx writes a
PUT into a temp file and renames it; WsgiDAV writes in place. Without nginx the tests
skip, naming the package; CI (CACHECOMPILE_REQUIRE_NGINX=1, .ci/run) fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from redis_util import ServerProcess

NGINX_SKIP = ("nginx is not installed: apt-get install nginx libnginx-mod-http-dav-ext (as "
              ".ci/system-deps.sh does) to run the HTTP-tier tests against it")
DAV_EXT = Path("/usr/lib/nginx/modules/ngx_http_dav_ext_module.so")
WSGIDAV_SKIP = "WsgiDAV is not installed: pip install -e '.[test]' (wsgidav, cheroot)"


def nginx_exe() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None)


class _Answers:
    """A probe: any HTTP answer means the server is up."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self) -> bool:
        try:
            urllib.request.urlopen(self.url, timeout=0.5).close()
        except urllib.error.HTTPError:
            pass
        return True


class NginxServer(ServerProcess):
    """nginx serving ``dir/data`` with WebDAV (PUT, DELETE; PROPFIND from dav-ext).

    ``max_body``: nginx's client_max_body_size (a bigger PUT gets 413); ``password``:
    HTTP Basic for user ``fleet`` is required; ``extra``: more directives in the location.
    """

    def __init__(self, workdir: Path, *, max_body: str = "1g", password: str | None = None,
                 extra: str = "", tls: bool = False) -> None:
        exe = nginx_exe()
        if exe is None or not DAV_EXT.is_file():
            if os.environ.get("CACHECOMPILE_REQUIRE_NGINX"):
                pytest.fail(f"CACHECOMPILE_REQUIRE_NGINX is set (CI): {NGINX_SKIP}")
            pytest.skip(NGINX_SKIP)
        super().__init__(workdir, "nginx", "error.log")
        self.exe = exe
        self.max_body = max_body
        self.password = password
        self.extra = extra
        self.tls = tls
        self.data = self.dir / "data"
        # A self-signed certificate for 127.0.0.1 (tls=True): clients trust it through
        # SSL_CERT_FILE, as a fleet points them at its own CA.
        self.cert = self.dir / "cert.pem"

    def url(self, prefix: str = "cc", **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.port}/{prefix}" + (f"?{query}" if query else "")

    def start(self) -> NginxServer:
        self.data.mkdir(parents=True, exist_ok=True)
        listen = f"127.0.0.1:{self.port}"
        if self.tls:
            key = self.dir / "key.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                            "-keyout", str(key), "-out", str(self.cert), "-days", "1",
                            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                           check=True, capture_output=True)
            listen += f" ssl; ssl_certificate {self.cert}; ssl_certificate_key {key}"
        auth = ""
        if self.password is not None:
            users = self.dir / "users"
            users.write_text(f"fleet:{{PLAIN}}{self.password}\n")
            auth = f'auth_basic "cache"; auth_basic_user_file {users};'
        user = "user root root;" if os.geteuid() == 0 else ""
        d = self.dir
        conf = self.dir / "nginx.conf"
        conf.write_text(f"""
load_module {DAV_EXT};
{user}
worker_processes 2;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 256; }}
http {{
  access_log {d}/access.log;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  client_max_body_size {self.max_body};
  server {{
    listen {listen};
    root {self.data};
    location / {{
      {auth}
      dav_methods PUT DELETE;
      dav_ext_methods PROPFIND OPTIONS;
      create_full_put_path on;
      dav_access user:rw;
      {self.extra}
    }}
  }}
}}
""")
        log = open(self.log_file, "ab")  # the server keeps it
        self.proc = subprocess.Popen(
            [self.exe, "-p", str(d), "-c", str(conf), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        self.wait_up(self._up, timeout=15)
        return self

    def _up(self) -> bool:
        if not self.tls:
            return _Answers(f"http://127.0.0.1:{self.port}/")()
        import socket

        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
            return True


def wsgidav_available() -> bool:
    try:
        import cheroot  # noqa: F401
        import wsgidav  # noqa: F401
    except ImportError:
        return False
    return True


class WsgiDavServer(ServerProcess):
    """WsgiDAV (cheroot) serving ``dir/data``, anonymous read and write."""

    def __init__(self, workdir: Path) -> None:
        if not wsgidav_available():
            pytest.skip(WSGIDAV_SKIP)
        super().__init__(workdir, "wsgidav", "wsgidav.log")
        self.data = self.dir / "data"

    def url(self, prefix: str = "cc", **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"http://127.0.0.1:{self.port}/{prefix}" + (f"?{query}" if query else "")

    def start(self) -> WsgiDavServer:
        self.data.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "wsgidav.yaml"
        conf.write_text(f"""
host: 127.0.0.1
port: {self.port}
server: cheroot
provider_mapping:
  "/": "{self.data}"
http_authenticator:
  domain_controller: null
  accept_basic: true
  accept_digest: false
  default_to_digest: false
simple_dc:
  user_mapping:
    "*": true
verbose: 1
logging:
  enable_loggers: []
property_manager: true
lock_storage: true
""")
        log = open(self.log_file, "ab")  # the server keeps it
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from wsgidav.server.server_cli import run; run()",
             "--config", str(conf)],
            stdout=log, stderr=log)
        log.close()
        self.wait_up(_Answers(f"http://127.0.0.1:{self.port}/"), timeout=30)
        return self
