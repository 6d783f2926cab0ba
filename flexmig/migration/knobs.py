"""QEMU's and libvirt's migration knobs, chosen per VM: pure functions, no I/O.

The mode says how pages move; the knobs say how well.  Each knob is chosen
from the same evidence as the mode (the decision, the link, the hosts' CPUs)
and from what both hosts' libvirt and QEMU support (``FEATURES``, the feature
matrix ``flexmig explain`` shows).  A knob a host lacks is not used and the
plan says so: production hosts run a mix of versions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

MIB = 2**20
# libvirt's flag bits its Python binding may predate (libvirt-domain.h).
VIR_MIGRATE_COMPRESSED = 1 << 11
VIR_MIGRATE_PARALLEL = 1 << 17
VIR_MIGRATE_ZEROCOPY = 1 << 20
# Proposed for libvirt 10.0 (devel list, 2023-12) but never merged: the lab's
# libvirt 11.3 refuses it ("unsupported flags (0x200000)").  libvirt 10.0
# instead turns QEMU's postcopy-preempt on by itself for every postcopy
# migration both ends support (its NEWS for 10.0).  Never sent; listed so a
# caller's flags (Nova's) are stripped of it.
VIR_MIGRATE_POSTCOPY_PREEMPT = 1 << 21
# Typed-parameter names (strings: the binding needs no constant for them).
PARAM_PARALLEL_CONNECTIONS = "parallel.connections"
PARAM_COMPRESSION = "compression"
PARAM_AVAIL_SWITCHOVER = "bandwidth.avail.switchover"  # MiB/s, libvirt 11.1
# One multifd channel's rate on one core (QEMU copies and checksums pages):
# past it a single stream leaves the link idle.  Nova and KubeVirt measured
# 10-25 Gb/s links needing 4-8 channels.
CHANNEL_BPS = 1000.0 * MIB
# zstd level 1 on one core, guest pages (mixed zero, text, random): what a
# channel compresses; below that rate of link the CPU, not the link, limits.
ZSTD_BPS_PER_CORE = 400.0 * MIB
ZSTD_RATIO = 2.0  # what the lab's guests' pages compress to, conservatively
# Channels a file-backed VM's precopy gets even where one stream fills the
# path (choose_parallel; docs/benchmarks/split-parallel.md).
FILE_BACKED_CHANNELS = 2
# Zero-copy send saves the kernel's copy of each page: it pays where copying
# is what holds the stream back, links of 10 Gb/s and more.
ZEROCOPY_MIN_BPS = 1200.0 * MIB
# The switchover hint is the probed path; below this the probe says little.
MIN_HINT_BPS = 8.0 * MIB
# The libvirt whose postcopy resume works with QEMU >= 9.1 (its source side
# passes through postcopy-recover-setup): 11.0's NEWS fixes "a failure to
# recover post-copy migration even though the recovery started just fine";
# the lab saw 9.0 fail and 11.3 resume.
RECOVER_SETUP_LIBVIRT = 11_000_000


def version_text(number: int) -> str:
    """libvirt's version encoding as text.

    >>> version_text(11_003_000)
    '11.3.0'
    >>> version_text(0)
    'unknown'
    """
    if number <= 0:
        return "unknown"
    return f"{number // 1_000_000}.{number // 1000 % 1000}.{number % 1000}"


@dataclasses.dataclass(frozen=True)
class HostSoftware:
    """One host's libvirt and QEMU versions (libvirt's encoding; 0: unknown)."""

    libvirt: int = 0
    qemu: int = 0

    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> HostSoftware:
        """From an agent's ``/v1/facts`` (an older agent reports none: unknown)."""
        try:
            return cls(int(facts.get("libvirt_version") or 0), int(facts.get("qemu_version") or 0))
        except (TypeError, ValueError):
            return cls()

    def describe(self) -> str:
        return f"libvirt {version_text(self.libvirt)}, QEMU {version_text(self.qemu)}"


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    libvirt: int | None  # first libvirt release with the knob; None: libvirt has none
    qemu: int
    what: str
    absent: str = "libvirt has no migration knob for it"  # why, where libvirt is None
    # (QEMU release, libvirt release): from that QEMU on, the feature needs that
    # libvirt, one that knows what the newer QEMU does.
    newer_qemu: tuple[int, int] | None = None

    def missing(self, host: HostSoftware) -> str | None:
        """What this host lacks for the feature, or None.

        >>> recovery = FEATURES["postcopy-recovery"]
        >>> recovery.missing(HostSoftware(9_000_000, 10_000_002))
        'needs libvirt 11.0.0 with QEMU 9.1.0 or later'
        >>> recovery.missing(HostSoftware(9_000_000, 7_002_000)) is None
        True
        >>> recovery.missing(HostSoftware(11_003_000, 10_000_002)) is None
        True
        """
        if self.libvirt is None:
            return self.absent
        lacks = []
        if host.libvirt < self.libvirt:
            lacks.append(f"libvirt {version_text(self.libvirt)}")
        if host.qemu < self.qemu:
            lacks.append(f"QEMU {version_text(self.qemu)}")
        if self.newer_qemu and host.qemu >= self.newer_qemu[0] > 0:
            qemu, libvirt = self.newer_qemu
            if host.libvirt < libvirt:
                lacks.append(
                    f"libvirt {version_text(libvirt)} with QEMU {version_text(qemu)} or later"
                )
        return "needs " + " and ".join(lacks) if lacks else None


