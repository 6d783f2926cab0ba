"""The store's writeback: real files, real sync_file_range, no root."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from agents.agent import residency, split_store


def _file(tmp_path: Path, mib: float) -> Path:
    path = tmp_path / "pc.ram"
    path.write_bytes(os.urandom(int(mib * (1 << 20))))
    return path


def test_start_writeback_accepts_a_dirty_file(tmp_path: Path) -> None:
    fd = os.open(_file(tmp_path, 2), os.O_RDONLY)
    try:
        split_store.start_writeback(fd, 0, 1 << 20)
        split_store.start_writeback(fd, 1 << 20, 1 << 20)
    finally:
        os.close(fd)


def test_start_writeback_reports_the_errno() -> None:
    read_end, write_end = os.pipe()
    os.close(write_end)
    os.close(read_end)
    with pytest.raises(OSError) as info:
        split_store.start_writeback(read_end, 0, 1 << 20)
    assert info.value.errno == errno.EBADF


def test_a_flush_round_covers_the_file_in_1_mib_ranges(tmp_path, monkeypatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(split_store, "start_writeback", lambda _fd, off, n: calls.append((off, n)))
    path = _file(tmp_path, 3.5)
    flusher = split_store.ChunkFlusher(str(path), threading.Event())
    fd = os.open(path, os.O_RDONLY)
    try:
        flusher.flush_once(fd)
    finally:
        os.close(fd)
    assert calls == [(i << 20, 1 << 20) for i in range(4)]
    assert flusher.rounds == 1


def _wait_stopped(thread: threading.Thread, timeout: float = 5.0) -> None:
    thread.join(timeout)
    assert not thread.is_alive(), "the flusher kept running"


def test_the_flusher_runs_until_the_file_is_removed(tmp_path: Path) -> None:
    path = _file(tmp_path, 1)
    flusher = split_store.ChunkFlusher(str(path), threading.Event())
    flusher.start()
    deadline = time.monotonic() + 5
    while flusher.rounds < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flusher.rounds >= 2  # it keeps going while the VM (its file) is there
    path.unlink()
    _wait_stopped(flusher)


def test_the_flusher_stops_when_told_or_at_its_deadline(tmp_path: Path) -> None:
    path = _file(tmp_path, 1)
    stop = threading.Event()
    told = split_store.ChunkFlusher(str(path), stop)
    told.start()
    stop.set()
    _wait_stopped(told)
    expiring = split_store.ChunkFlusher(
        str(path), threading.Event(), deadline=time.monotonic() + 0.3
    )
    expiring.start()
    _wait_stopped(expiring)


def test_a_missing_file_ends_the_flusher_quietly(tmp_path: Path) -> None:
    flusher = split_store.ChunkFlusher(str(tmp_path / "gone"), threading.Event())
    flusher.start()
    _wait_stopped(flusher)
    assert flusher.rounds == 0


def test_memory_file_finds_what_libvirt_made(tmp_path: Path) -> None:
    store = split_store.SplitStore(str(tmp_path / "state"), str(tmp_path / "store"))
    assert store.memory_file("vm1") is None
    ram = tmp_path / "store/libvirt/qemu/3-vm1/pc.ram"
    ram.parent.mkdir(parents=True)
    ram.write_bytes(b"\0" * 4096)
    assert store.memory_file("vm1") == str(ram)
    assert store.memory_file("vm") is None
    with pytest.raises(Exception, match="vm/../x"):
        store.memory_file("vm/../x")


def test_the_keeper_leaves_residency_to_the_lru_once_libvirt_says_the_guest_runs_here(
    tmp_path: Path, monkeypatch
) -> None:
    """Before the switchover the keeper keeps the final round's headroom free; once
    libvirt's status file says the domain runs, it drops nothing (the kernel's LRU,
    which sees the guest's reads, chooses under the cap)."""
    monkeypatch.setattr(split_store, "LIBVIRT_PID_DIR", tmp_path)
    keeper = split_store.ResidencyKeeper(None, "vm1", threading.Event())
    assert not keeper._guest_runs_here()  # no status file: not known, headroom kept
    status = tmp_path / "vm1.xml"
    status.write_text("<domstatus state='paused' reason='migration' pid='7'>\n<domain/>")
    assert not keeper._guest_runs_here()
    status.write_text("<domstatus state='running' reason='migrated' pid='7'>\n<domain/>")
    assert keeper._guest_runs_here()
    marks = split_store._Marks.of(256 << 20, 64 << 20)
    assert (marks.target >> 20, marks.low >> 20) == (192, 160)
    over = 230 << 20
    assert residency.drop_pages(over, marks.target, marks.low) == (over - marks.low) // 4096
    assert residency.drop_pages(over, marks.target, marks.low, guest_runs_here=True) == 0
