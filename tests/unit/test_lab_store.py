"""Where a lab host's store lives (no root, no mount)."""

from __future__ import annotations

import pytest

from flexmig import exceptions
from flexmig_lab import host


def test_the_store_shares_the_root_filesystem_unless_asked(monkeypatch):
    monkeypatch.delenv(host.STORE_ENV, raising=False)
    assert host.store_on_own_filesystem() is False
    monkeypatch.setenv(host.STORE_ENV, "own-fs")
    assert host.store_on_own_filesystem() is True
    monkeypatch.setenv(host.STORE_ENV, "own-fs-small-folios")
    assert host.store_on_own_filesystem() is True
    assert host.store_choice() == "own-fs-small-folios"


def test_a_bad_store_choice_is_refused(monkeypatch):
    monkeypatch.setenv(host.STORE_ENV, "tmpfs")
    with pytest.raises(exceptions.InvalidInput, match="one of shared, own-fs, own-fs-small-folios"):
        host.store_on_own_filesystem()
