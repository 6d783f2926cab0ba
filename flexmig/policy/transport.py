"""Which transport carries a migration's stream: QEMU's own TCP, or the movers."""

from __future__ import annotations

import dataclasses

from flexmig import exceptions

TRANSPORTS = ("auto", "qemu-tcp", "mover")


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    transport: str
    reason: str


def choose_transport(requested: str, rdma_both_ends: bool, tcp_default: str) -> TransportChoice:
    """auto: the mover where both ends have an RDMA provider, else ``tcp_default``.

    ``tcp_default`` is what the transport benchmark showed faster on TCP-only
    fabrics (docs/benchmarks/mover.md); it is configuration, not a guess.

    >>> choose_transport("auto", True, "qemu-tcp").transport
    'mover'
    >>> choose_transport("auto", False, "qemu-tcp").reason
    'TCP-only fabric: qemu-tcp measured faster there (docs/benchmarks/mover.md)'
    """
    if requested not in TRANSPORTS:
        raise exceptions.InvalidInput(
            what="transport", reason=f"{requested!r} not one of {', '.join(TRANSPORTS)}"
        )
    if requested != "auto":
        return TransportChoice(requested, f"{requested} was requested")
    if rdma_both_ends:
        return TransportChoice(
            "mover",
            "both ends have an RDMA provider (verbs;ofi_rxm): "
            "the mover offloads the copy to the NICs",
        )
    return TransportChoice(
        tcp_default,
        f"TCP-only fabric: {tcp_default} measured faster " "there (docs/benchmarks/mover.md)",
    )


def preempt_conflict(
    transport: TransportChoice, transfer: str, preempt: str
) -> TransportChoice | None:
    """QEMU's own TCP instead of the mover where libvirt may turn postcopy-preempt on.

    libvirt (10.0 on) turns QEMU's postcopy-preempt on by itself for every
    postcopy migration both ends support, with no flag to refuse it.  At the
    switch the source QEMU then opens a second connection to the migration
    URI; the mover serves one connection per socket, so the switch fails
    ("postcopy_start: Failed to establish preempt channel ... Connection
    refused").  ``preempt``: the pair's ``feature_matrix`` state ('yes',
    'no: why', 'unknown: why'); an unknown host may turn it on too.  None:
    no conflict, the choice stands.

    >>> mover = TransportChoice("mover", "mover was requested")
    >>> preempt_conflict(mover, "postcopy", "yes").transport
    'qemu-tcp'
    >>> preempt_conflict(mover, "precopy", "yes") is None
    True
    >>> preempt_conflict(mover, "postcopy", "no: source needs libvirt 10.0.0") is None
    True
    >>> preempt_conflict(TransportChoice("qemu-tcp", "asked"), "postcopy", "yes") is None
    True
    """
    if transport.transport != "mover" or transfer != "postcopy" or preempt.startswith("no"):
        return None
    why = (
        "libvirt turns QEMU's postcopy-preempt on by itself between these hosts"
        if preempt == "yes"
        else f"libvirt may turn QEMU's postcopy-preempt on ({preempt.split(': ', 1)[-1]})"
    )
    return TransportChoice(
        "qemu-tcp",
        f"instead of the mover ({transport.reason}): the plan switches to postcopy and {why}; "
        "its second connection, opened at the switch, has no place on the mover's single "
        "socket and the switch would fail",
    )
