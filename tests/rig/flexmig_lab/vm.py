"""Lab VMs: create, locate, talk to, migrate (plain libvirt) and destroy."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import libvirt

from flexmig import exceptions, hypervisor, processutil
from flexmig.migration import reconcile
from flexmig_lab import heartbeat, image, recorder, vmspec
from flexmig_lab.lab import Lab

BOOT_TIMEOUT = 180.0
COMMAND_TIMEOUT = 300.0
MIGRATION_POLL = 0.5

ProgressFn = Callable[[dict[str, int]], None]
ControlFn = Callable[[libvirt.virDomain, dict[str, int], float], None]


class LabVM:
    def __init__(self, lab: Lab, name: str) -> None:
        self.lab = lab
        self.name = name
        self.dir = lab.dir / "vms" / name

    @property
    def spec(self) -> vmspec.VMSpec:
        try:
            data = json.loads((self.dir / "vm.json").read_text())
        except FileNotFoundError:
            raise exceptions.InvalidInput(
                what="VM", reason=f"no lab VM named {self.name!r}"
            ) from None
        data["workload"] = vmspec.Workload(**data["workload"])
        return vmspec.VMSpec(**data)

    # -- where it runs ----------------------------------------------------------
    def locate(self) -> str | None:
        """The host whose libvirt runs the VM, or None."""
        for host in self.lab.hosts():
            with hypervisor.connect(host.local_uri, host.name) as conn:
                dom = hypervisor.find_domain(conn, self.name)
                if dom is not None and dom.isActive():
                    return host.name
        return None

    # -- the guest's control port -------------------------------------------------
    def command(self, cmd: str, timeout: float = COMMAND_TIMEOUT) -> str:
        """Run a control command in the guest and return its reply text."""
        request_id = uuid.uuid4().hex[:8]
        events = self.dir / "events.log"
        fd = os.open(self.dir / "cmd.fifo", os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, f"{request_id} {cmd}\n".encode("ascii"))
        finally:
            os.close(fd)
        marker = f" RESULT {request_id} "

        def reply() -> str | None:
            for line in events.read_text(errors="replace").splitlines():
                if marker in line:
                    return line.split(marker, 1)[1]
            return None

        try:
            text = processutil.wait_for(
                reply, timeout=timeout, interval=0.1, what=f"guest {self.name} to answer {cmd!r}"
            )
        except exceptions.Timeout as exc:
            raise exceptions.GuestError(
                vm=self.name, reason=f"{exc}; {self.describe_reachability()}"
            ) from exc
        if text.startswith("error="):
            raise exceptions.GuestError(vm=self.name, reason=f"{cmd}: {text}")
        return text

    def describe_reachability(self) -> str:
        """Where the VM runs and in what state, and what its recorder last saw:
        for the message of a command that got no answer."""
        states = []
        for host in self.lab.hosts():
            try:
                with hypervisor.connect(host.local_uri, host.name) as conn:
                    dom = hypervisor.find_domain(conn, self.name)
                    state = "absent" if dom is None else _state_name(*dom.state())
            except (libvirt.libvirtError, exceptions.FlexMigError) as exc:
                state = f"unknown ({exc})"
            states.append(f"{host.name}: {state}")
        beats = _tail(self.dir / "heartbeat.log", 1)
        now = time.monotonic_ns()
        last_beat = "none"
        if beats:
            stamp, host = beats[0].split()[:2]
            last_beat = f"from {host} {(now - int(stamp)) / 1e9:.1f} s ago"
        events = " | ".join(_tail(self.dir / "events.log", 6))
        errors = " | ".join(_tail(self.dir / "recorder.log", 4)) or "none"
        return (
            f"the VM on {', '.join(states)}; recorder {self._recorder_state()}, "
            f"last heartbeat {last_beat}; last events: {events}; recorder's errors: {errors}"
        )

    def _recorder_state(self) -> str:
        try:
            pid = int((self.dir / "recorder.pid").read_text())
        except (OSError, ValueError):
            return "never started"
        return "running" if os.path.exists(f"/proc/{pid}") else f"gone (pid {pid})"

    def verify(self) -> dict[str, int]:
        """Run the guest's verifier: pages, ok, bad, lost, written, ms."""
        text = self.command("verify")
        if "VERIFY" not in text or "error=" in text:
            raise exceptions.GuestError(vm=self.name, reason=f"verify failed: {text}")
        fields = dict(kv.split("=", 1) for kv in text.split("VERIFY", 1)[1].split())
        return {k: int(v) for k, v in fields.items()}

    def verify_when_ready(self, timeout: float = 60.0) -> dict[str, int]:
        """The first verify once the workload has its working set (a guest is READY
        before its dirtier has filled it: 128 MiB at TCG speed on a busy host can
        take longer than any fixed pause)."""

        def attempt() -> dict[str, int] | None:
            try:
                return self.verify()
            except exceptions.GuestError as exc:
                if "error=no-workset" in str(exc):
                    return None
                raise

        return processutil.wait_for(
            attempt, timeout=timeout, interval=0.5, what=f"{self.name}'s working set"
        )

    # -- live traffic from inside the guest (udpgen through its tap port) ----------
    def udpgen_start(self, tag: str, args: list[str]) -> None:
        """Start ``udpgen <args>`` in the guest in the background, named ``tag``."""
        if not tag.isalnum() or not all(
            a.replace(".", "").replace("-", "").isalnum() for a in args
        ):
            raise exceptions.InvalidInput(what="udpgen command", reason=f"{tag} {args}")
        self.command(f"udpgen {tag} {' '.join(args)}")

    def udpgen_listening(self, tag: str, timeout: float = 20.0) -> None:
        """Wait until the guest's ``udpgen recv`` named ``tag`` has its socket open
        (it says "listening" on stderr, which ``udpgen-result`` shows while it runs)."""

        def ready() -> bool:
            text = self.command(f"udpgen-result {tag}")
            if not text.startswith("running"):
                raise exceptions.GuestError(vm=self.name, reason=f"udpgen {tag} ended: {text}")
            return "listening" in text

        processutil.wait_for(
            ready, timeout=timeout, interval=0.3, what=f"udpgen {tag} in {self.name} to listen"
        )

    def udpgen_result(self, tag: str, timeout: float = 60.0) -> dict[str, float]:
        """The JSON totals the guest's udpgen printed when it ended."""

        def done() -> dict[str, float] | None:
            text = self.command(f"udpgen-result {tag}")
            return None if text.startswith("running") else json.loads(text)

        return processutil.wait_for(
            done, timeout=timeout, interval=0.5, what=f"udpgen {tag} in {self.name} to end"
        )

    def heartbeat(self, since_ns: int = 0, until_ns: int | None = None) -> heartbeat.GapReport:
        log = self.dir / "heartbeat.log"
        with open(log, encoding="ascii", errors="replace") as f:
            beats = heartbeat.parse(f)
        return heartbeat.analyse(beats, since_ns=since_ns, until_ns=until_ns)

    def wait_heartbeat(self, host: str | None = None, timeout: float = 30.0) -> None:
        """Wait until a fresh heartbeat (from ``host``, if given) is recorded."""
        start = time.monotonic_ns()

        def fresh() -> bool:
            report = self.heartbeat(since_ns=start)
            return report.beats > 0 and (host is None or report.last_host == host)

        try:
            processutil.wait_for(
                fresh,
                timeout=timeout,
                interval=0.1,
                what=f"a heartbeat from {self.name} on {host or 'any host'}",
            )
        except exceptions.Timeout as exc:
            # Say what the recorder last saw: connections, guest lines, its errors.
            tail = _tail(self.dir / "events.log", 4) + _tail(self.dir / "recorder.log", 4)
            raise exceptions.GuestError(vm=self.name, reason=f"{exc}; last: {tail}") from exc


