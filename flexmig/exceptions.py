"""One exception base for all of FlexMig.

Every error is built from a message format, so the text a user sees names what
failed and, where it helps, what to do about it.  Backend errors (libvirt,
OVSDB, netlink, subprocesses) are wrapped into these before they leave a public
entry point.
"""

from __future__ import annotations


class FlexMigError(Exception):
    msg_fmt = "An unknown FlexMig error occurred."

    def __init__(self, message: str | None = None, **kwargs: object) -> None:
        self.kwargs = kwargs
        if message is None:
            try:
                message = self.msg_fmt % kwargs
            except (KeyError, TypeError):
                message = f"{self.msg_fmt} {kwargs!r}"
        self.message = message
        super().__init__(message)


class InvalidInput(FlexMigError):
    msg_fmt = "Invalid %(what)s: %(reason)s"


class CommandFailed(FlexMigError):
    msg_fmt = "Command %(cmd)s failed (exit %(rc)s): %(stderr)s"


class Timeout(FlexMigError):
    msg_fmt = "Timed out after %(seconds).1f s waiting for %(what)s"


class HypervisorError(FlexMigError):
    msg_fmt = "libvirt on %(host)s failed to %(action)s: %(reason)s"


class GuestError(FlexMigError):
    msg_fmt = "Guest %(vm)s: %(reason)s"


class MissingPrerequisite(FlexMigError):
    msg_fmt = "%(what)s is missing: %(hint)s"
