"""libvirt access with errors wrapped, so raw libvirtError never leaks."""

from __future__ import annotations

import contextlib
import threading
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


def start_migration(
    dom: libvirt.virDomain, host: str, dest_uri: str, params: dict[str, object], flags: int
) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``migrateToURI3`` in a worker thread, so the caller can watch the job.

    The caller joins the thread and finds any error, already wrapped, in the list.
    """
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            with wrap_errors(host, f"migrate {dom.name()} to {dest_uri}"):
                dom.migrateToURI3(dest_uri, params, flags)
        except BaseException as exc:  # noqa: BLE001 - handed to the watching thread
            errors.append(exc)

    worker = threading.Thread(target=migrate, name="migration", daemon=True)
    worker.start()
    return worker, errors