def _next_index(lab: Lab) -> int:
    counter = lab.dir / "vm-counter"
    index = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(index + 1))
    return index


def _start_recorder(lab: Lab, vm: LabVM) -> None:
    args = [sys.executable, "-m", "flexmig_lab.recorder", "--vm-dir", str(vm.dir)]
    for host in lab.hosts():
        args += ["--socket", f"{host.name}={host.ns.root_path(vm.spec.ctl_socket)}"]
    with open(vm.dir / "recorder.log", "ab") as log:
        proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    (vm.dir / "recorder.pid").write_text(str(proc.pid))
    processutil.wait_for(
        lambda: (vm.dir / "cmd.fifo").exists(), timeout=10, what=f"the recorder of {vm.name}"
    )


def create(
    lab: Lab,
    host: str,
    ram: str = "256M",
    vcpus: int = 1,
    workload: str = "idle",
    memory_backing: str = "file",
    name: str | None = None,
) -> LabVM:
    """Boot a VM on ``host`` and wait until its guest reports READY."""
    target = lab.host(host)
    image_files = image.existing()
    index = _next_index(lab)
    spec = vmspec.make_spec(name or f"vm{index}", ram, vcpus, workload, memory_backing, index)
    vm = LabVM(lab, spec.name)
    if vm.dir.exists():
        raise exceptions.InvalidInput(what="VM name", reason=f"{spec.name!r} already exists")
    vm.dir.mkdir(parents=True)
    data = {k: getattr(spec, k) for k in ("name", "ram_mib", "vcpus", "memory_backing", "index")}
    data["workload"] = vars(spec.workload)
    (vm.dir / "vm.json").write_text(json.dumps(data, indent=2))
    try:
        _start_recorder(lab, vm)
        xml = vmspec.domain_xml(spec, str(image_files.kernel), str(image_files.initrd))
        with hypervisor.connect(target.local_uri, target.name) as conn:
            with hypervisor.wrap_errors(target.name, f"start {spec.name}"):
                dom = conn.defineXML(xml)
                dom.create()
        processutil.wait_for(
            lambda: " READY " in (vm.dir / "events.log").read_text(),
            timeout=BOOT_TIMEOUT,
            interval=0.2,
            what=f"{spec.name} to boot",
        )
    except BaseException:
        destroy(lab, spec.name)
        raise
    return vm


