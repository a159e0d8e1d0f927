#!/usr/bin/env bash
# Prepares a fresh Debian/Ubuntu machine (with a Rust toolchain) to build, run and test
# reprise: the Debian packages the build and tests need (a headless browser among them), the
# Python client used by one test, and the models (scripts/fetch-models.sh). Safe to run again:
# it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# cmake + clang/libclang build llama.cpp and its bindings; redis-server is started by the tests;
# procps gives `kill`, with which one test sends SIGHUP; prometheus brings promtool, which
# checks the metrics exposition (tests/metrics.rs); chromium is the headless browser the
# dashboard's tests drive (tests/dashboard.rs; `CHROME` names another Chrome or Chromium):
# Debian's package is `chromium`, Ubuntu's `chromium-browser`; none is installed when one is
# there already or `CHROME` names one.
BROWSER=chromium
if [ -r /etc/os-release ] && grep -qx 'ID=ubuntu' /etc/os-release; then BROWSER=chromium-browser; fi
if [ -n "${CHROME:-}" ] || command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
  BROWSER=""
fi
PKGS="cmake clang libclang-dev redis-server redis-tools python3-pip procps prometheus $BROWSER"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "installing Debian packages:$missing" >&2
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

PY="$(command -v python3)"
if ! "$PY" -c "import openai" 2>/dev/null; then
  echo "installing the openai Python client (used by the compatibility test)" >&2
  "$PY" -m pip install --quiet openai 2>/dev/null \
    || "$PY" -m pip install --quiet --break-system-packages openai
fi

scripts/fetch-models.sh
