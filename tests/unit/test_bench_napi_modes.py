"""The NAPI-mode names of tests/bench/offload_napi_modes.py."""

from __future__ import annotations

import pytest

from tests.bench.offload_napi_modes import napi_knobs


def test_threaded_without_deferral() -> None:
    assert napi_knobs("threaded") == {
        "threaded": "1",
        "napi_defer_hard_irqs": "0",
        "gro_flush_timeout": "0",
    }


def test_softirq_with_deferral_in_microseconds() -> None:
    assert napi_knobs("softirq+defer250") == {
        "threaded": "0",
        "napi_defer_hard_irqs": "1",
        "gro_flush_timeout": "250000",
    }


@pytest.mark.parametrize("mode", ["busy", "threaded+defer", "softirq+deferx", "threaded+100"])
def test_unknown_modes_are_refused(mode: str) -> None:
    with pytest.raises(ValueError, match="unknown NAPI mode"):
        napi_knobs(mode)
