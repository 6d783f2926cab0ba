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