FEATURES = {
    f.name: f
    for f in (
        Feature("parallel", 5_002_000, 4_000_000, "parallel connections (QEMU multifd)"),
        # QEMU 10.1 lets multifd channels carry precopy pages while postcopy
        # runs; libvirt's acceptance of both flags is assumed from 11.6, not
        # yet seen in the lab (QEMU 10.0, libvirt 11.3).
        Feature("parallel-postcopy", 11_006_000, 10_001_000, "parallel connections with postcopy"),
        # No flag: libvirt 10.0 enables QEMU's capability for every postcopy
        # migration where both ends' QEMU has it (QEMU 8.0).
        Feature(
            "postcopy-preempt",
            10_000_000,
            8_000_000,
            "a channel of its own for faulted pages, turned on by libvirt itself for postcopy",
        ),
        # libvirt drives the resume (VIR_MIGRATE_POSTCOPY_RESUME).  QEMU 9.1
        # added a postcopy-recover-setup state to the source's resume; a
        # libvirt that does not know it reports the resume failed, or its
        # resume call never returns and holds the VM's job (seen with 9.0:
        # docs/benchmarks/faults.md), leaving the VM paused on both hosts.
        Feature(
            "postcopy-recovery",
            8_005_000,
            3_000_000,
            "resuming a postcopy whose connection broke, the VM paused on both hosts",
            newer_qemu=(9_001_000, RECOVER_SETUP_LIBVIRT),
        ),
        # QEMU 9.0: multifd channels detect zero pages, and the destination
        # leaves one it never received untouched (5ef7e26bdb) where the single
        # stream reads it, faulting the page into a file-backed guest's file.
        Feature(
            "multifd-zero-page",
            5_002_000,
            9_000_000,
            "parallel channels that leave never-sent zero pages untouched on the destination",
        ),
        Feature("multifd-zstd", 9_004_000, 5_000_000, "zstd compression of parallel channels"),
        Feature("zerocopy", 8_005_000, 7_001_000, "zero-copy send of parallel channels"),
        Feature("switchover-bandwidth", 11_001_000, 8_002_000, "the switchover bandwidth hint"),
        Feature("dirty-limit", None, 8_001_000, "dirty-limit throttling (needs KVM's dirty ring)"),
    )
}


def feature_matrix(source: HostSoftware, dest: HostSoftware) -> dict[str, str]:
    """Each feature on this pair of hosts (a knob needs both ends): 'yes', 'no: why'
    or 'unknown: why' (a host that did not report its versions).

    >>> new, old = HostSoftware(11_003_000, 10_000_002), HostSoftware(9_000_000, 10_000_002)
    >>> m = feature_matrix(new, old)
    >>> m["switchover-bandwidth"], m["parallel"]
    ('no: destination needs libvirt 11.1.0', 'yes')
    >>> feature_matrix(new, HostSoftware())["parallel"]
    'unknown: destination did not report its libvirt and QEMU versions'
    """
    matrix = {}
    for feature in FEATURES.values():
        if feature.libvirt is None:
            matrix[feature.name] = f"no: {feature.absent}"
            continue
        lacking, unknown = [], []
        for end, host in (("source", source), ("destination", dest)):
            if not host.libvirt or not host.qemu:
                unknown.append(end)
            elif feature.missing(host):
                lacking.append(f"{end} {feature.missing(host)}")
        if lacking:
            matrix[feature.name] = "no: " + "; ".join(lacking)
        elif unknown:
            who = " and ".join(unknown)
            matrix[feature.name] = f"unknown: {who} did not report its libvirt and QEMU versions"
        else:
            matrix[feature.name] = "yes"
    return matrix


