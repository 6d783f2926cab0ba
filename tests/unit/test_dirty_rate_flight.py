"""Concurrent plans of one VM share its dirty-rate calculation (QEMU runs one at a time)."""

import threading
import time

import libvirt

from flexmig.migration import facts


class FakeDomain:
    """QEMU's rule: a second calculation while one runs is refused."""

    def __init__(self, name):
        self._name, self.starts, self.running_until = name, 0, 0.0
        self.lock = threading.Lock()

    def name(self):
        return self._name

    def startDirtyRateCalc(self, seconds, _mode):
        with self.lock:
            if time.monotonic() < self.running_until:
                raise libvirt.libvirtError("the dirty rate is already being measured")
            self.starts += 1
            self.running_until = time.monotonic() + seconds + 0.05


class FakeConn:
    def __init__(self, dom):
        self.dom = dom

    def domainListGetStats(self, doms, _what):
        measured = time.monotonic() >= self.dom.running_until
        status = libvirt.VIR_DOMAIN_DIRTYRATE_MEASURED if measured else 1
        return [(doms[0], {"dirtyrate.calc_status": status,
                           "dirtyrate.megabytes_per_second": 4})]  # fmt: skip


def test_concurrent_callers_share_one_calculation_and_none_fails():
    dom = FakeDomain("vm-flight")
    conn = FakeConn(dom)
    results, errors = [], []

    def plan():
        try:
            results.append(facts.sample_dirty_pages(conn, dom, "A", (1,)))
        except Exception as exc:  # noqa: BLE001 (any failure is the finding)
            errors.append(exc)

    threads = [threading.Thread(target=plan) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(results) == 8 and len(set(results)) == 1
    assert dom.starts <= 2  # the first caller's, and at most one for those who came during it


def test_a_later_caller_takes_a_fresh_calculation():
    dom = FakeDomain("vm-later")
    conn = FakeConn(dom)
    facts.sample_dirty_pages(conn, dom, "A", (0,))
    facts.sample_dirty_pages(conn, dom, "A", (0,))
    assert dom.starts == 2
