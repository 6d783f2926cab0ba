#!/usr/bin/env bash
# The fuzz campaign: libFuzzer on the mover's wire framing and bootstrap (C),
# Hypothesis on the agent API (bodies, headers, signatures, through a real
# listener), the OpenFlow statistics endpoint, the offload policy and the
# [flexmig]/[agent]/[offload] options.  FUZZ_RUNS inputs per C target,
# FLEXMIG_FUZZ_EXAMPLES per Python target.  Exits non-zero on any crash.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
FUZZ_RUNS=${FUZZ_RUNS:-2000000}
export FLEXMIG_FUZZ_EXAMPLES=${FLEXMIG_FUZZ_EXAMPLES:-10000}
echo "== C (libFuzzer): $FUZZ_RUNS inputs per target"
make -s -C agents/mover fuzz-run FUZZ_RUNS="$FUZZ_RUNS"
echo "== Python (Hypothesis): $FLEXMIG_FUZZ_EXAMPLES inputs per target"
exec .venv/bin/pytest tests/fuzz -q -p no:cacheprovider --durations=0 "$@"