@dataclasses.dataclass(frozen=True)
class KnobInputs:
    """The evidence the knobs are chosen from (the decision's, plus the hosts')."""

    transfer: str  # precopy | postcopy
    requested_parallel: int  # 0: the plan chooses
    stream_bps: float  # what the stream is planned at (after any cap)
    fabric_bps: float | None  # the probed path; None: not probed
    capped: bool  # the request caps the stream's bandwidth
    transport: str  # qemu-tcp | mover | rdma
    idle_cpus: float  # source CPUs not busy (cpus - load); what compression may use
    features: dict[str, str]  # feature_matrix()
    file_backed: bool
    split: bool = False  # the VM lands under a split budget
    # The source can tell the destination which chunks the guest writes
    # (agents/agent/hot_chunks.py): its memory file has writeback.
    hot_hint: bool = True

    @property
    def link_bps(self) -> float:
        """The link the pages cross: the probed path, or the request's cap below it."""
        if not self.fabric_bps:
            return self.stream_bps
        return min(self.fabric_bps, self.stream_bps) if self.capped else self.fabric_bps


@dataclasses.dataclass(frozen=True)
class Knobs:
    parallel: int = 1
    postcopy_preempt: bool = False
    compression: str | None = None  # multifd compression method
    zerocopy: bool = False
    avail_switchover_mib: int | None = None
    reasons: tuple[str, ...] = ()

    # The parallel flag and connection count are the plan's (Plan.mode_flags,
    # Plan.params), which callers may narrow; these are the rest.
    # postcopy_preempt is what libvirt will do by itself: it has no flag.
    def flags(self) -> int:
        flags = 0
        if self.compression:
            flags |= VIR_MIGRATE_COMPRESSED
        if self.zerocopy:
            flags |= VIR_MIGRATE_ZEROCOPY
        return flags

    def params(self) -> dict[str, object]:
        params: dict[str, object] = {}
        if self.compression:
            params[PARAM_COMPRESSION] = self.compression
        if self.avail_switchover_mib:
            params[PARAM_AVAIL_SWITCHOVER] = self.avail_switchover_mib
        return params


ALL_FLAGS = (
    VIR_MIGRATE_PARALLEL | VIR_MIGRATE_POSTCOPY_PREEMPT | VIR_MIGRATE_COMPRESSED
) | VIR_MIGRATE_ZEROCOPY


def _has(inp: KnobInputs, feature: str) -> str | None:
    """None where both ends have the feature, else why not (a plan's own choice
    needs a 'yes'; what a caller asked for explicitly only needs no 'no')."""
    state = inp.features.get(feature, "unknown: not in the feature matrix")
    return None if state == "yes" else state.split(": ", 1)[-1]


def _refused(inp: KnobInputs, feature: str) -> str | None:
    state = inp.features.get(feature, "unknown")
    return state.removeprefix("no: ") if state.startswith("no: ") else None


