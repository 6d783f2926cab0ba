#!/usr/bin/env bash
# The test command: set up, lint, unit tests (no root), functional tests (root,
# the lab).  Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
"$ROOT/tools/setup.sh"
PY=.venv/bin
echo "== lint"
$PY/ruff check flexmig agents nova_driver ovs_ext tests
$PY/ruff format --check flexmig agents nova_driver ovs_ext tests
shellcheck tools/*.sh .ci/run devstack/plugin.sh devstack/settings tests/devstack_standin/functions
echo "== tests"
# A lab left by an interrupted earlier run would make the functional tests fail.
$PY/flexmig lab down >/dev/null
$PY/pytest "$@"
