"""The ``cachestat`` system call: a file range's page-cache state, counted by the kernel.

Linux 6.5 added it.  For a range of a file it says how many pages are
cached, dirty (written since their last writeback), under writeback, and
evicted.  The residency keeper asks it per 1 MiB chunk of a split VM's
memory file to count which chunks the incoming stream and the guest write,
exactly and cheaply; before it, the keeper sampled eight pages per chunk in
``/proc/kpageflags`` (root only, and a sample can miss a page).

Recent kernels answer only a caller that may write the file or owns it (a
fix against using it as a side channel); the agent runs as root, a unit
test uses its own file.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import platform

# Its number in the generic system-call table, which x86_64 shares for it.
SYS_CACHESTAT = 451
_MACHINES = ("x86_64", "aarch64", "arm64", "riscv64")
# Errors that say "this kernel or file cannot answer" (no such call, not
# allowed, a hugetlbfs file), not "the call was wrong".
_UNSUPPORTED = (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP)

_LIBC = ctypes.CDLL(None, use_errno=True)
_SYSCALL = _LIBC.syscall


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


@dataclasses.dataclass(frozen=True)
class CacheStat:
    """Pages of a file range: cached, dirty, under writeback, evicted (and lately so)."""

    nr_cache: int
    nr_dirty: int
    nr_writeback: int
    nr_evicted: int
    nr_recently_evicted: int


def _machine_has_it() -> None:
    if platform.machine() not in _MACHINES:
        raise OSError(errno.ENOSYS, f"cachestat's number is not known on {platform.machine()}")


def _call(fd: int, rng: _Range, out: _Stat) -> None:
    if _SYSCALL(SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cachestat: {os.strerror(err)}")


def cachestat(fd: int, offset: int, length: int) -> CacheStat:
    """The page-cache state of ``length`` bytes of ``fd`` from ``offset`` (0: to the end)."""
    _machine_has_it()
    out = _Stat()
    _call(fd, _Range(offset, length), out)
    return CacheStat(*(getattr(out, name) for name, _ in _Stat._fields_))


def available(fd: int) -> bool:
    """Whether this kernel answers cachestat for ``fd`` (else: sample page flags instead)."""
    try:
        cachestat(fd, 0, 0)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    return True


def chunk_pages(fd: int, chunks: int, chunk_bytes: int) -> tuple[list[int], list[int]]:
    """Cached and dirty pages in each of the first ``chunks`` chunks of the file.

    Cached counts what the page cache holds whether or not a process maps it:
    what the VM's memory cgroup is charged for.  One call per chunk, reusing
    its buffers: 1,024 chunks (a 1 GiB guest) every keeper interval.
    """
    _machine_has_it()
    rng, out = _Range(0, chunk_bytes), _Stat()
    cached, dirty = [], []
    for chunk in range(chunks):
        rng.off = chunk * chunk_bytes
        _call(fd, rng, out)
        cached.append(out.nr_cache)
        dirty.append(out.nr_dirty)
    return cached, dirty
