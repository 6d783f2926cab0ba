"""libbpf.lookup_all against real kernel hash maps (root; no lab needed).

The flow table is read ten times a second: lookup_all reads it in chunks of
LOOKUP_BATCH_ENTRIES, and a table fuller than a chunk must come back whole,
every key with its own value.
"""

from __future__ import annotations

import ctypes
import os
import struct

import pytest

from ovs_ext.providers.xdp import libbpf

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creating BPF maps needs root")

BPF_MAP_TYPE_HASH = 1
KEY = struct.Struct("=I")
VALUE = struct.Struct("=QQ")


@pytest.fixture
def hash_map():
    lib = libbpf._lib()
    create = lib.bpf_map_create
    create.restype = ctypes.c_int
    create.argtypes = [ctypes.c_int, ctypes.c_char_p] + [ctypes.c_uint32] * 3 + [ctypes.c_void_p]
    capacity = 3 * libbpf.LOOKUP_BATCH_ENTRIES
    fd = create(BPF_MAP_TYPE_HASH, b"flexmig_test", KEY.size, VALUE.size, capacity, None)
    if fd < 0:
        pytest.skip(f"bpf_map_create refused: {os.strerror(-fd)}")
    yield fd, capacity
    os.close(fd)


def fill(fd: int, count: int) -> None:
    keys = b"".join(KEY.pack(i) for i in range(count))
    values = b"".join(VALUE.pack(i, i * 7) for i in range(count))
    assert libbpf.update_batch(fd, keys, values, count) == (count, 0)


def read_back(fd: int, capacity: int) -> dict[int, tuple[int, int]]:
    keys, values, count = libbpf.lookup_all(fd, KEY.size, VALUE.size, capacity)
    assert len(keys) == count * KEY.size and len(values) == count * VALUE.size
    return {
        KEY.unpack_from(keys, i * KEY.size)[0]: VALUE.unpack_from(values, i * VALUE.size)
        for i in range(count)
    }


@pytest.mark.parametrize(
    "entries",
    [0, 1, libbpf.LOOKUP_BATCH_ENTRIES, libbpf.LOOKUP_BATCH_ENTRIES + 1, 10_000],
)
def test_lookup_all_returns_every_entry_across_chunks(hash_map, entries):
    fd, capacity = hash_map
    fill(fd, entries)
    table = read_back(fd, capacity)
    assert table == {i: (i, i * 7) for i in range(entries)}
