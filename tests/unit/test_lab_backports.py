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


def test_a_qemu_of_another_release_starts_through_its_own_loader(monkeypatch, tmp_path):
    monkeypatch.delenv(emulator.LIBVIRT_ENV, raising=False)
    monkeypatch.setenv(emulator.QEMU_ENV, "trixie")
    assert emulator.backports() == (emulator.QEMU_TRIXIE,)
    with pytest.raises(exceptions.MissingPrerequisite, match="the lab's qemu-trixie"):
        emulator.host_binds(tmp_path)
    _unpacked(tmp_path, emulator.QEMU_TRIXIE)
    binds = emulator.host_binds(tmp_path)
    assert binds["/usr/bin/qemu-system-x86_64"] == str(tmp_path / "qemu-trixie/qemu-system-x86_64")
    root = tmp_path / "qemu-trixie" / "root"
    assert binds["/usr/share/qemu"] == str(root / "usr/share/qemu")
    wrapper = emulator.loader_wrapper(root)
    lib = root / "usr/lib/x86_64-linux-gnu"
    assert f"exec {lib}/ld-linux-x86-64.so.2 --library-path {lib} " in wrapper
    assert wrapper.rstrip().endswith(f'{root}/usr/bin/qemu-system-x86_64 "$@"')


def test_only_library_packages_come_with_a_foreign_qemu():
    out = "qemu-system-x86\n  Depends: libc6\nlibc6\nlibpam0g\n<awk>\nadduser\n"
    out += "gcc-14-base\nzlib1g\n"
    assert emulator.libraries_of(out) == ["gcc-14-base", "libc6", "zlib1g"]


def test_a_bad_qemu_choice_is_refused(monkeypatch):
    monkeypatch.setenv(emulator.QEMU_ENV, "sid")
    with pytest.raises(exceptions.InvalidInput, match="'backports' \\(default\\) or 'trixie'"):
        emulator.backports()
