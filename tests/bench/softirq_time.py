"""Exact time in the network softirqs, machine-wide, for the datapath benchmark.

/proc/stat's softirq column is tick-sampled (250 Hz, no IRQ time accounting
in this kernel), while a NAPI thread's CPU is its exact scheduler runtime. A
path polled in softirq and one polled in threads are only comparable if both
are timed exactly, so :class:`SoftirqClock` times the NET_TX / NET_RX handlers
themselves with a BPF program on the ``irq:softirq_entry/exit`` tracepoints
(``bpf/softirq_time.bpf.c``, built by tools/setup.sh).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from flexmig import exceptions
from ovs_ext.providers.xdp import libbpf
from tests.bench import tracefs

SOURCE = Path(__file__).resolve().parent / "bpf" / "softirq_time.bpf.c"
OBJECT = SOURCE.parent / "build" / "softirq_time.bpf.o"
PROGRAMS = ("softirq_entry", "softirq_exit")
TRACEPOINTS = ("irq/softirq_entry", "irq/softirq_exit")
SLOT_NET_NS, SLOT_OTHER_NS = 1, 2


def built_object() -> Path:
    """The BPF object tools/setup.sh builds (tests/bench/bpf/Makefile)."""
    if not OBJECT.is_file():
        raise exceptions.MissingPrerequisite(
            what=str(OBJECT), hint="run tools/setup.sh (it builds the benchmarks' BPF objects)"
        )
    return OBJECT


def require_tracepoints() -> None:
    """Mount tracefs if needed; a clear error naming what is missing otherwise.

    libbpf attaches a tracepoint program by the event's id, read from tracefs:
    without it, the attach fails with a bare ENOENT.
    """
    events = tracefs.ensure_mounted() / "events"
    for name in TRACEPOINTS:
        if not (events / name / "id").is_file():
            raise exceptions.MissingPrerequisite(
                what=f"the kernel tracepoint {name}", hint=f"not listed under {events}"
            )


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = libbpf._lib()  # the provider's libbpf handle
    lib.bpf_program__attach.restype = ctypes.c_void_p
    lib.bpf_program__attach.argtypes = [ctypes.c_void_p]
    lib.bpf_link__destroy.restype = ctypes.c_int
    lib.bpf_link__destroy.argtypes = [ctypes.c_void_p]
    lib.libbpf_get_error.restype = ctypes.c_long
    lib.libbpf_get_error.argtypes = [ctypes.c_void_p]
    return lib


class SoftirqClock:
    """Attached while open; :meth:`seconds` is the network softirq time so far."""

    def __enter__(self) -> SoftirqClock:
        require_tracepoints()
        lib = _lib()
        path = str(built_object()).encode()
        self._obj = lib.bpf_object__open_file(path, None)
        if not self._obj:
            raise libbpf.BpfError(call="bpf_object__open_file", reason=str(OBJECT))
        self._links: list[int] = []
        try:
            libbpf._check("bpf_object__load", lib.bpf_object__load(self._obj))
            for name in PROGRAMS:
                prog = lib.bpf_object__find_program_by_name(self._obj, name.encode())
                link = lib.bpf_program__attach(prog)
                if not link or lib.libbpf_get_error(link):
                    raise libbpf.BpfError(call=f"bpf_program__attach({name})", reason="failed")
                self._links.append(link)
            found = lib.bpf_object__find_map_by_name(self._obj, b"softirq_ns")
            self._map_fd = libbpf._check("bpf_map__fd", lib.bpf_map__fd(found))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        lib = _lib()
        for link in self._links:
            lib.bpf_link__destroy(link)
        self._links = []
        if self._obj:
            lib.bpf_object__close(self._obj)
            self._obj = None

    def seconds(self, slot: int = SLOT_NET_NS) -> float:
        """The slot's nanoseconds summed over every CPU, in seconds."""
        cpus = libbpf.possible_cpus()
        values = (ctypes.c_uint64 * cpus)()
        key = ctypes.c_uint32(slot)
        libbpf._check(
            "bpf_map_lookup_elem(softirq_ns)",
            libbpf._lib().bpf_map_lookup_elem(self._map_fd, ctypes.byref(key), values),
        )
        return sum(values) / 1e9