def choose_parallel(inp: KnobInputs) -> tuple[int, str]:
    """Connections: the caller's, else enough channels to fill the probed path.

    >>> base = KnobInputs("precopy", 0, 100 * MIB, 100 * MIB, False, "qemu-tcp", 2.0,
    ...                   {"parallel": "yes", "parallel-postcopy": "no: needs QEMU 10.1.0"}, False)
    >>> choose_parallel(base)[0]
    1
    >>> choose_parallel(dataclasses.replace(base, fabric_bps=3000 * MIB, idle_cpus=8))[0]
    3
    >>> choose_parallel(dataclasses.replace(base, transfer="postcopy", requested_parallel=4))
    (1, 'parallel: 4 asked for, but this plan switches to postcopy and the hosts lack \
parallel-postcopy (needs QEMU 10.1.0): a single stream')
    """
    if inp.transport == "rdma":
        return 1, "parallel: RDMA carries the stream itself: a single stream"
    # Asked for explicitly, parallel precopy is tried unless a host is known to
    # lack it (Nova's operators set it knowing their hosts); with postcopy,
    # whose failure leaves a VM split across hosts, only where both have it.
    blocked = _has(inp, "parallel") if inp.requested_parallel <= 1 else _refused(inp, "parallel")
    if inp.transfer == "postcopy" and not blocked:
        blocked = _has(inp, "parallel-postcopy")
        blocked = f"parallel-postcopy ({blocked})" if blocked else None
    if inp.requested_parallel > 1:
        if blocked:
            why = (
                "this plan switches to postcopy and the hosts lack "
                if "postcopy" in blocked
                else ""
            )
            return 1, (
                f"parallel: {inp.requested_parallel} asked for, but {why or 'the hosts lack it: '}"
                f"{blocked}: a single stream"
            )
        return inp.requested_parallel, f"parallel: {inp.requested_parallel} connections, as asked"
    if inp.requested_parallel == 1:
        return 1, "parallel: a single stream, as asked"
    path = inp.fabric_bps or 0.0
    wanted = min(8, math.ceil(path / CHANNEL_BPS)) if path > CHANNEL_BPS else 1
    wanted = max(1, min(wanted, int(inp.idle_cpus)))
    if inp.file_backed and inp.transfer == "precopy" and wanted < FILE_BACKED_CHANNELS:
        if inp.split and not inp.hot_hint:
            # Without the source's map of what the guest writes, the keeper drops
            # the rewritten set while the first round fills the budget, and the
            # final round reads it back inside the downtime: over two channels,
            # +59 to +329 ms over the enough case (the target: +50), against -46
            # to +38 ms over one stream (split-channels-*.md,
            # split-two-channels-current-qemu.md).
            return 1, (
                "parallel: a single stream for a split VM whose memory file has no "
                "writeback (no map of what its guest writes for the destination): over "
                "two channels its switchover took up to 329 ms longer under the budget"
            )
        return _file_backed_channels(inp)
    if wanted == 1:
        return 1, (
            f"parallel: a single stream fills the {path / MIB:,.0f} MiB/s path "
            f"(one channel moves ~{CHANNEL_BPS / MIB:,.0f} MiB/s)"
        )
    if blocked:
        return 1, f"parallel: {wanted} channels would fill the path, but {blocked}"
    return wanted, (
        f"parallel: {wanted} channels to fill the {path / MIB:,.0f} MiB/s path "
        f"(one moves ~{CHANNEL_BPS / MIB:,.0f} MiB/s; {inp.idle_cpus:.1f} CPUs idle)"
    )


def _file_backed_channels(inp: KnobInputs) -> tuple[int, str]:
    """Two channels for a file-backed VM's precopy to a host with room for it,
    whatever the path.

    One stream's destination reads every zero page the source reports, which
    faults it into the VM's memory file: a 512 MiB guest with 300 MiB written
    arrived with 535 MiB of its file resident, against 299 MiB over two
    channels, and took 4.8 s against 3.8 s (its one load thread ran 78 % of
    the time writing the file's pages, against 46 % for an anonymous guest).

    >>> inp = KnobInputs("precopy", 0, 100 * MIB, 100 * MIB, False, "qemu-tcp", 1.0,
    ...                  {"parallel": "yes", "multifd-zero-page": "yes"}, True)
    >>> _file_backed_channels(inp)[0]
    2
    >>> old = dataclasses.replace(inp, features={"parallel": "yes",
    ...                                          "multifd-zero-page": "no: needs QEMU 9.0.0"})
    >>> _file_backed_channels(old)
    (1, 'parallel: a single stream: parallel channels would skip the zero pages of this \
file-backed VM, but the hosts lack multifd-zero-page (needs QEMU 9.0.0)')
    """
    for feature in ("parallel", "multifd-zero-page"):
        blocked = _has(inp, feature)
        if blocked:
            return 1, (
                "parallel: a single stream: parallel channels would skip the zero pages of "
                f"this file-backed VM, but the hosts lack {feature} ({blocked})"
            )
    return FILE_BACKED_CHANNELS, (
        f"parallel: {FILE_BACKED_CHANNELS} channels for a file-backed VM: unlike one stream "
        "they leave the zero pages never sent untouched on the destination, so those pages "
        "do not enter its memory file, and the file's page writes spread over two threads"
    )


def choose_preempt(inp: KnobInputs) -> tuple[bool, str]:
    """Whether libvirt will turn postcopy-preempt on: not a choice but a forecast.

    libvirt (10.0 on) enables it for every postcopy migration where both ends
    support it, and offers no flag to ask for it or to refuse it.  The plan's
    transport has already moved off the mover where that is so
    (``flexmig.policy.transport.preempt_conflict``).

    >>> inp = KnobInputs("postcopy", 0, 64 * MIB, None, False, "qemu-tcp", 1.0,
    ...                  {"postcopy-preempt": "no: destination needs libvirt 10.0.0"}, False)
    >>> choose_preempt(inp)
    (False, 'postcopy-preempt: off (destination needs libvirt 10.0.0): faulted pages queue \
behind the background stream, each guest fault waits longer')
    >>> choose_preempt(dataclasses.replace(inp, features={"postcopy-preempt": "yes"}))[0]
    True
    """
    if inp.transfer != "postcopy":
        return False, "postcopy-preempt: not used, the plan does not switch to postcopy"
    blocked = _has(inp, "postcopy-preempt")
    if blocked and _refused(inp, "postcopy-preempt") is None:
        return False, (
            f"postcopy-preempt: unknown ({blocked}): libvirt decides by itself, the "
            "forecast assumes it off"
        )
    if blocked:
        return False, (
            f"postcopy-preempt: off ({blocked}): faulted pages queue behind "
            "the background stream, each guest fault waits longer"
        )
    return True, (
        "postcopy-preempt: on, libvirt turns it on by itself for postcopy between these "
        "hosts: faulted pages take a channel of their own instead of queueing behind the "
        "background stream"
    )


