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
    """The caller asked for something malformed or impossible; nothing was changed."""

    msg_fmt = "Invalid %(what)s: %(reason)s"


class NotFound(InvalidInput):
    msg_fmt = "There is no %(what)s %(name)r"


class PolicyRefused(FlexMigError):
    """The input was fine, but FlexMig's policy will not migrate this VM this way.

    ``reasons`` holds each reason on its own, for callers that show them as a
    list (the agent API answers 409 with them).
    """

    msg_fmt = "FlexMig refuses to migrate %(vm)s: %(reason)s"

    def __init__(self, vm: str, reasons: list[str] | tuple[str, ...]) -> None:
        self.vm = vm
        self.reasons = tuple(reasons)
        super().__init__(vm=vm, reason="; ".join(self.reasons))


class BackendError(FlexMigError):
    """Something FlexMig relies on (libvirt, an agent, a command) failed; wrapped."""

    msg_fmt = "%(backend)s failed: %(reason)s"


class InternalError(FlexMigError):
    """A bug in FlexMig: reported as such, never taken for a backend failure."""

    msg_fmt = "Internal error while %(action)s (a bug in FlexMig, please report it): %(error)s"


class CommandFailed(BackendError):
    msg_fmt = "Command %(cmd)s failed (exit %(rc)s): %(stderr)s"


class Timeout(BackendError):
    msg_fmt = "Timed out after %(seconds).1f s waiting for %(what)s"


class HypervisorError(BackendError):
    msg_fmt = "libvirt on %(host)s failed to %(action)s: %(reason)s"


class GuestError(FlexMigError):
    msg_fmt = "Guest %(vm)s: %(reason)s"


class MissingPrerequisite(FlexMigError):
    msg_fmt = "%(what)s is missing: %(hint)s"
