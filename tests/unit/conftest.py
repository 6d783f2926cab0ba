"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from flexmig.migration import libvirt_job


@pytest.fixture
def started_migrations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, int]]:
    """(params, flags) of every migration the agent's job hands libvirt; none starts."""
    started: list[tuple[dict, int]] = []
    monkeypatch.setattr(
        libvirt_job.hypervisor,
        "start_migration",
        lambda dom, host, uri, params, flags, *source: started.append((params, flags))
        or (None, []),
    )
    return started
