"""Everything a drain planner needs from the host being drained, read at once.

Each running VM's memory facts and dirty-rate samples (fitted to seed 000's
model here, so the planner gets M and tau), all VMs sampled at the same time:
sampling one VM after another would cost the drain seconds per VM before
anything moves.  The samples are kept briefly so that the migrations the
drain then starts are decided on the same measurement instead of sampling
again (``MigrationService.plan``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import libvirt

from flexmig import exceptions, hypervisor
from flexmig.migration import facts, options, planner
from flexmig.policy import dirty_model

LOG = logging.getLogger(__name__)

# Samples older than this are not reused for a migration's decision: a guest's
# behaviour drifts, and a drain starts its migrations within seconds.
SAMPLES_MAX_AGE_S = 120.0
# Samplings kept per VM (a refresh every 15 s fills the age above with 8).
MAX_SAMPLINGS = 8
# libvirt's dirty-rate calculations of different domains run side by side;
# more at once than this only queues behind QEMU's threads on a small host.
MAX_PARALLEL_SAMPLES = 8


@dataclasses.dataclass
class SampleCache:
    """Recent dirty-rate samplings per VM, shared by the inventory, the background
    refresher and migrations.

    A migration takes every sampling of the last SAMPLES_MAX_AGE_S together:
    each of libvirt's page-sampled calculations hashes a fresh random set of
    pages, so several of them average out the noise that makes one sampling's
    fitted set swing (tests/bench/dirty_fit_noise.py).
    """

    entries: dict[str, collections.deque[tuple[float, list[tuple[float, float]]]]] = (
        dataclasses.field(default_factory=dict)
    )
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def put(self, vm: str, samples: list[tuple[float, float]]) -> None:
        with self.lock:
            history = self.entries.setdefault(vm, collections.deque(maxlen=MAX_SAMPLINGS))
            history.append((time.monotonic(), samples))

    def take(self, vm: str) -> tuple[tuple[float, float], ...] | None:
        """The VM's fresh samplings' samples, once: a second migration samples anew."""
        with self.lock:
            history = self.entries.pop(vm, ())
        return _fresh(history)

    def peek(self, vm: str) -> tuple[tuple[float, float], ...] | None:
        """What ``take`` would return, left in place (what a drain plans from)."""
        with self.lock:
            history = tuple(self.entries.get(vm, ()))
        return _fresh(history)

    def forget_all_but(self, running: set[str]) -> None:
        """Drop the samplings of VMs no longer running here (gone, or moved away):
        a new VM given the same name must not inherit them."""
        with self.lock:
            for vm in set(self.entries) - running:
                del self.entries[vm]


def _fresh(
    history: Iterable[tuple[float, list[tuple[float, float]]]],
) -> tuple[tuple[float, float], ...] | None:
    now = time.monotonic()
    fresh = [s for at, samples in history if now - at <= SAMPLES_MAX_AGE_S for s in samples]
    return tuple(fresh) if fresh else None


def _one_vm(
    conn: libvirt.virConnect,
    dom: libvirt.virDomain,
    host: str,
    seconds: tuple[int, ...],
    ram_mapping: facts.RamMappingReader,
    cache: SampleCache,
) -> dict[str, Any]:
    vm = facts.read_vm(conn, dom, host, seconds, ram_mapping)
    mem = vm.memory
    cache.put(vm.name, list(vm.dirty_samples))
    # The drain plans from what its migrations will take: every fresh sampling.
    vm = dataclasses.replace(vm, dirty_samples=cache.peek(vm.name) or vm.dirty_samples)
    model = dirty_model.fit(vm.dirty_samples, max_pages=mem.ram_bytes / facts.PAGE)
    return {
        "name": vm.name,
        # The engine's facts (facts.VmFacts), which the drain plans each move from.
        "memory": dataclasses.asdict(mem),
        "paused": vm.paused,
        "accelerator": vm.accelerator,
        "samples": [list(s) for s in vm.dirty_samples],
        "dirty": {"m_pages": model.m_pages, "tau_s": model.tau_s},
        # Shorthands for people reading the reply.
        "ram_bytes": mem.ram_bytes,
        "resident_bytes": mem.resident_bytes,
        "file_backed": mem.file_backed,
        "postcopy_blocker": planner.postcopy_blocker(mem),
    }


def running_vms(
    uri: str,
    host: str,
    seconds: tuple[int, ...],
    ram_mapping: facts.RamMappingReader,
    cache: SampleCache,
    skip: Callable[[str], bool] = lambda name: False,
    running_only: bool = False,
) -> list[dict[str, Any]]:
    """Facts and fitted dirty model of every running VM (``skip``: VMs migrating now;
    ``running_only``: not the paused, which include VMs still arriving)."""
    with hypervisor.connect(uri, host) as conn:
        with hypervisor.wrap_errors(host, "list running VMs"):
            active = conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
            cache.forget_all_but({d.name() for d in active})
            doms = [
                d
                for d in active
                if not skip(d.name())
                # info()'s first field is the state (Nova's fakelibvirt has no state()).
                and not (running_only and d.info()[0] != libvirt.VIR_DOMAIN_RUNNING)
            ]
        if not doms:
            return []
        workers = min(MAX_PARALLEL_SAMPLES, len(doms))
        with concurrent.futures.ThreadPoolExecutor(workers, "inventory") as pool:
            futures = [
                pool.submit(_one_vm, conn, d, host, seconds, ram_mapping, cache) for d in doms
            ]
            results = []
            for future in futures:
                try:
                    results.append(future.result())
                except exceptions.FlexMigError as exc:
                    # A VM that vanished or cannot be read stays in the answer
                    # with why: the planner must not silently leave it behind.
                    results.append({"name": None, "error": str(exc)})
            return _name_errors(results, doms)


def _name_errors(
    results: list[dict[str, Any]], doms: list[libvirt.virDomain]
) -> list[dict[str, Any]]:
    for result, dom in zip(results, doms, strict=True):
        if result.get("name") is None:
            result["name"] = dom.name()
    return results


def check_refresh(interval_s: int, seconds: tuple[int, ...]) -> None:
    """A refresh shorter than one sampling would start the next before it ended.

    >>> check_refresh(0, (1, 5, 15)), check_refresh(30, (1, 5, 15))
    (None, None)
    >>> check_refresh(10, (1, 5, 15))
    Traceback (most recent call last):
    ...
    flexmig.migration.options.InvalidConfig: Invalid [agent] dirty_sample_refresh: 10 s is \
