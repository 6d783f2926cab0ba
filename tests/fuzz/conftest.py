"""Property-based fuzzing (Hypothesis) of every parser that faces the network or
an operator.  The test suite runs a short smoke (``FLEXMIG_FUZZ_EXAMPLES``
unset: 200 inputs per target); ``tools/fuzz.sh`` runs the long campaign.
Each target checks: no exception but the documented rejection, no hang (a
deadline per input), and no state change from a rejected input."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("FLEXMIG_FUZZ_EXAMPLES", "200"))
settings.register_profile(
    "flexmig-fuzz",
    max_examples=EXAMPLES,
    deadline=2000,  # ms per input: a parser that takes longer is a hang
    derandomize=EXAMPLES <= 200,  # the smoke run is reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("flexmig-fuzz")
