#!/usr/bin/env bash
# The test command: set up the machine, then lint, unit and functional tests
# through tox's environments (tox.ini), as the gate's jobs run them.  Extra
# arguments go to pytest, in the functional environment.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# Debian packages, the builds (mover, BPF objects), the guest image, and the
# virtualenv .venv that carries tox (and the lab's CLI).
"$ROOT/tools/setup.sh"
TOX=.venv/bin/tox
# pbr takes the version from git; a tree without history (an exported archive)
# has none to take, and is given one, as tools/setup.sh does.
if ! git rev-parse --verify -q HEAD >/dev/null 2>&1; then
  export PBR_VERSION=0.0.0
fi
echo "== lint"
# ruff, the layers (.importlinter: no product package imports the lab), shellcheck.
$TOX -q -e pep8
echo "== tests"
# A lab left by an interrupted earlier run would make the functional tests fail.
.venv/bin/flexmig-lab down >/dev/null
# Each lab fixture copies its hosts' logs (libvirtd, QEMU, agents) here before
# tearing the lab down, so a failed run can still be diagnosed.
export FLEXMIG_LAB_KEEP_LOGS="${FLEXMIG_LAB_KEEP_LOGS:-$ROOT/.cache/lab-logs}"
if [ $# -gt 0 ]; then
  # One pytest with these arguments in the functional environment (tox's
  # overrides take no {posargs}: the arguments go in quoted).
  exec $TOX -q -e functional -x "testenv:functional.commands=pytest $(printf '%q ' "$@")"
fi
# tox -e functional runs two pytest processes, the second even when the first
# failed: everything but Nova's functional harness (unit tests, fuzzing,
# doctests and the lab's tests: pyproject.toml's testpaths), then the harness,
# which runs Nova with native threads and refuses to start once anything
# imported eventlet (oslo.privsep and os-ken do).
status=0
$TOX -q -e functional -- --ignore=tests/nova_functional || status=$?
if [ "$status" -ne 0 ]; then
  echo "== the labs' logs, as each test module left them: $FLEXMIG_LAB_KEEP_LOGS"
fi
exit "$status"