shorter than one sampling, the 21 s of [migration] dirty_sample_seconds (1, 5, 15)
    """
    if interval_s and interval_s < sum(seconds):
        raise options.InvalidConfig(
            group="agent",
            option="dirty_sample_refresh",
            reason=f"{interval_s} s is shorter than one sampling, the {sum(seconds)} s of "
            f"[migration] dirty_sample_seconds {tuple(seconds)}",
        )


@dataclasses.dataclass
class SampleRefresher:
    """Calls ``sample`` (running_vms, which keeps what it takes in the agent's
    SampleCache) every ``interval_s``.

    A migration then plans on samples at most ``interval_s`` plus their length
    old instead of waiting for new ones (``MigrationService.plan`` takes them).
    """

    interval_s: float
    sample: Callable[[], list[dict[str, Any]]]  # running_vms, bound to the agent's state
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    rounds: int = 0

    def once(self) -> int:
        """One sampling of every VM; how many were sampled (the rest are logged)."""
        vms = self.sample()
        for vm in vms:
            if "error" in vm:
                LOG.warning("background dirty-rate sample of %s: %s", vm["name"], vm["error"])
        self.rounds += 1
        return sum("error" not in vm for vm in vms)

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.once()
            except Exception:  # libvirt down for a while: the next round tries again
                LOG.exception("background dirty-rate sampling")
            self.stop.wait(max(1.0, self.interval_s - (time.monotonic() - started)))