def destroy(lab: Lab, name: str) -> None:
    """Stop and undefine the VM wherever it is, and forget it."""
    for host in lab.hosts():
        with hypervisor.connect(host.local_uri, host.name) as conn:
            dom = hypervisor.find_domain(conn, name)
            if dom is None:
                continue
            with hypervisor.wrap_errors(host.name, f"destroy {name}"):
                if dom.isActive():
                    dom.destroy()
                dom.undefine()
    vm_dir = lab.dir / "vms" / name
    recorder.stop(vm_dir)
    shutil.rmtree(vm_dir, ignore_errors=True)


def list_vms(lab: Lab) -> list[str]:
    vms = lab.dir / "vms"
    return sorted(p.name for p in vms.iterdir()) if vms.exists() else []


def migrate_plain(
    lab: Lab,
    name: str,
    to: str,
    *,
    progress: ProgressFn | None = None,
    bandwidth_mib: int = 0,
    max_downtime_ms: int = 0,
    extra_flags: int = 0,
    control: ControlFn | None = None,
) -> dict[str, int]:
    """Live-migrate with libvirt's own precopy (peer-to-peer), as Nova does by default.

    ``control(dom, stats, elapsed_s)`` runs at every poll: baselines use it to
    step the downtime limit, switch to postcopy or abort, as their managers do.
    Returns libvirt's completed-job statistics from the destination.
    """
    vm = LabVM(lab, name)
    source_name = vm.locate()
    if source_name is None:
        raise exceptions.InvalidInput(what="VM", reason=f"{name!r} is not running")
    dest = lab.host(to)
    if dest.name == source_name:
        raise exceptions.InvalidInput(what="destination", reason=f"{name} already runs on {to}")
    source = lab.host(source_name)
    flags = (
        libvirt.VIR_MIGRATE_LIVE
        | libvirt.VIR_MIGRATE_PEER2PEER
        | libvirt.VIR_MIGRATE_PERSIST_DEST
        | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
        | extra_flags
    )
    params: dict[str, object] = {libvirt.VIR_MIGRATE_PARAM_URI: dest.spec.migration_uri}
    if bandwidth_mib:  # for both phases, as FlexMig's jobs cap them
        params[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH] = bandwidth_mib
        params[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH_POSTCOPY] = bandwidth_mib
    with hypervisor.connect(source.local_uri, source.name) as conn:
        dom = conn.lookupByName(name)
        if max_downtime_ms:
            with hypervisor.wrap_errors(source.name, "set max downtime"):
                dom.migrateSetMaxDowntime(max_downtime_ms)
        _run_with_progress(
            dom, source.name, dest.spec.libvirt_uri, params, flags, progress, control
        )
    with hypervisor.connect(dest.local_uri, dest.name) as conn:
        with hypervisor.wrap_errors(dest.name, "read completed migration stats"):
            stats = conn.lookupByName(name).jobStats(libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED)
    return {k: v for k, v in stats.items() if isinstance(v, int)}


def _run_with_progress(
    dom: libvirt.virDomain,
    host: str,
    dest_uri: str,
    params: dict[str, object],
    flags: int,
    progress: ProgressFn | None,
    control: ControlFn | None = None,
) -> None:
    start = time.monotonic()
    worker, errors = hypervisor.start_migration(dom, host, dest_uri, params, flags)
    while worker.is_alive():
        worker.join(MIGRATION_POLL)
        if not worker.is_alive():
            break
        with contextlib.suppress(libvirt.libvirtError):
            stats = {k: v for k, v in dom.jobStats().items() if isinstance(v, int)}
            if progress is not None:
                progress(stats)
            if control is not None:
                control(dom, stats, time.monotonic() - start)
    if errors:
        raise errors[0]


def _state_name(state: int, reason: int) -> str:
    """The domain as the agent's reconcile reads it, libvirt's codes unless it runs."""
    view = reconcile.domain_view(True, state, reason)
    return view if view == reconcile.RUNNING else f"{view} (state {state}, reason {reason})"


def _tail(path, lines: int) -> list[str]:
    """The last ``lines`` lines of a recorder log ([] if it is not there)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            text = f.read().decode("ascii", "replace")
    except OSError:
        return []
    return text.splitlines()[-lines:] if text else []
