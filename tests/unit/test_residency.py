"""The residency keeper's choices (pure) and its moves on a real process's file mapping."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from agents.agent import residency

MIB = 1 << 20


def test_a_chunk_referenced_every_interval_stays_hotter_than_one_touched_once():
    ages = [0, 0]
    ages = residency.age(ages, [0, 1])
    for _ in range(3):
        ages = residency.age(ages, [0])
    assert ages[0] > ages[1] > 0
    for _ in range(8):
        ages = residency.age(ages, [])
    assert ages == [0, 0]  # eight bits of history: all forgotten


def test_within_a_write_class_eviction_takes_the_coldest_first_and_only_what_is_needed():
    resident = [256, 256, 256, 256, 0]
    ages = [0xC0, 0x00, 0x80, 0x01, 0x00]
    once = [1] * 5
    assert residency.drop_order(resident, ages, once, 1) == [1]
    assert residency.drop_order(resident, ages, once, 257) == [1, 3]
    # never chunk 4: not resident
    assert residency.drop_order(resident, ages, once, 10_000) == [1, 3, 2, 0]


def test_zero_pages_go_before_the_guest_kernel_and_its_working_set_once_ages_are_forgotten():
    # The lost trace's case at a 50% budget: 4 MiB of guest kernel at low
    # addresses (written once, round one), 4 MiB rewritten by the guest every
    # round, 8 MiB of zero pages QEMU only read.  Ages are all 0 by the final
    # round (eight intervals forget); ordered by age and address the keeper
    # dropped the kernel first.
    kernel, working, zeros = range(0, 4), range(4, 8), range(8, 16)
    writes = [0] * 16
    looks = [set(kernel) | set(working), set(), set(working), set(), set(working), set()]
    before: set[int] = set()
    for dirty in looks:
        writes = residency.record_writes(writes, before, dirty)
        before = dirty
    assert [residency.write_class(writes[c]) for c in (0, 4, 8)] == [
        residency.WRITTEN_ONCE,
        residency.REWRITTEN,
        residency.NEVER_WRITTEN,
    ]
    resident, ages = [256] * 16, [0] * 16
    assert set(residency.drop_order(resident, ages, writes, 8 * 256)) == set(zeros)
    order = residency.drop_order(resident, ages, writes, 14 * 256)
    assert order[:8] == sorted(zeros, reverse=True)  # high addresses first on ties
    assert set(order[8:12]) == set(kernel) and set(order[12:]) <= set(working)
    assert residency.dropped_by_class(resident, writes, order) == [8 * 256, 4 * 256, 2 * 256]


def test_a_write_seen_at_two_looks_in_a_row_is_one_write():
    # The stream crossing an interval boundary leaves a chunk dirty at two looks.
    writes = residency.record_writes([0, 0], set(), {0})
    writes = residency.record_writes(writes, {0}, {0, 1})
    assert writes == [1, 1]
    writes = residency.record_writes(writes, {0, 1}, set())
    writes = residency.record_writes(writes, set(), {0})  # a later round resends it
    assert writes == [2, 1]


def test_the_target_keeps_headroom_but_never_below_half_the_cap():
    assert residency.target_bytes(240 * MIB, 24 * MIB) == 216 * MIB
    assert residency.target_bytes(100 * MIB, 90 * MIB) == 50 * MIB


def test_a_drop_goes_below_the_target_so_the_next_interval_lands_in_free_room():
    limit, headroom = 256 * MIB, 24 * MIB
    target = residency.target_bytes(limit, headroom)
    low = residency.low_mark(limit, headroom)
    assert low < target < limit
    assert residency.drop_pages(target, target, low) == 0
    pages = residency.drop_pages(target + MIB, target, low)
    assert target + MIB - pages * residency.PAGE == low
    # However small the headroom asked, the keeper never aims below half the cap.
    assert residency.low_mark(limit, limit) == limit // 2


class _Child:
    """A process that maps a file shared and writes every page of it, like incoming QEMU.

    ``pause_before_writing``: it maps the file, then waits for ``release()``.
    """

    def __init__(self, path: Path, size: int, pause_before_writing: bool = False) -> None:
        path.write_bytes(b"")
        os.truncate(path, size)
        to_parent, from_child = os.pipe()[::-1]
        from_parent, to_child = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            fd = os.open(path, os.O_RDWR)
            mem = mmap.mmap(fd, size, mmap.MAP_SHARED)
            address = ctypes.addressof(ctypes.c_char.from_buffer(mem))
            os.write(to_parent, f"{address:020d}".encode())
            if pause_before_writing:
                os.read(from_parent, 1)
            for offset in range(0, size, 4096):
                mem[offset : offset + 8] = offset.to_bytes(8, "little")
            os.write(to_parent, b"D")
            signal.pause()
            os._exit(0)
        os.close(to_parent)
        os.close(from_parent)
        self._from_child, self._to_child = from_child, to_child
        self.address = int(os.read(from_child, 20))
        self._done = False
        if not pause_before_writing:
            assert os.read(from_child, 1) == b"D"
            self._done = True

    def release(self) -> None:
        os.write(self._to_child, b"G")

    def done(self) -> bool:
        if not self._done:
            os.set_blocking(self._from_child, False)
            try:
                self._done = os.read(self._from_child, 1) == b"D"
            except BlockingIOError:
                pass
        return self._done

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self._from_child)
        os.close(self._to_child)


@pytest.mark.skipif(os.geteuid() != 0, reason="page frame numbers and process_madvise need root")
def test_written_back_chunks_are_dropped_from_the_process_and_their_data_kept(tmp_path):
    # The kernel's flusher may write the file back on its own (another process's
    # dirty data over the background threshold, as on a busy CI host): an attempt
    # it got to first says nothing, so a fresh child tries again.
    for _ in range(5):
        path = tmp_path / "guest.ram"
        child = _Child(path, 8 * MIB)
        try:
            if _write_back_and_page_out(child, path):
                break
        finally:
            child.stop()
    else:
        pytest.fail("the flusher wrote the file back before every one of 5 scans")
    data = path.read_bytes()  # what was dropped is in the file
    assert all(int.from_bytes(data[o : o + 8], "little") == o for o in range(0, 8 * MIB, 4096))


def _write_back_and_page_out(child, path):
    """False if the flusher cleaned chunks before their scan."""
    ram = residency.GuestRam.find(child.pid, 8 * MIB)
    assert ram.address == child.address and ram.path == str(path)
    fds = [os.open(path, os.O_RDONLY), os.pidfd_open(child.pid)]
    fds += [os.open(f"/proc/{child.pid}/pagemap", os.O_RDONLY)]
    fds += [os.open("/proc/kpageflags", os.O_RDONLY)]
    try:
        scan = ram.scan(fds[2], fds[3])
        assert scan.resident == [256] * 8
        assert scan.dirty <= set(range(8))
        if scan.dirty != set(range(8)):  # written, never written back: unless the flusher came
            return False
        ram.write_back(fds[0], [1, 2, 5], wait=True)
        dirty = ram.scan(fds[2], fds[3]).dirty
        assert not dirty & {1, 2, 5}, dirty  # those are clean whatever else happened
        if dirty != {0, 3, 4, 6, 7}:
            return False
        assert ram.page_out(fds[1], [1, 2, 5]) == 3 * MIB
        after = ram.scan(fds[2], fds[3])
        assert after.resident[1] == after.resident[2] == after.resident[5] == 0
        assert after.resident[0] == 256
        return True
    finally:
        for fd in fds:
            os.close(fd)


def test_find_names_a_process_without_such_a_mapping():
    with pytest.raises(LookupError, match="no 3 MiB file mapping"):
        residency.GuestRam.find(os.getpid(), 3 * MIB + 4096)


def test_the_keeper_counts_a_writers_chunks_once_per_write_with_cachestat(tmp_path):
    from agents.agent import cachestat, split_store

    path = tmp_path / "guest.ram"
    child = _Child(path, 8 * MIB, pause_before_writing=True)
    keeper = split_store.ResidencyKeeper(
        split_store.SplitStore(str(tmp_path), str(tmp_path)), "vm", threading.Event()
    )
    ram = residency.GuestRam.find(child.pid, 8 * MIB)
    fds = [os.open(path, os.O_RDONLY), -1, os.open(f"/proc/{child.pid}/pagemap", os.O_RDONLY), -1]
    try:
        if not cachestat.available(fds[0]):
            pytest.skip("this kernel has no cachestat (Linux >= 6.5)")
        state = split_store._Chunks(ages=[0] * 8, writes=[0] * 8)
        keeper._look(ram, fds, state)
        assert state.writes == [0] * 8  # mapped, nothing written yet
        child.release()
        while not child.done():
            time.sleep(0.01)
        scan = keeper._look(ram, fds, state)
        assert scan.resident == [256] * 8  # present bits need no root
        if state.writes != [1] * 8:
            pytest.skip("the kernel's flusher wrote the file back before the look")
        ram.write_back(fds[0], range(8), wait=True)
        keeper._look(ram, fds, state)
        assert state.writes == [1] * 8 and state.dirty == set()
    finally:
        child.stop()
        for fd in fds:
            if fd >= 0:
                os.close(fd)


class _ReaderWriter:
    """A process mapping a file shared: it writes the low half and only reads the high half,
    like an incoming QEMU writing the guest's kernel and comparing zero pages."""

    def __init__(self, path: Path, size: int) -> None:
        path.write_bytes(b"")
        os.truncate(path, size)
        from_child, to_parent = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            mem = mmap.mmap(os.open(path, os.O_RDWR), size, mmap.MAP_SHARED)
            for offset in range(0, size // 2, 4096):
                mem[offset : offset + 8] = offset.to_bytes(8, "little")
            for offset in range(size // 2, size, 4096):
                _ = mem[offset]
            os.write(to_parent, b"D")
            signal.pause()
            os._exit(0)
        os.close(to_parent)
        assert os.read(from_child, 1) == b"D"
        os.close(from_child)

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


class _Usage:
    """A store whose VM is charged what its mapping holds (no cgroup needed)."""

    def __init__(self) -> None:
        self.charge = 0

    def usage(self, vm: str) -> dict[str, int]:
        return {"usage_bytes": self.charge}


def _keeper_on(path: Path, pid: int, mode: int) -> tuple:
    """A keeper over ``pid``'s 8 MiB mapping of ``path``, charged what ``_Usage`` says,
    and the descriptors its steps take (file opened with ``mode``, pidfd, page map)."""
    from agents.agent import split_store

    store = _Usage()
    keeper = split_store.ResidencyKeeper(store, "vm", threading.Event())  # type: ignore[arg-type]
    ram = residency.GuestRam.find(pid, 8 * MIB)
    fds = [os.open(path, mode), os.pidfd_open(pid)]
    fds += [os.open(f"/proc/{pid}/pagemap", os.O_RDONLY), -1]
    return store, keeper, ram, fds


@pytest.mark.skipif(os.geteuid() != 0, reason="process_madvise of another process needs root")
def test_the_keeper_drops_never_written_chunks_before_written_ones_once_ages_are_forgotten(
    tmp_path,
):
    from agents.agent import cachestat, split_store

    path = tmp_path / "guest.ram"
    # The child's page faults and the keeper's MADV_PAGEOUT on one CPU: pages just
    # faulted wait in that CPU's LRU batch, which MADV_PAGEOUT drains only on its own
    # CPU; on another CPU up to a batch of them (seen: 20 pages) stays resident.
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        child = _ReaderWriter(path, 8 * MIB)
    except BaseException:
        os.sched_setaffinity(0, cpus)
        raise
    store, keeper, ram, fds = _keeper_on(path, child.pid, os.O_RDONLY)
    try:
        if not cachestat.available(fds[0]):
            pytest.skip("this kernel has no cachestat (Linux >= 6.5)")
        state = split_store._Chunks(ages=[0] * 8, writes=[0] * 8)
        marks = split_store._Marks(target=6 * MIB, low=4 * MIB)
        for _ in range(9):  # the written half's ages decay to 0 again
            keeper._look(ram, fds, state)
            ram.write_back(fds[0], range(8), wait=True)
        if state.writes != [1, 1, 1, 1, 0, 0, 0, 0]:
            pytest.skip(f"the kernel's flusher cleaned chunks before the first look: {state}")
        assert state.ages == [0] * 8
        store.charge = 8 * MIB  # over the 6 MiB target: down to 4 MiB
        keeper._step(ram, fds, marks, state)
        after = ram.scan(fds[2], None).resident
        assert after == [256] * 4 + [0] * 4  # by age and address alone: the written half
        taken = keeper.stats["dropped_pages_by_class"]
        assert taken == {"never written": 4 * 256, "written once": 0, "rewritten": 0}
    finally:
        os.sched_setaffinity(0, cpus)
        child.stop()
        for fd in fds:
            if fd >= 0:
                os.close(fd)
    data = path.read_bytes()
    assert all(int.from_bytes(data[o : o + 8], "little") == o for o in range(0, 4 * MIB, 4096))


@pytest.mark.skipif(os.geteuid() != 0, reason="process_madvise of another process needs root")
def test_the_keeper_sees_and_drops_the_page_cache_qemu_does_not_map(tmp_path):
    """A fault's readahead caches pages QEMU never maps, charged to the VM all the
    same: a keeper reading QEMU's page map saw none of them (split_trace: 248 MiB
    cached, 7 MiB mapped at a split-50 switchover)."""
    from agents.agent import cachestat, split_store

    path = tmp_path / "guest.ram"
    child = _Child(path, 8 * MIB, pause_before_writing=True)  # maps the file, touches nothing
    store, keeper, ram, fds = _keeper_on(path, child.pid, os.O_RDWR)
    try:
        if not cachestat.available(fds[0]):
            pytest.skip("this kernel has no cachestat (Linux >= 6.5)")
        os.pwrite(fds[0], b"x" * 8 * MIB, 0)  # cached, mapped by no one
        os.fsync(fds[0])
        os.pwrite(fds[0], b"y" * 4 * MIB, 0)  # the low half written again: dirty
        assert ram.scan(fds[2], None).resident == [0] * 8  # QEMU's page map: nothing
        state = split_store._Chunks(ages=[0] * 8, writes=[0] * 8)
        store.charge = 8 * MIB  # over the 6 MiB target: down to 4 MiB
        keeper._step(ram, fds, split_store._Marks(target=6 * MIB, low=4 * MIB), state)
        cached, _dirty = cachestat.chunk_pages(fds[0], 8, MIB)
        assert cached == [256] * 4 + [0] * 4, cached  # the never-written half went
        assert keeper.stats["dropped_bytes"] == 4 * MIB
        assert keeper.stats["dropped_pages_by_class"]["never written"] == 4 * 256
    finally:
        child.stop()
        for fd in fds:
            if fd >= 0:
                os.close(fd)
    assert path.read_bytes() == b"y" * 4 * MIB + b"x" * 4 * MIB  # nothing lost


@pytest.mark.skipif(os.geteuid() != 0, reason="process_madvise of another process needs root")
def test_the_keeper_drops_ahead_of_a_charge_growing_fast(tmp_path):
    """Under the target, but growing faster than the room left between the
    charge and the target: the keeper drops now, and further down than its low
    mark, instead of waiting for the charge to meet the cap."""
    from agents.agent import cachestat, split_store

    path = tmp_path / "guest.ram"
    child = _Child(path, 8 * MIB, pause_before_writing=True)
    store, keeper, ram, fds = _keeper_on(path, child.pid, os.O_RDWR)
    try:
        if not cachestat.available(fds[0]):
            pytest.skip("this kernel has no cachestat (Linux >= 6.5)")
        os.pwrite(fds[0], b"x" * 8 * MIB, 0)
        os.fsync(fds[0])
        state = split_store._Chunks(ages=[0] * 8, writes=[0] * 8)
        marks = split_store._Marks(target=6 * MIB, low=4 * MIB, floor=2 * MIB)
        store.charge = 3 * MIB
        keeper._step(ram, fds, marks, state)
        assert keeper.stats["drops"] == 0
        store.charge = int(5.5 * MIB)  # +2.5 MiB a look: the next would pass the target
        keeper._step(ram, fds, marks, state)
        assert keeper.stats["growth_bytes"] == int(2.5 * MIB)
        assert keeper.stats["drops"] == 1
        # Down to 6 - 2.5 = 3.5 MiB, below the 4 MiB low mark: 2 of the 1 MiB chunks.
        assert keeper.stats["dropped_bytes"] == 2 * MIB
        assert sum(cachestat.chunk_pages(fds[0], 8, MIB)[0]) == 6 * 256
    finally:
        child.stop()
        for fd in fds:
            if fd >= 0:
                os.close(fd)
    assert path.read_bytes() == b"x" * 8 * MIB  # nothing lost


def test_the_keeper_counts_dropped_chunks_read_back_once_the_guest_runs_here(tmp_path):
    """Chunks it dropped that come back after the resume are the guest's reads of
    pages it had not rewritten: each cost a fault on the store (split-35's gap)."""
    from agents.agent import cachestat, split_store

    path = tmp_path / "guest.ram"
    with open(path, "wb") as f:  # all four chunks cached, clean
        f.write(b"z" * 4 * MIB)
        os.fsync(f.fileno())
    keeper = split_store.ResidencyKeeper(
        split_store.SplitStore(str(tmp_path), str(tmp_path)), "vm", threading.Event()
    )
    ram = residency.GuestRam(os.getpid(), 0, 4 * MIB, str(path))
    fds = [os.open(path, os.O_RDONLY), -1, -1, -1]
    try:
        if not cachestat.available(fds[0]):
            pytest.skip("this kernel has no cachestat (Linux >= 6.5)")
        state = split_store._Chunks(ages=[0] * 4, writes=[0, 1, 2, 2], dropped={0, 1})
        keeper._look(ram, fds, state)  # back before the resume: the stream, not the guest
        assert state.dropped == set()
        assert sum(keeper.stats["back_after_resume_chunks"].values()) == 0
        state.dropped = {0, 1, 2}
        keeper._look(ram, fds, state, count_back=True)
        assert keeper.stats["back_after_resume_chunks"] == {
            "never written": 1,
            "written once": 1,
            "rewritten": 1,
        }
    finally:
        os.close(fds[0])


def _dirty_chunks(fd: int, chunks: int, wait_clean: set[int], timeout_s: float = 5.0) -> set[int]:
    """The chunks still dirty once ``wait_clean`` are clean (or the timeout passed)."""
    from agents.agent import cachestat

    deadline = time.monotonic() + timeout_s
    while True:
        dirty = {c for c, n in enumerate(cachestat.chunk_pages(fd, chunks, MIB)[1]) if n}
        if not dirty & wait_clean or time.monotonic() > deadline:
            return dirty
        time.sleep(0.02)


def test_the_keeper_writes_the_chunks_it_keeps_back_only_every_nth_look(tmp_path):
    """The rewritten set and the hinted chunks stay dirty between their looks (their
    folios are rewritten at once anyway); what a drop may take is written at each.
    Halves of 4 MiB: a large folio (up to 2 MiB here) is written back whole."""
    from agents.agent import cachestat, split_store

    path = tmp_path / "guest.ram"
    store = _Usage()  # charged nothing: no drop, writeback only
    keeper = split_store.ResidencyKeeper(store, "vm", threading.Event(), kept_writeback_looks=3)  # type: ignore[arg-type]
    keeper.hint(frozenset({6, 7}))
    ram = residency.GuestRam(os.getpid(), 0, 8 * MIB, str(path))
    fds = [os.open(path, os.O_RDWR | os.O_CREAT), -1, -1, -1]
    kept = {4, 5, 6, 7}
    try:
        if not cachestat.available(fds[0]):
            pytest.skip("this kernel has no cachestat (Linux >= 6.5)")
        os.pwrite(fds[0], b"w" * 8 * MIB, 0)  # cached and dirty, all eight chunks
        state = split_store._Chunks(
            ages=[0] * 8, writes=[1, 1, 0, 1, 2, 2, 1, 1], dirty=set(range(8))
        )
        marks = split_store._Marks(target=16 * MIB, low=12 * MIB)
        keeper.stats["rounds"] = 1  # not a look of the kept chunks
        keeper._step(ram, fds, marks, state)
        # The kernel's own flusher waits for its 30 s dirty expiry: only the keeper writes.
        assert _dirty_chunks(fds[0], 8, {0, 1, 2, 3}) == kept
        keeper.stats["rounds"] = 3
        keeper._step(ram, fds, marks, state)
        assert _dirty_chunks(fds[0], 8, kept) == set()
        assert keeper.stats["kept_writeback_every_looks"] == 3
    finally:
        os.close(fds[0])
