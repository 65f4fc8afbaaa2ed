#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine: a JDK (17+), the project venv, and with
# --test the test tools (tshark, redis-server, a separate Synapse venv). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

PY=${PYTHON:-python3}
SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO="sudo"

apt_updated=0
apt_install() {
  if [ $apt_updated -eq 0 ]; then
    $SUDO apt-get update -qq >/dev/null
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

java_ok() {
  command -v java >/dev/null 2>&1 || return 1
  local v
  v=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1)
  [ -n "$v" ] && [ "$v" -ge 17 ]
}
if ! java_ok; then
  echo "setup: installing a JDK (openjdk-17-jre-headless)" >&2
  apt_install openjdk-17-jre-headless
fi

if [ $want_test -eq 1 ]; then
  command -v tshark >/dev/null 2>&1 || { echo "setup: installing tshark" >&2; apt_install tshark; }
  command -v chromium >/dev/null 2>&1 || { echo "setup: installing chromium" >&2; apt_install chromium; }  # report test: headless page render
  command -v prometheus >/dev/null 2>&1 || { echo "setup: installing prometheus" >&2; apt_install prometheus; }  # --metrics test: a real Prometheus scrapes it
  command -v redis-server >/dev/null 2>&1 || { echo "setup: installing redis-server" >&2; apt_install redis-server; }
  command -v tcpdump >/dev/null 2>&1 || { echo "setup: installing tcpdump" >&2; apt_install tcpdump; }
  # the Synapse worker test runs its own PostgreSQL cluster (initdb/pg_ctl are not on PATH on Debian)
  ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || { echo "setup: installing postgresql" >&2; apt_install postgresql; }
fi

stamp_of() { cat pyproject.toml "$@" 2>/dev/null | sha256sum | cut -c1-16; }

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extras=""
[ $want_test -eq 1 ] && extras="[test]"
stamp=".venv/.installed-$(stamp_of)${extras:+-test}"
if [ ! -f "$stamp" ]; then
  echo "setup: installing dcptool$extras into .venv" >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".$extras"
  touch "$stamp"
fi

if [ $want_test -eq 1 ]; then
  # Synapse lives in its own venv: its pins must not shape ours.
  # [postgres] (psycopg2) for the worker test: a venv installed before it had only [redis]
  if [ ! -x .synapse-venv/bin/synctl ] || [ ! -f .synapse-venv/.installed ] \
      || ! .synapse-venv/bin/python -c 'import psycopg2' >/dev/null 2>&1; then
    echo "setup: installing matrix-synapse[redis,postgres] into .synapse-venv" >&2
    [ -x .synapse-venv/bin/python ] || "$PY" -m venv .synapse-venv
    .synapse-venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .synapse-venv/bin/python -m pip install -q 'matrix-synapse[redis,postgres]'
    touch .synapse-venv/.installed
  fi
fi

# dcptool's own modules, byte-compiled: the environment may set PYTHONDONTWRITEBYTECODE, and
# every command would then compile them again (~60 ms of each `dcptool replay`). compileall
# only rewrites what changed; __pycache__ is ignored by git.
.venv/bin/python -m compileall -q protocol replay cli >/dev/null
