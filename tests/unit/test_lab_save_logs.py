"""Lab.save_logs: the hosts' logs copied out before tear-down (plain files, no root)."""

from __future__ import annotations

from pathlib import Path

from flexmig_lab.lab import Lab


def test_copies_each_hosts_logs_and_libvirt_dir(tmp_path: Path) -> None:
    lab_dir = tmp_path / "flexmig-lab-x"
    for host in ("A", "B"):
        (lab_dir / "hosts" / host / "log-libvirt" / "qemu").mkdir(parents=True)
        (lab_dir / "hosts" / host / "agent.log").write_text(f"agent {host}\n")
        (lab_dir / "hosts" / host / "log-libvirt" / "qemu" / "vm.log").write_text("qemu\n")
        (lab_dir / "hosts" / host / "store").mkdir()  # not a log: not copied
    saved = Lab(lab_dir).save_logs(tmp_path / "kept")
    assert saved is not None and saved.parent == tmp_path / "kept"
    assert (saved / "B" / "agent.log").read_text() == "agent B\n"
    assert (saved / "A" / "log-libvirt" / "qemu" / "vm.log").read_text() == "qemu\n"
    assert not (saved / "A" / "store").exists()


def test_a_lab_without_hosts_saves_nothing(tmp_path: Path) -> None:
    assert Lab(tmp_path / "never-up").save_logs(tmp_path / "kept") is None
    assert not (tmp_path / "kept").exists()
