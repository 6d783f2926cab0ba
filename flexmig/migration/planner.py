"""From a request and the facts to a plan: pure functions, no I/O.

Both the agent and the Nova driver read their facts (``facts``), describe the
destination and the link, and call ``plan``: the same VM facts give the same
plan whichever path asked.  The mode decision itself is
``flexmig.policy.decision.decide``; this module feeds it and turns its
decision into what libvirt is asked to do.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from flexmig import exceptions
from flexmig.migration import downtime, knobs, writeback
from flexmig.migration.facts import NO_WRITEBACK_FILESYSTEMS, PAGE, GuestMemory, VmFacts
from flexmig.migration.knobs import HostSoftware, Knobs
from flexmig.migration.options import EngineOptions
from flexmig.migration.request import MigrationRequest
from flexmig.policy import dirty_model
from flexmig.policy import split as split_model
from flexmig.policy.decision import Decision, MigrationInputs, decide, split_budget
from flexmig.policy.transport import TransportChoice, choose_transport, preempt_conflict

MIB = 2**20
# Filesystems whose files userfaultfd can serve for postcopy (missing mode);
# anonymous, shared (memfd/shmem) and hugetlbfs memory it serves too.
USERFAULTFD_FILESYSTEMS = ("tmpfs", "hugetlbfs")
UNKNOWN_SOFTWARE = HostSoftware()
NO_KNOBS = Knobs()


def _optional_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


@dataclasses.dataclass(frozen=True)
class DestinationFacts:
    free_for_vms_bytes: int
    store_free_bytes: int
    # Whether a split budget is already reserved there (the Nova path reserves
    # in pre_live_migration, before planning); None: reserved on demand once
    # the plan says split (the agent path).
    split_reserved: bool | None = None
    store_write_bps: float = 0.0  # the split store's measured write rate; 0: unknown
    store_fault_s: float = 0.0  # one fault on the store, a 4 MiB read; 0: unknown
    store_folio_bytes: int = 0  # the store's page-cache folio size, reclaim's unit; 0: unknown
    memory_cgroup: str = ""  # how the destination caps a split VM's residency
    software: HostSoftware = UNKNOWN_SOFTWARE  # its libvirt and QEMU
    # Its memory_backing_dir on the filesystem of /etc/libvirt (None: not reported).
    store_shares_libvirt_fs: bool | None = None

    @classmethod
    def from_agent(cls, facts: dict[str, Any]) -> DestinationFacts:
        """From an agent's ``/v1/facts`` reply; a reply of another shape is a backend error."""
        try:
            return cls(
                int(facts["free_for_vms_bytes"]),
                int(facts["store_free_bytes"]),
                store_write_bps=float(facts.get("store_write_bps") or 0.0),
                store_fault_s=float(facts.get("store_fault_s") or 0.0),
                store_folio_bytes=int(facts.get("store_folio_bytes") or 0),
                memory_cgroup=str((facts.get("memory_cgroup") or {}).get("detail") or ""),
                software=HostSoftware.from_facts(facts),
                store_shares_libvirt_fs=_optional_bool(facts.get("store_shares_libvirt_fs")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise exceptions.BackendError(
                backend="destination agent", reason=f"facts not in the API's shape: {exc!r}"
            ) from exc


def timings_were_learnt(jobs_counted: int | None, stream_bps: float | None) -> bool:
    """Whether an agent learnt a link's setup and switchover: from any counted
    job (capped jobs teach them without the rate), or, in an estimate saved
    before jobs were counted, with its rate.

    >>> timings_were_learnt(2, None), timings_were_learnt(0, 100.0), timings_were_learnt(0, None)
    (True, True, False)
    """
    return bool(jobs_counted) or bool(stream_bps)


@dataclasses.dataclass(frozen=True)
class LinkFacts:
    """What is known about the path to the destination."""

    fabric_bps: float | None = None  # the raw path, by probe; None: not probed
    stream_bps: float | None = None  # QEMU's stream, learned from earlier migrations
    setup_s: float = 0.0  # job start until the first page moves
    switchover_s: float = 0.05
    resume_s: float = downtime.RESUME_S  # libvirt's finish and resume, as the guest sees it
    # switchover_s learnt from libvirt's downtime, which ends with the guest
    # running on the destination: it holds the finish and resume already.
    switchover_learned: bool = False
    # QEMU's side and the guest's first run as earlier jobs measured them: the
    # guest-observed forecast counts these (the plan's switchover_s stays the
    # planner's, for what fits the budget).
    learnt: downtime.LearntSide = downtime.NOTHING_LEARNT


@dataclasses.dataclass(frozen=True)
class SourceFacts:
    """The source host's side of the knob choices."""

    software: HostSoftware = UNKNOWN_SOFTWARE
    idle_cpus: float = 1.0  # CPUs not busy (count minus load): what compression may use


@dataclasses.dataclass(frozen=True)
class Plan:
    request: MigrationRequest
    decision: Decision
    transport: TransportChoice
    parallel: int  # libvirt parallel connections in use; 1: the single stream
    downtime_budget_ms: int  # the full budget (the decision may use a tighter limit)
    bandwidth_bps: float  # the stream rate the prediction assumed
    notes: tuple[str, ...] = ()
    knobs: Knobs = NO_KNOBS
    features: dict[str, str] = dataclasses.field(default_factory=dict)  # knobs.feature_matrix
    hosts: tuple[HostSoftware, HostSoftware] = (UNKNOWN_SOFTWARE, UNKNOWN_SOFTWARE)
    guest_downtime: downtime.Forecast = dataclasses.field(
        default_factory=lambda: downtime.Forecast({})
    )

    @property
    def mode(self) -> str:
        return self.decision.mode

    def mode_flags(self, lv: Any) -> int:
        """The libvirt flags this plan chooses (``lv``: the libvirt binding in use)."""
        flags = 0
        if self.decision.auto_converge:
            flags |= lv.VIR_MIGRATE_AUTO_CONVERGE
        if self.decision.transfer == "postcopy":
            flags |= lv.VIR_MIGRATE_POSTCOPY
        if self.parallel > 1:
            flags |= lv.VIR_MIGRATE_PARALLEL
        return flags | self.knobs.flags()

    def params(self) -> dict[str, object]:
        """The typed parameters this plan adds to libvirt's migrateToURI3 (beside the URI,
        the bandwidth cap and the XML, which are the caller's)."""
        params = self.knobs.params()
        if self.parallel > 1:
            params[knobs.PARAM_PARALLEL_CONNECTIONS] = self.parallel
        return params

    @property
    def over_budget(self) -> str | None:
        """Why the guest will notice more than its budget, or None."""
        return downtime.over_budget(self.guest_downtime.total_ms, self.downtime_budget_ms)

    def merged_flags(self, other_flags: int, lv: Any) -> int:
        """Another caller's flags (Nova's: tunnelling, TLS, block migration…) with ours.

        Postcopy, auto-converge and parallel are the plan's, whatever Nova's
        ``live_migration_permit_*`` options say; everything else stays.

        >>> import types
        >>> lv = types.SimpleNamespace(VIR_MIGRATE_POSTCOPY=32768,
        ...     VIR_MIGRATE_AUTO_CONVERGE=8192, VIR_MIGRATE_PARALLEL=131072)
        >>> plan = types.SimpleNamespace(mode_flags=lambda lv: 32768)
        >>> Plan.merged_flags(plan, 1 | 2 | 8192 | 2048, lv)
        32771
        """
        chosen = lv.VIR_MIGRATE_POSTCOPY | lv.VIR_MIGRATE_AUTO_CONVERGE | lv.VIR_MIGRATE_PARALLEL
        chosen |= knobs.ALL_FLAGS
        return (other_flags & ~chosen) | self.mode_flags(lv)

    def explain(self) -> str:
        lines = [self.decision.explain()]
        lines.append(f"  transport: {self.transport.transport} ({self.transport.reason})")
        lines += [f"  knob {reason}" for reason in self.knobs.reasons]
        if self.guest_downtime.parts_ms:
            lines.append(f"  guest-observed downtime predicted: {self.guest_downtime.describe()}")
        lines += [f"  downtime at the destination: {why}" for why in self.guest_downtime.reasons]
        if self.over_budget:
            lines.append(f"  WARNING: {self.over_budget}")
        lines += [f"  note: {note}" for note in self.notes]
        source, dest = self.hosts
        lines.append(f"  hosts: source {source.describe()}; destination {dest.describe()}")
        lines += [f"    {name}: {state}" for name, state in self.features.items()]
        return "\n".join(lines)


def postcopy_blocker(memory: GuestMemory) -> str | None:
    """Why postcopy cannot serve this VM's memory, or None: the one rule for every path.

    userfaultfd (what postcopy's destination uses to catch missing pages)
    serves anonymous, shared (memfd/shmem) and hugetlbfs memory and files on
    tmpfs or hugetlbfs; a file on a disk filesystem it cannot, and libvirt
    then leaves the source paused in "post-copy failed".

    >>> mem = GuestMemory(2**30, 2**29, "file", "ext4", passthrough=False)
    >>> postcopy_blocker(mem)
    'its memory is a file on ext4, which userfaultfd cannot serve (it serves anonymous, \
shared and hugetlbfs memory and files on tmpfs or hugetlbfs)'
    >>> postcopy_blocker(dataclasses.replace(mem, backing_fs="tmpfs")) is None
    True
    >>> postcopy_blocker(dataclasses.replace(mem, backing="anonymous")) is None
    True
    """
    if memory.passthrough:
        return "the VM has a passthrough device"
    if memory.backing != "file" or memory.backing_fs in USERFAULTFD_FILESYSTEMS:
        return None
    where = memory.backing_fs or "a filesystem this host could not determine"
    return (
        f"its memory is a file on {where}, which userfaultfd cannot serve (it serves "
        "anonymous, shared and hugetlbfs memory and files on tmpfs or hugetlbfs)"
    )


def blockers(
    vm: VmFacts, dest: DestinationFacts, opts: EngineOptions, recovery: str = "yes"
) -> tuple[str | None, str | None]:
    """(postcopy blocker, split blocker) from the VM, the destination, the options
    and the pair's postcopy-recovery (its ``feature_matrix`` state)."""
    postcopy = postcopy_blocker(vm.memory)
    needs_split = split_budget(vm.memory.ram_bytes, dest.free_for_vms_bytes) is not None
    if postcopy is None and "postcopy" not in opts.allowed_modes:
        postcopy = "postcopy is not in [migration] allowed_modes"
    if postcopy is None and vm.paused:
        postcopy = "the VM is paused (libvirt refuses postcopy for a paused VM)"
    if postcopy is None and opts.postcopy_without_recovery == "refuse":
        postcopy = unrecoverable_postcopy(recovery, refused=True)
    split = None
    if "split" not in opts.allowed_modes:
        split = "split is not in [migration] allowed_modes"
    elif dest.split_reserved is False and needs_split:
        # Reserved only where the VM does not fit (the Nova destination decides
        # that before the plan): where it fits, the missing reservation says nothing.
        split = "the destination reserved no split budget"
    return postcopy, split


# How the plan's warning of that starts, for whoever looks for it in a job's events.
POSTCOPY_NOT_RESUMABLE = "a postcopy whose connection breaks cannot be resumed between these hosts"


def unrecoverable_postcopy(recovery: str, refused: bool = False) -> str | None:
    """What a postcopy between hosts without postcopy-recovery risks, or None
    where they have it (or did not say: 'unknown' warns nothing it cannot back).

    >>> print(unrecoverable_postcopy("no: source needs libvirt 11.0.0 with QEMU 9.1.0 or later"))
    ... # doctest: +NORMALIZE_WHITESPACE
    a postcopy whose connection breaks cannot be resumed between these hosts (source
    needs libvirt 11.0.0 with QEMU 9.1.0 or later): a link failure after the switch would
    leave the VM paused on both hosts until libvirtd on the source is restarted and the
    migration resumed by hand ([migration] postcopy_without_recovery = refuse keeps VMs
    off postcopy there)
    >>> unrecoverable_postcopy("yes") is None
    True
    """
    if not recovery.startswith("no"):
        return None
    risk = (
        f"{POSTCOPY_NOT_RESUMABLE} "
        f"({recovery.split(': ', 1)[-1]}): a link failure after the switch would leave the "
        "VM paused on both hosts until libvirtd on the source is restarted and the "
        "migration resumed by hand"
    )
    if refused:
        return f"{risk}, and [migration] postcopy_without_recovery is refuse"
    return f"{risk} ([migration] postcopy_without_recovery = refuse keeps VMs off postcopy there)"


def stream_bandwidth(request: MigrationRequest, link: LinkFacts, opts: EngineOptions) -> float:
    """Bytes/s the stream is planned at: learned rate, else assumed capped by the probe;
    then the request's cap.

    >>> req = MigrationRequest(vm="v", bandwidth_mib=64)
    >>> stream_bandwidth(req, LinkFacts(fabric_bps=100 * MIB), EngineOptions()) / MIB
    64.0
    >>> stream_bandwidth(MigrationRequest(vm="v"), LinkFacts(fabric_bps=100 * MIB),
    ...                  EngineOptions()) / MIB
    100.0
    """
    assumed = float(opts.stream_bandwidth_mib * MIB)
    bandwidth = link.stream_bps or min(assumed, link.fabric_bps or math.inf)
    if request.bandwidth_mib:
        bandwidth = min(bandwidth, float(request.bandwidth_mib * MIB))
    return bandwidth


def destination_writeback(
    request: MigrationRequest,
    mem: GuestMemory,
    dest: DestinationFacts,
    mode: str,
    split_dirty_bytes: float,
) -> writeback.SwitchoverWriteback:
    """What the destination writes back of this guest's memory file inside its downtime.

    A split VM's file holds what its residency keeper has not yet written back
    (``split_dirty_bytes``, ``split.dirty_at_completion``), never more than its budget.
    """
    dirty = writeback.dirty_at_completion(mem.resident_bytes, request.store_writeback)
    if mode == "split":
        dirty = min(dirty, split_dirty_bytes, dest.free_for_vms_bytes)
    return writeback.switchover_writeback(
        mem.file_backed,
        dirty,
        dest.software.qemu,
        dest.store_shares_libvirt_fs,
        dest.store_write_bps,
    )


def guest_downtime(
    request: MigrationRequest,
    vm: VmFacts,
    dest: DestinationFacts,
    link: LinkFacts,
    decision: Decision,
    bandwidth: float,
    chosen: Knobs,
) -> downtime.Forecast:
    """The guest-observed downtime of the decided plan, part by part."""
    stop_copy_s = downtime.stop_and_copy_s(
        decision.prediction, link.switchover_s, decision.store_faults
    )
    final_round = stop_copy_s * bandwidth
    dest_writeback = destination_writeback(
        request,
        vm.memory,
        dest,
        decision.mode,
        split_model.dirty_at_completion(final_round, bandwidth),
    )
    return downtime.predict(
        decision.prediction,
        decision.transfer,
        link.switchover_s,
        bandwidth,
        chosen.postcopy_preempt,
        None if link.switchover_learned else link.resume_s,
        dest_writeback,
        decision.store_faults,
        downtime.first_run_s(vm.accelerator),
        link.learnt.for_mode(decision.mode, decision.store_faults.stored_share),
    )


def plan(
    request: MigrationRequest,
    vm: VmFacts,
    dest: DestinationFacts,
    link: LinkFacts,
    opts: EngineOptions,
    rdma_both_ends: bool = False,
    source: SourceFacts | None = None,
    dirty: dirty_model.DirtyModel | None = None,
) -> Plan:
    """Decide the mode, transport, knobs and parameters of one migration.

    ``dirty``: the model already fitted to ``vm.dirty_samples`` (a drain plans
    each VM at several bandwidth shares and fits once); None: fitted here.
    """
    source = source or SourceFacts()
    features = knobs.feature_matrix(source.software, dest.software)
    postcopy, split = blockers(vm, dest, opts, features["postcopy-recovery"])
    budget_ms = request.downtime_budget_ms(opts.max_downtime_ms)
    bandwidth = stream_bandwidth(request, link, opts)
    mem = vm.memory
    decision = decide(
        MigrationInputs(
            vm=vm.name,
            ram_bytes=mem.ram_bytes,
            resident_bytes=mem.resident_bytes,
            dirty=dirty_model.fit(vm.dirty_samples, max_pages=mem.ram_bytes / PAGE)
            if dirty is None
            else dirty,
            bandwidth_bps=bandwidth,
            dest_free_bytes=dest.free_for_vms_bytes,
            dest_store_free_bytes=dest.store_free_bytes,
            file_backed=mem.file_backed,
            max_downtime_ms=budget_ms,
            postcopy_blocker=postcopy,
            split_blocker=split,
            setup_s=link.setup_s,
            switchover_s=link.switchover_s,
            dest_store_write_bps=dest.store_write_bps,
            dest_store_fault_s=dest.store_fault_s,
            dest_store_folio_bytes=dest.store_folio_bytes,
            dest_memory_cgroup=dest.memory_cgroup,
        ),
        request.mode,
    )
    if decision.mode not in opts.allowed_modes:
        raise exceptions.PolicyRefused(
            vm.name, [f"the policy chose {decision.mode}, which [migration] allowed_modes excludes"]
        )
    transport = choose_transport(request.transport, rdma_both_ends, opts.tcp_fabric_transport)
    # Whoever asked for the mover (the agent's caller, Nova's destination that
    # started receivers): a postcopy plan where libvirt turns preempt on fails
    # at the switch over it.
    transport = (
        preempt_conflict(transport, decision.transfer, features["postcopy-preempt"]) or transport
    )
    chosen = knobs.choose(
        knobs.KnobInputs(
            transfer=decision.transfer,
            requested_parallel=request.parallel,
            stream_bps=bandwidth,
            fabric_bps=link.fabric_bps,
            capped=bool(request.bandwidth_mib),
            transport=transport.transport,
            idle_cpus=source.idle_cpus,
            features=features,
            file_backed=mem.file_backed,
            split=decision.mode == "split",
            hot_hint=mem.backing_fs not in NO_WRITEBACK_FILESYSTEMS,
        )
    )
    forecast = guest_downtime(request, vm, dest, link, decision, bandwidth, chosen)
    return Plan(
        request=request,
        decision=decision,
        transport=transport,
        parallel=chosen.parallel,
        downtime_budget_ms=budget_ms,
        bandwidth_bps=bandwidth,
        knobs=chosen,
        features=features,
        hosts=(source.software, dest.software),
        guest_downtime=forecast,
        notes=plan_notes(decision.transfer, mem, dest, features),
    )


def plan_notes(
    transfer: str, mem: GuestMemory, dest: DestinationFacts, features: dict[str, str]
) -> tuple[str, ...]:
    """What the plan warns of: the destination's writeback, postcopy without recovery."""
    notes = list(writeback.notes(mem.file_backed, dest.software.qemu, dest.store_shares_libvirt_fs))
    risk = unrecoverable_postcopy(features["postcopy-recovery"]) if transfer == "postcopy" else None
    if risk:
        notes.append(risk)
    return tuple(notes)
