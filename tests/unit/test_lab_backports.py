"""Which backports a lab host binds over the system's, and how (no root, no download)."""

from __future__ import annotations

import os

import pytest

from flexmig import exceptions
from flexmig_lab import emulator


def _unpacked(cache, backport):
    (cache / backport.name).mkdir()
    (cache / backport.name / "unpacked").write_text("1\n")


def test_libvirt_is_the_systems_unless_backports_are_asked_for(monkeypatch, tmp_path):
    monkeypatch.delenv(emulator.LIBVIRT_ENV, raising=False)
    assert emulator.backports() == (emulator.QEMU,)
    _unpacked(tmp_path, emulator.QEMU)
    assert not any("libvirt" in target for target in emulator.host_binds(tmp_path))

    monkeypatch.setenv(emulator.LIBVIRT_ENV, "backports")
    with pytest.raises(exceptions.MissingPrerequisite, match="the lab's libvirt"):
        emulator.host_binds(tmp_path)
    _unpacked(tmp_path, emulator.LIBVIRT)
    binds = emulator.host_binds(tmp_path)
    root = tmp_path / "libvirt" / "root"
    assert binds["/usr/sbin/libvirtd"] == str(root / "usr/sbin/libvirtd")
    # A library is bound over the file its soname link names, not the link.
    system_lib = os.path.realpath("/usr/lib/x86_64-linux-gnu/libvirt.so.0")
    assert binds[system_lib] == os.path.realpath(root / "usr/lib/x86_64-linux-gnu/libvirt.so.0")


def test_a_bad_choice_is_refused(monkeypatch):
    monkeypatch.setenv(emulator.LIBVIRT_ENV, "11")
    with pytest.raises(exceptions.InvalidInput, match="'system' \\(default\\) or 'backports'"):
        emulator.backports()
