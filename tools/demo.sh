#!/usr/bin/env bash
# The main job: set up, bring up a two-host lab, boot a dirtying VM on host A,
# live-migrate it to host B, print what happened, tear the lab down.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/tools/setup.sh"
exec "$ROOT/.venv/bin/flexmig-lab" demo "$@"
