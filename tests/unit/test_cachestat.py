"""The cachestat wrapper against a file of the test's own (no root needed)."""

from __future__ import annotations

import mmap
import os

import pytest

from agents.agent import cachestat

MIB = 1 << 20
PAGE = 4096


@pytest.fixture
def own_file(tmp_path):
    fd = os.open(tmp_path / "guest.ram", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4 * MIB)
    if not cachestat.available(fd):
        os.close(fd)
        pytest.skip("this kernel has no cachestat (Linux >= 6.5 on x86_64/arm64/riscv64)")
    yield fd
    os.close(fd)


def test_pages_written_through_a_shared_mapping_are_counted_dirty_per_chunk(own_file):
    mem = mmap.mmap(own_file, 4 * MIB, mmap.MAP_SHARED)
    try:
        mem[0:PAGE] = b"a" * PAGE  # chunk 0: one page
        for offset in range(2 * MIB, 2 * MIB + 10 * PAGE, PAGE):  # chunk 2: ten pages
            mem[offset : offset + 1] = b"b"
        _ = mem[3 * MIB]  # chunk 3: read only
        cached, dirty = cachestat.chunk_pages(own_file, 4, MIB)
        if dirty == [0, 0, 0, 0]:
            pytest.skip("the kernel's flusher wrote the file back before the look")
        assert dirty == [1, 0, 10, 0]
        assert cached[0] >= 1 and cached[2] >= 10 and cached[3] >= 1  # read pages are cached
        os.fsync(own_file)
        assert cachestat.chunk_pages(own_file, 4, MIB)[1] == [0, 0, 0, 0]
        assert cachestat.cachestat(own_file, 2 * MIB, MIB).nr_cache >= 10
    finally:
        mem.close()


def test_a_hole_only_read_is_cached_but_never_dirty(own_file):
    mem = mmap.mmap(own_file, 4 * MIB, mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        assert mem[MIB + 5] == 0
        stat = cachestat.cachestat(own_file, MIB, MIB)
        assert stat.nr_cache >= 1 and stat.nr_dirty == 0
    finally:
        mem.close()


def test_a_closed_descriptor_is_an_error_not_a_missing_system_call(own_file, tmp_path):
    fd = os.open(tmp_path / "x", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    with pytest.raises(OSError, match="cachestat"):
        cachestat.available(fd)
