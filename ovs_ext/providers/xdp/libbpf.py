"""The few libbpf calls the XDP eSwitch needs, through ctypes.

Why ctypes over libbpf rather than a C loader or bpftool: the provider lives
in a long-running Python process that must write 100k map entries and read
them back in well under a second.  ``BPF_MAP_*_BATCH`` moves a whole batch per
syscall, and calling it in-process avoids a fork/exec and a serialisation
round trip per operation; bpftool per entry is orders of magnitude slower.
Loading and attaching go through the same library (``bpf_object__*``,
``bpf_xdp_attach``), so one process holds every fd and errors become
:class:`BpfError` with the failing call named.

Every function returns plain Python values or raises :class:`BpfError`
(negative errno from libbpf); no ctypes object leaks to callers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

from flexmig import exceptions

XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
# Entries per BPF_MAP_LOOKUP_BATCH call of lookup_all.
LOOKUP_BATCH_ENTRIES = 4096


class BpfError(exceptions.FlexMigError):
    msg_fmt = "libbpf %(call)s failed: %(reason)s"

    @property
    def errno(self) -> int:
        return int(self.kwargs.get("errno", 0))  # type: ignore[call-overload]


def _fail(call: str, err: int) -> BpfError:
    err = abs(err)
    return BpfError(call=call, reason=f"{os.strerror(err)} (errno {err})", errno=err)


@functools.cache
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise exceptions.MissingPrerequisite(
            what="libbpf", hint=f"{exc}; install libbpf1 (tools/setup.sh)"
        ) from exc
    p, i, u32, cp = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_char_p
    u32p = ctypes.POINTER(u32)
    signatures = {
        "bpf_object__open_file": (p, [cp, p]),
        "bpf_object__load": (i, [p]),
        "bpf_object__close": (None, [p]),
        "bpf_object__find_map_by_name": (p, [p, cp]),
        "bpf_object__find_program_by_name": (p, [p, cp]),
        "bpf_map__set_max_entries": (i, [p, u32]),
        "bpf_map__set_pin_path": (i, [p, cp]),
        "bpf_map__fd": (i, [p]),
        "bpf_program__fd": (i, [p]),
        "bpf_program__pin": (i, [p, cp]),
        "bpf_obj_get": (i, [cp]),
        "bpf_xdp_attach": (i, [i, i, u32, p]),
        "bpf_xdp_detach": (i, [i, u32, p]),
        "bpf_xdp_query_id": (i, [i, i, u32p]),
        "bpf_map_update_elem": (i, [i, p, p, ctypes.c_uint64]),
        "bpf_map_lookup_elem": (i, [i, p, p]),
        "bpf_map_delete_elem": (i, [i, p]),
        "bpf_map_get_next_key": (i, [i, p, p]),
        "bpf_map_lookup_and_delete_elem": (i, [i, p, p]),
        "bpf_map_update_batch": (i, [i, p, p, u32p, p]),
        "bpf_map_delete_batch": (i, [i, p, u32p, p]),
        "bpf_map_lookup_batch": (i, [i, p, p, p, p, u32p, p]),
        "libbpf_num_possible_cpus": (i, []),
    }
    for fname, (restype, argtypes) in signatures.items():
        fn = getattr(lib, fname)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def _check(call: str, rc: int) -> int:
    if rc < 0:  # libbpf 1.x returns -errno
        raise _fail(call, -rc)
    return rc


def possible_cpus() -> int:
    return _check("libbpf_num_possible_cpus", _lib().libbpf_num_possible_cpus())


def obj_get(path: str) -> int:
    """An fd for a pinned map or program."""
    return _check(f"bpf_obj_get({path})", _lib().bpf_obj_get(path.encode()))


def load_object(
    path: str, max_entries: dict[str, int], pins: dict[str, str], program: str, prog_pin: str
) -> None:
    """Open, size, load and pin an object; every fd stays reachable through bpffs.

    Maps named in ``pins`` reuse an existing compatible pin (libbpf's own
    rule), so a restarted provider finds the flows it left.  The object is
    closed afterwards: pins and XDP attachments hold the references.
    """
    lib = _lib()
    obj = lib.bpf_object__open_file(path.encode(), None)
    if not obj:
        raise _fail(f"bpf_object__open_file({path})", ctypes.get_errno() or errno.EINVAL)
    try:
        for name, entries in max_entries.items():
            _check(
                f"bpf_map__set_max_entries({name})",
                lib.bpf_map__set_max_entries(_find_map(obj, name), entries),
            )
        for name, pin in pins.items():
            _check(
                f"bpf_map__set_pin_path({name})",
                lib.bpf_map__set_pin_path(_find_map(obj, name), pin.encode()),
            )
        _check(f"bpf_object__load({path})", lib.bpf_object__load(obj))
        prog = lib.bpf_object__find_program_by_name(obj, program.encode())
        if not prog:
            raise _fail(f"bpf_object__find_program_by_name({program})", errno.ENOENT)
        _check(f"bpf_program__pin({prog_pin})", lib.bpf_program__pin(prog, prog_pin.encode()))
    finally:
        lib.bpf_object__close(obj)


def _find_map(obj: int, name: str) -> int:
    found = _lib().bpf_object__find_map_by_name(obj, name.encode())
    if not found:
        raise _fail(f"bpf_object__find_map_by_name({name})", errno.ENOENT)
    return found


def xdp_attach(ifindex: int, prog_fd: int, flags: int) -> None:
    _check(
        f"bpf_xdp_attach(ifindex {ifindex})", _lib().bpf_xdp_attach(ifindex, prog_fd, flags, None)
    )


def xdp_detach(ifindex: int, flags: int) -> None:
    _check(f"bpf_xdp_detach(ifindex {ifindex})", _lib().bpf_xdp_detach(ifindex, flags, None))


def xdp_query_id(ifindex: int, flags: int) -> int:
    """The id of the XDP program attached in that mode, 0 if none."""
    prog_id = ctypes.c_uint32(0)
    _check(
        f"bpf_xdp_query_id(ifindex {ifindex})",
        _lib().bpf_xdp_query_id(ifindex, flags, ctypes.byref(prog_id)),
    )
    return prog_id.value


def update_elem(fd: int, key: bytes, value: bytes) -> None:
    _check("bpf_map_update_elem", _lib().bpf_map_update_elem(fd, key, value, 0))


def delete_elem(fd: int, key: bytes) -> bool:
    """Delete one key; False if it was not there."""
    rc = _lib().bpf_map_delete_elem(fd, key)
    if rc == -errno.ENOENT:
        return False
    _check("bpf_map_delete_elem", rc)
    return True


def lookup_and_delete_elem(fd: int, key: bytes, value_size: int) -> bytes | None:
    buf = ctypes.create_string_buffer(value_size)
    rc = _lib().bpf_map_lookup_and_delete_elem(fd, key, buf)
    if rc == -errno.ENOENT:
        return None
    _check("bpf_map_lookup_and_delete_elem", rc)
    return buf.raw


def keys(fd: int, key_size: int) -> list[bytes]:
    """Every key of a (small) map, by get_next_key."""
    lib = _lib()
    found: list[bytes] = []
    prev = None
    nxt = ctypes.create_string_buffer(key_size)
    while True:
        rc = lib.bpf_map_get_next_key(fd, prev, nxt)
        if rc == -errno.ENOENT:
            return found
        _check("bpf_map_get_next_key", rc)
        found.append(nxt.raw)
        prev = ctypes.create_string_buffer(nxt.raw, key_size)


def update_batch(fd: int, keys_blob: bytes, values_blob: bytes, count: int) -> tuple[int, int]:
    """Write ``count`` packed entries; returns (entries written, errno or 0).

    The kernel stops at the first entry it refuses and reports how many it
    wrote before it, so the caller can name that entry and go on past it.
    """
    done = ctypes.c_uint32(count)
    rc = _lib().bpf_map_update_batch(fd, keys_blob, values_blob, ctypes.byref(done), None)
    if rc == 0:
        return count, 0
    return done.value, abs(rc)


def delete_batch(fd: int, keys_blob: bytes, count: int) -> tuple[int, int]:
    done = ctypes.c_uint32(count)
    rc = _lib().bpf_map_delete_batch(fd, keys_blob, ctypes.byref(done), None)
    if rc == 0:
        return count, 0
    return done.value, abs(rc)


def lookup_all(fd: int, key_size: int, value_size: int, capacity: int) -> tuple[bytes, bytes, int]:
    """Every (key, value) of a hash map in a few batch syscalls.

    Returns the packed keys, the packed values and how many entries there
    are.  ``value_size`` is the userspace value size (per-CPU maps: the
    rounded-up value times the possible CPUs).
    """
    lib = _lib()
    # The buffers are zero-filled at every call, ten times a second on an
    # idle host: sized to the whole table (65,536 entries, 4.4 MiB) they cost
    # 6 ms of CPU per poll; a map fuller than a chunk takes a few more calls.
    chunk = max(1, min(capacity, LOOKUP_BATCH_ENTRIES))
    keys_buf = ctypes.create_string_buffer(key_size * chunk)
    values_buf = ctypes.create_string_buffer(value_size * chunk)
    token_in = ctypes.create_string_buffer(max(key_size, 8))
    token_out = ctypes.create_string_buffer(max(key_size, 8))
    out_keys: list[bytes] = []
    out_values: list[bytes] = []
    total = 0
    first = True
    while True:
        count = ctypes.c_uint32(chunk)
        rc = lib.bpf_map_lookup_batch(
            fd,
            None if first else token_in,
            token_out,
            keys_buf,
            values_buf,
            ctypes.byref(count),
            None,
        )
        if rc < 0 and rc != -errno.ENOENT:
            raise _fail("bpf_map_lookup_batch", -rc)
        n = count.value
        # string_at copies the n entries only (.raw copies the whole buffer first).
        out_keys.append(ctypes.string_at(keys_buf, n * key_size))
        out_values.append(ctypes.string_at(values_buf, n * value_size))
        total += n
        if rc == -errno.ENOENT:
            return b"".join(out_keys), b"".join(out_values), total
        ctypes.memmove(token_in, token_out, len(token_out))
        first = False
