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
# The layers (.importlinter): no product package imports the lab.
$PY/lint-imports
shellcheck tools/*.sh .ci/run devstack/plugin.sh devstack/settings tests/devstack_standin/functions
echo "== tests"
# A lab left by an interrupted earlier run would make the functional tests fail.
$PY/flexmig-lab down >/dev/null
# Each lab fixture copies its hosts' logs (libvirtd, QEMU, agents) here before
# tearing the lab down, so a failed run can still be diagnosed.
export FLEXMIG_LAB_KEEP_LOGS="${FLEXMIG_LAB_KEEP_LOGS:-$ROOT/.cache/lab-logs}"
if [ $# -gt 0 ]; then
  exec $PY/pytest "$@"
fi
# Nova's functional harness runs Nova with native threads and refuses to start
# once anything imported eventlet (oslo.privsep and os-ken do): its own process.
status=0
$PY/pytest --ignore=tests/nova_functional || status=$?
$PY/pytest tests/nova_functional || status=$?
if [ "$status" -ne 0 ]; then
  echo "== the labs' logs, as each test module left them: $FLEXMIG_LAB_KEEP_LOGS"
fi
exit "$status"