def choose_compression(inp: KnobInputs, parallel: int) -> tuple[str | None, str]:
    """zstd on the channels where the link, not the CPU, limits and CPUs are idle."""
    if inp.transfer != "precopy":
        return None, "compression: not with postcopy (QEMU compresses precopy channels only)"
    if parallel < 2:
        return None, "compression: needs parallel channels (multifd), this plan has one stream"
    blocked = _has(inp, "multifd-zstd")
    if blocked:
        return None, f"compression: not available ({blocked})"
    can_compress = parallel * ZSTD_BPS_PER_CORE
    if inp.link_bps * ZSTD_RATIO >= can_compress:
        return None, (
            f"compression: {parallel} channels compress ~{can_compress / MIB:,.0f} MiB/s, "
            f"no faster than the {inp.link_bps / MIB:,.0f} MiB/s link carries raw pages"
        )
    if inp.idle_cpus < parallel:
        return None, (
            f"compression: the link is the bottleneck but only {inp.idle_cpus:.1f} CPUs are "
            f"idle for {parallel} compressing channels"
        )
    return "zstd", (
        f"compression: zstd on {parallel} channels: the {inp.link_bps / MIB:,.0f} MiB/s "
        f"link is the bottleneck and {inp.idle_cpus:.1f} CPUs are idle"
    )


def choose_zerocopy(inp: KnobInputs, parallel: int, compression: str | None) -> tuple[bool, str]:
    """Zero-copy send where the path is fast enough for copying to be the cost."""
    if parallel < 2 or compression:
        return False, "zero-copy: needs uncompressed parallel channels"
    blocked = _has(inp, "zerocopy")
    if blocked:
        return False, f"zero-copy: not available ({blocked})"
    if inp.transport != "qemu-tcp":
        return False, f"zero-copy: QEMU sends zero-copy on TCP only, not over {inp.transport}"
    if inp.file_backed:
        return False, "zero-copy: it locks all guest RAM, which a file-backed VM keeps on disk"
    if (inp.fabric_bps or 0.0) < ZEROCOPY_MIN_BPS or inp.capped:
        return False, (
            f"zero-copy: the path ({(inp.fabric_bps or 0) / MIB:,.0f} MiB/s) is too slow for "
            "the kernel's copy to matter, and it pins guest RAM"
        )
    return True, "zero-copy: the path is fast enough that the kernel's copy of each page costs"


def choose_switchover_hint(inp: KnobInputs) -> tuple[int | None, str]:
    """Tell QEMU the bandwidth of the switchover (it under-estimates a CPU-bound stream)."""
    blocked = _has(inp, "switchover-bandwidth")
    if blocked:
        return None, f"switchover bandwidth hint: not available ({blocked})"
    if not inp.fabric_bps or inp.fabric_bps < MIN_HINT_BPS:
        return None, "switchover bandwidth hint: not given, the path was not probed"
    hint = min(inp.fabric_bps, inp.stream_bps) if inp.capped else inp.fabric_bps
    mib = max(1, int(hint // MIB))
    return mib, (
        f"switchover bandwidth hint: {mib} MiB/s (the probed path), so QEMU's switchover "
        "decision does not rest on its own estimate of a stream it kept busy"
    )


def choose(inp: KnobInputs) -> Knobs:
    """Every knob for one migration, each with its reason."""
    parallel, why_parallel = choose_parallel(inp)
    preempt, why_preempt = choose_preempt(inp)
    compression, why_compression = choose_compression(inp, parallel)
    zerocopy, why_zerocopy = choose_zerocopy(inp, parallel, compression)
    hint, why_hint = choose_switchover_hint(inp)
    return Knobs(
        parallel=parallel,
        postcopy_preempt=preempt,
        compression=compression,
        zerocopy=zerocopy,
        avail_switchover_mib=hint,
        reasons=(why_parallel, why_preempt, why_compression, why_zerocopy, why_hint),
    )
