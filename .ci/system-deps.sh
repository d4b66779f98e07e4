#!/usr/bin/env bash
# System packages the test suite needs, on Debian/Ubuntu CI (run as root).
# Idempotent: does nothing when redis-server is already on PATH.
#   redis-server  the real server the remote-tier tests start on a loopback port
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
  echo "redis-server already installed: $(redis-server --version | cut -d' ' -f3)"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
# The package may start a system service; the tests start their own server on a free port.
echo "installed $(redis-server --version | cut -d' ' -f3)"
