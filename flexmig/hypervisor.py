"""libvirt access with errors wrapped, so raw libvirtError never leaks."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import libvirt

from flexmig import exceptions


def _silence(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; we raise them instead."""


libvirt.registerErrorHandler(_silence, None)

T = TypeVar("T")


def bounded(call: Callable[[], T], seconds: float, what: str) -> T:
    """One libvirt call that returns, raises its own error, or times out.

    libvirt's client waits for a reply without limit, and libvirtd waits for
    QEMU's monitor without limit, so a daemon or QEMU that stops answering
    would hold the caller for ever.  The call runs in a daemon thread; past
    ``seconds`` the caller gets ``Timeout`` and decides what to do.  A libvirt
    call cannot be cancelled: a stuck one is left to end, or to go with the
    process.
    """
    outcome: list[object] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)

    worker = threading.Thread(target=run, name=f"libvirt: {what}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise exceptions.Timeout(seconds=seconds, what=what)
    if failure:
        raise failure[0]
    return outcome[0]  # type: ignore[return-value]


# libvirt's text when a call waited 30 s for a domain's job held by a
# migration call (libvirt 9.0: "... (held by monitor=remoteDispatchDomainMigratePerform3Params)").
HELD_BY_MIGRATION = re.compile(r"cannot acquire state change lock \(held by [^)]*Migrat")
HELD_BY_MIGRATION_ADVICE = (
    "a migration call still holds this VM's job in libvirt on this host (one that outlived "
    "its interruption, e.g. after the link to the destination broke): it ends when libvirt "
    "gives up on the destination, or restart libvirtd on this host (running domains are kept)"
)


def reason_of(message: str) -> str:
    """libvirt's message, with what to do where libvirt's own leaves it out.

    >>> reason_of("Requested operation is not valid: domain is not running")
    'Requested operation is not valid: domain is not running'
    >>> reason_of("Timed out during operation: cannot acquire state change lock "
    ...           "(held by monitor=remoteDispatchDomainMigratePerform3Params)").endswith(
    ...     "restart libvirtd on this host (running domains are kept)")
    True
    """
    if HELD_BY_MIGRATION.search(message):
        return f"{message}; {HELD_BY_MIGRATION_ADVICE}"
    return message


@contextlib.contextmanager
def wrap_errors(host: str, action: str) -> Iterator[None]:
    try:
        yield
    except libvirt.libvirtError as exc:
        raise exceptions.HypervisorError(
            host=host, action=action, reason=reason_of(exc.get_error_message() or str(exc))
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
    dom: libvirt.virDomain,
    host: str,
    dest_uri: str,
    params: dict[str, object],
    flags: int,
    source_uri: str = "",
) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``migrateToURI3`` in a worker thread, so the caller can watch the job.

    With ``source_uri`` the call runs on a libvirt connection of its own: the
    watcher's calls (statistics, the postcopy switch, abort) then never share
    an RPC connection with a call that lasts the whole migration.
    The caller joins the thread and finds any error, already wrapped, in the list.
    """
    errors: list[BaseException] = []
    name = dom.name()

    def migrate() -> None:
        try:
            if not source_uri:
                with wrap_errors(host, f"migrate {name} to {dest_uri}"):
                    dom.migrateToURI3(dest_uri, params, flags)
                return
            with connect(source_uri, host) as conn:
                with wrap_errors(host, f"migrate {name} to {dest_uri}"):
                    conn.lookupByName(name).migrateToURI3(dest_uri, params, flags)
        except BaseException as exc:  # noqa: BLE001 - handed to the watching thread
            errors.append(exc)

    worker = threading.Thread(target=migrate, name="migration", daemon=True)
    worker.start()
    return worker, errors
