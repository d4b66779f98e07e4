#!/usr/bin/env bash
# System packages the test suite needs, on Debian/Ubuntu CI (run as root, or with sudo).
# Idempotent: installs only what is missing.
#   redis-server  the real server the remote-tier tests start on a loopback port
#   nginx         with its WebDAV modules (the core dav module and libnginx-mod-http-dav-ext
#                 for PROPFIND): the HTTP tier's tests start it on a loopback port
#                 (tests/http_util.py); the package's own service is stopped
#   docker-registry  the distribution registry (registry:2) the OCI-tier tests start on a
#                 loopback port (tests/oci_util.py), and skopeo, which checks that other
#                 tools read what the tier writes; the package's own service is stopped
#   s3rver        (npm, into .s3rver/, git-ignored) the second S3 server the S3-tier tests
#                 start: it honours no conditional put and fails big LISTs, unlike moto
#                 (tests/s3_util.py finds it there, or at CACHECOMPILE_TEST_S3RVER)
set -euo pipefail
cd "$(dirname "$0")/.."
S3RVER_VERSION=3.7.1

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
apt_updated=""
apt_install() {
  [ -n "$apt_updated" ] || { $SUDO apt-get update -qq; apt_updated=1; }
  $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if command -v redis-server >/dev/null 2>&1; then
  echo "redis-server already installed: $(redis-server --version | cut -d' ' -f3)"
else
  apt_install redis-server
  # The package may start a system service; the tests start their own server on a free port.
  echo "installed $(redis-server --version | cut -d' ' -f3)"
fi

if command -v nginx >/dev/null 2>&1 && [ -f /usr/lib/nginx/modules/ngx_http_dav_ext_module.so ]; then
  echo "nginx already installed: $(nginx -v 2>&1 | cut -d/ -f2)"
else
  apt_install nginx libnginx-mod-http-dav-ext
  # The package may start a system service on port 80; the tests start their own.
  if [ -f /run/nginx.pid ]; then
    $SUDO nginx -s stop 2>/dev/null || true
  fi
  echo "installed nginx $(nginx -v 2>&1 | cut -d/ -f2) with WebDAV (dav-ext)"
fi

if [ -f .s3rver/node_modules/s3rver/bin/s3rver.js ] \
    && grep -q "\"version\": \"$S3RVER_VERSION\"" .s3rver/node_modules/s3rver/package.json; then
  echo "s3rver already installed: $S3RVER_VERSION"
else
  command -v npm >/dev/null 2>&1 || apt_install nodejs npm
  npm install --silent --no-audit --no-fund --prefix .s3rver "s3rver@$S3RVER_VERSION"
  echo "installed s3rver $S3RVER_VERSION into .s3rver/"
fi

if command -v docker-registry >/dev/null 2>&1 && command -v skopeo >/dev/null 2>&1; then
  echo "docker-registry already installed: $(docker-registry --version | cut -d' ' -f3)"
else
  apt_install docker-registry skopeo
  # The package may start a system service on port 5000; the tests start their own.
  if command -v systemctl >/dev/null 2>&1; then
    $SUDO systemctl stop docker-registry 2>/dev/null || true
  fi
  echo "installed docker-registry $(docker-registry --version | cut -d' ' -f3) and skopeo"
fi
