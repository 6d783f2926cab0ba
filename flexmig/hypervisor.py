"""libvirt access with errors wrapped, so raw libvirtError never leaks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import libvirt

from flexmig import exceptions


def _silence(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; we raise them instead."""


libvirt.registerErrorHandler(_silence, None)


@contextlib.contextmanager
def wrap_errors(host: str, action: str) -> Iterator[None]:
    try:
        yield
    except libvirt.libvirtError as exc:
        raise exceptions.HypervisorError(
            host=host, action=action, reason=exc.get_error_message() or str(exc)
        ) from exc


@contextlib.contextmanager
def connect(uri: str, host: str) -> Iterator[libvirt.virConnect]:
    with wrap_errors(host, f"connect ({uri})"):
        conn = libvirt.open(uri)
    try:
        yield conn
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            conn.close()


def find_domain(conn: libvirt.virConnect, name: str) -> libvirt.virDomain | None:
    try:
        return conn.lookupByName(name)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            return None
        raise
