"""The Policy Manager: which flows to offload, from a policy file.  Pure.

Seed 002 names two triggers, both here:

- **header rules**, applied once at flow setup (the first packet is judged in
  the host): "TCP to port 5201 of tap0: offload", "UDP from 10.0.0.0/8: onload";
- **statistics rules**, applied every poll interval afterwards: promote a flow
  whose rate crosses ``promote_pps`` or whose bytes in the window cross
  ``promote_bytes``; demote an offloaded flow only after it stayed below the
  lower marks for ``demote_intervals`` polls in a row (hysteresis: a flow
  hovering around one threshold does not flap).

A NIC's flow table is finite, so the policy carries a ``capacity``; when it is
full the slowest offloaded flow makes room (:func:`plan_admission`).

The policy file is YAML (JSON is YAML too)::

    capacity: 1024
    header_rules:
      - name: iperf-to-vm0
        port: tap0             # the VM port whose flows this judges ("*": any)
        direction: ingress     # ingress (to the VM), egress (from it) or any
        ip_proto: tcp
        tp_dst: 5201
        action: offload        # or onload: pinned to the vSwitch, never promoted
    statistics:
      window_s: 1.0
      promote_pps: 20000
      promote_bytes: 0         # 0: no bytes trigger
      demote_pps: 2000
      demote_bytes: 0
      demote_intervals: 3

Every error names the field (``statistics.demote_pps``) and nothing of a
rejected policy is ever applied: :func:`parse_policy` either returns a whole
valid :class:`Policy` or raises.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from flexmig import exceptions
from ovs_ext.providers.base import IPPROTO_TCP, IPPROTO_UDP, FlowMatch

MAX_CAPACITY = 1_000_000
MAX_RULES = 10_000
PORT_NAME_RE = re.compile(r"^(\*|[A-Za-z0-9_.:-]{1,15})$")

K = TypeVar("K")


class PolicyError(exceptions.FlexMigError):
    msg_fmt = "Invalid offload policy %(source)s: %(field)s: %(reason)s"


class Direction(enum.Enum):
    INGRESS = "ingress"  # towards the VM (from the uplink or another port)
    EGRESS = "egress"  # from the VM
    ANY = "any"


class Action(enum.Enum):
    OFFLOAD = "offload"
    ONLOAD = "onload"


@dataclasses.dataclass(frozen=True)
class HeaderRule:
    name: str
    action: Action
    port: str = "*"
    direction: Direction = Direction.ANY
    ip_proto: int | None = None
    ipv4_src: ipaddress.IPv4Network | None = None
    ipv4_dst: ipaddress.IPv4Network | None = None
    tp_src: int | None = None
    tp_dst: int | None = None

    def matches(self, flow: FlowMatch, port: str, direction: Direction) -> bool:
        """Whether this rule judges ``flow`` seen by the dispatcher of ``port``."""
        checks = (
            self.port in ("*", port),
            self.direction in (Direction.ANY, direction),
            self.ip_proto in (None, flow.ip_proto),
            self.tp_src in (None, flow.tp_src),
            self.tp_dst in (None, flow.tp_dst),
            self.ipv4_src is None or ipaddress.IPv4Address(flow.ipv4_src) in self.ipv4_src,
            self.ipv4_dst is None or ipaddress.IPv4Address(flow.ipv4_dst) in self.ipv4_dst,
        )
        return all(checks)


@dataclasses.dataclass(frozen=True)
class StatisticsRule:
    window_s: float = 1.0
    promote_pps: float = 0.0  # 0: no packet-rate trigger
    promote_bytes: int = 0  # bytes within the window; 0: no bytes trigger
    demote_pps: float = 0.0
    demote_bytes: int = 0
    demote_intervals: int = 3

    @property
    def enabled(self) -> bool:
        return self.promote_pps > 0 or self.promote_bytes > 0


@dataclasses.dataclass(frozen=True)
class Policy:
    capacity: int = 1024
    header_rules: tuple[HeaderRule, ...] = ()
    statistics: StatisticsRule = dataclasses.field(default_factory=StatisticsRule)
    source: str = "<defaults>"


@dataclasses.dataclass(frozen=True)
class SetupDecision:
    """What a header rule said at flow setup."""

    action: Action | None  # None: no rule matched, statistics decide
    rule: str = ""

    @property
    def offload(self) -> bool:
        return self.action is Action.OFFLOAD

    @property
    def pinned_onload(self) -> bool:
        return self.action is Action.ONLOAD


@dataclasses.dataclass(frozen=True)
class Rate:
    """A flow's traffic over the trailing window."""

    pps: float
    bytes_in_window: int


# -- decisions ---------------------------------------------------------------
def decide_at_setup(
    policy: Policy, flow: FlowMatch, port: str, direction: Direction
) -> SetupDecision:
    """The first matching header rule's verdict (rules are ordered, first wins).

    >>> rule = HeaderRule(name="iperf", action=Action.OFFLOAD, ip_proto=6, tp_dst=5201)
    >>> flow = FlowMatch("phy0", 6, "10.0.0.1", "10.0.0.2", 40000, 5201)
    >>> decide_at_setup(Policy(header_rules=(rule,)), flow, "tap0", Direction.INGRESS).rule
    'iperf'
    """
    for rule in policy.header_rules:
        if rule.matches(flow, port, direction):
            return SetupDecision(rule.action, rule.name)
    return SetupDecision(None)


def should_promote(rule: StatisticsRule, rate: Rate) -> bool:
    """Above either upper mark.

    >>> should_promote(StatisticsRule(promote_pps=1000, demote_pps=100), Rate(1500, 0))
    True
    """
    return (rule.promote_pps > 0 and rate.pps >= rule.promote_pps) or (
        rule.promote_bytes > 0 and rate.bytes_in_window >= rule.promote_bytes
    )


def is_below_demote_marks(rule: StatisticsRule, rate: Rate) -> bool:
    """Below every lower mark that is set (an unset mark is always satisfied).

    >>> is_below_demote_marks(StatisticsRule(promote_pps=1000, demote_pps=100), Rate(50, 10**9))
    True
    """
    if not rule.enabled:
        return False
    below_pps = rule.promote_pps <= 0 or rate.pps < rule.demote_pps
    below_bytes = rule.promote_bytes <= 0 or rate.bytes_in_window < rule.demote_bytes
    return below_pps and below_bytes


def next_quiet_count(rule: StatisticsRule, rate: Rate, quiet_so_far: int) -> int:
    """Consecutive polls an offloaded flow has spent below the lower marks."""
    return quiet_so_far + 1 if is_below_demote_marks(rule, rate) else 0


def should_demote(rule: StatisticsRule, quiet_polls: int) -> bool:
    """Hysteresis: only after ``demote_intervals`` quiet polls in a row.

    >>> rule = StatisticsRule(promote_pps=1000, demote_pps=100, demote_intervals=3)
    >>> [should_demote(rule, n) for n in (1, 2, 3)]
    [False, False, True]
    """
    return rule.enabled and quiet_polls >= rule.demote_intervals


@dataclasses.dataclass(frozen=True)
class Admission:
    admitted: tuple[Any, ...]
    evicted: tuple[Any, ...]
    refused: Mapping[Any, str]


def plan_admission(
    capacity: int,
    offloaded: Mapping[K, float],
    candidates: Sequence[tuple[K, float, bool]],
) -> Admission:
    """Fit candidates into an offload table of ``capacity``, evicting the slowest.

    ``offloaded`` maps flows now offloaded to their packet rate; each candidate
    is ``(flow, rate, forced)`` — ``forced`` for a header rule's offload, which
    is the operator's intent and may evict any slower flow; a statistics
    promotion evicts only a flow slower than itself.  Fastest candidates first.

    >>> plan = plan_admission(2, {"a": 10.0, "b": 500.0}, [("c", 900.0, False)])
    >>> plan.admitted, plan.evicted
    (('c',), ('a',))
    >>> plan_admission(1, {"a": 10.0}, [("c", 5.0, False)]).refused["c"]
    'offload table full (1 entries); slowest offloaded flow is faster (10 pps)'
    """
    table = dict(offloaded)
    admitted: list[K] = []
    evicted: list[K] = []
    refused: dict[K, str] = {}
    for flow, rate, forced in sorted(candidates, key=lambda c: (not c[2], -c[1])):
        if capacity <= 0:
            refused[flow] = "offload capacity is 0"
            continue
        if len(table) >= capacity:
            slowest = min(table, key=lambda k: table[k])
            if not forced and table[slowest] >= rate:
                refused[flow] = (
                    f"offload table full ({capacity} entries); slowest offloaded flow "
                    f"is faster ({table[slowest]:.0f} pps)"
                )
                continue
            del table[slowest]
            if slowest in admitted:
                admitted.remove(slowest)
            else:
                evicted.append(slowest)
        table[flow] = rate
        admitted.append(flow)
    return Admission(tuple(admitted), tuple(evicted), refused)


def window_rate(samples: Sequence[tuple[float, int, int]], window_s: float) -> Rate:
    """Rate over the trailing window from ``(time, packets, bytes)`` samples (oldest first).

    >>> window_rate([(0.0, 0, 0), (0.5, 500, 50_000), (1.0, 1500, 150_000)], 1.0)
    Rate(pps=1500.0, bytes_in_window=150000)
    """
    if len(samples) < 2:
        return Rate(0.0, 0)
    now, packets, octets = samples[-1]
    start = samples[0]
    for sample in samples:
        if sample[0] >= now - window_s - 1e-9:
            start = sample
            break
    if start is samples[-1]:
        start = samples[-2]
    elapsed = now - start[0]
    if elapsed <= 0:
        return Rate(0.0, 0)
    return Rate((packets - start[1]) / elapsed, octets - start[2])


# -- parsing and validation ----------------------------------------------------
_TOP_FIELDS = {"capacity", "header_rules", "statistics"}
_RULE_FIELDS = {f.name for f in dataclasses.fields(HeaderRule)}
_STAT_FIELDS = {f.name for f in dataclasses.fields(StatisticsRule)}
_PROTOS = {
    "tcp": IPPROTO_TCP,
    "udp": IPPROTO_UDP,
    IPPROTO_TCP: IPPROTO_TCP,
    IPPROTO_UDP: IPPROTO_UDP,
}


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; raise :class:`PolicyError` naming the field."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(source=source, field="file", reason=exc.strerror or str(exc)) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyError(source=source, field="syntax", reason=str(exc)) from exc
    return parse_policy({} if data is None else data, source)


def parse_policy(data: object, source: str = "<policy>") -> Policy:
    """Build a :class:`Policy` from decoded YAML/JSON, or raise naming the field."""
    checker = _Checker(source)
    top = checker.mapping(data, "policy", _TOP_FIELDS)
    capacity = checker.integer(top.get("capacity", 1024), "capacity", 0, MAX_CAPACITY)
    raw_rules = top.get("header_rules", [])
    if not isinstance(raw_rules, list):
        checker.fail("header_rules", "must be a list of rules")
    if len(raw_rules) > MAX_RULES:
        checker.fail("header_rules", f"{len(raw_rules)} rules; at most {MAX_RULES}")
    rules = tuple(checker.header_rule(raw, i) for i, raw in enumerate(raw_rules))
    names = [r.name for r in rules]
    for i, name in enumerate(names):
        if name in names[:i]:
            checker.fail(f"header_rules[{i}].name", f"duplicate rule name {name!r}")
    stats = checker.statistics(top.get("statistics", {}))
    return Policy(capacity=capacity, header_rules=rules, statistics=stats, source=source)


class _Checker:
    """Field-by-field validation that names the field in every error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, reason: str) -> None:
        raise PolicyError(source=self.source, field=field, reason=reason)

    def mapping(self, data: object, field: str, known: Iterable[str]) -> dict[str, Any]:
        if not isinstance(data, dict):
            self.fail(field, f"must be a mapping, not {type(data).__name__}")
        allowed = set(known)
        for key in data:
            if key not in allowed:
                where = key if field == "policy" else f"{field}.{key}"
                self.fail(str(where), f"unknown field (known: {', '.join(sorted(allowed))})")
        return data  # type: ignore[return-value]

    def integer(self, value: object, field: str, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(field, f"must be an integer, not {value!r}")
        if not low <= value <= high:  # type: ignore[operator]
            self.fail(field, f"{value} is outside {low}..{high}")
        return value  # type: ignore[return-value]

    def number(self, value: object, field: str, low: float, high: float) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(field, f"must be a number, not {value!r}")
        if not low <= value <= high:  # type: ignore[operator]
            self.fail(field, f"{value} is outside {low}..{high}")
        return float(value)  # type: ignore[arg-type]

    def choice(self, value: object, field: str, enum_type: type[enum.Enum]) -> Any:
        try:
            return enum_type(value)
        except ValueError:
            options = ", ".join(m.value for m in enum_type)
            self.fail(field, f"{value!r} is not one of {options}")

    def network(self, value: object, field: str) -> ipaddress.IPv4Network:
        try:
            return ipaddress.IPv4Network(str(value), strict=False)
        except ValueError as exc:
            self.fail(field, str(exc))
            raise  # unreachable: fail raises

    def header_rule(self, raw: object, index: int) -> HeaderRule:
        where = f"header_rules[{index}]"
        data = self.mapping(raw, where, _RULE_FIELDS)
        for needed in ("name", "action"):
            if needed not in data:
                self.fail(f"{where}.{needed}", "is required")
        name = data["name"]
        if not isinstance(name, str) or not 1 <= len(name) <= 64:
            self.fail(f"{where}.name", "must be a string of 1-64 characters")
        port = str(data.get("port", "*"))
        if not PORT_NAME_RE.match(port):
            self.fail(f"{where}.port", f"{port!r} is not a port name or '*'")
        proto = data.get("ip_proto")
        if proto is not None and proto not in _PROTOS:
            self.fail(f"{where}.ip_proto", f"{proto!r} is not tcp or udp")
        ports = {
            key: self.integer(data[key], f"{where}.{key}", 0, 0xFFFF)
            for key in ("tp_src", "tp_dst")
            if data.get(key) is not None
        }
        if ports and proto is None:
            self.fail(f"{where}.ip_proto", "tp_src/tp_dst need ip_proto (tcp or udp)")
        nets = {
            key: self.network(data[key], f"{where}.{key}")
            for key in ("ipv4_src", "ipv4_dst")
            if data.get(key) is not None
        }
        return HeaderRule(
            name=name,
            action=self.choice(data["action"], f"{where}.action", Action),
            port=port,
            direction=self.choice(data.get("direction", "any"), f"{where}.direction", Direction),
            ip_proto=None if proto is None else _PROTOS[proto],
            **ports,
            **nets,
        )

    def statistics(self, raw: object) -> StatisticsRule:
        data = self.mapping(raw, "statistics", _STAT_FIELDS)
        rule = StatisticsRule(
            window_s=self.number(data.get("window_s", 1.0), "statistics.window_s", 0.05, 3600.0),
            promote_pps=self.number(data.get("promote_pps", 0), "statistics.promote_pps", 0, 1e10),
            promote_bytes=self.integer(
                data.get("promote_bytes", 0), "statistics.promote_bytes", 0, 2**62
            ),
            demote_pps=self.number(data.get("demote_pps", 0), "statistics.demote_pps", 0, 1e10),
            demote_bytes=self.integer(
                data.get("demote_bytes", 0), "statistics.demote_bytes", 0, 2**62
            ),
            demote_intervals=self.integer(
                data.get("demote_intervals", 3), "statistics.demote_intervals", 1, 10_000
            ),
        )
        self._check_marks(rule, data)
        return rule

    def _check_marks(self, rule: StatisticsRule, data: Mapping[str, object]) -> None:
        """The lower (demote) mark must sit strictly below the upper (promote) mark."""
        for kind in ("pps", "bytes"):
            promote = getattr(rule, f"promote_{kind}")
            demote = getattr(rule, f"demote_{kind}")
            if promote > 0 and demote >= promote:
                self.fail(
                    f"statistics.demote_{kind}",
                    f"{demote} must be below promote_{kind} ({promote}) — "
                    "otherwise a flow would be demoted as soon as it is promoted",
                )
            if promote == 0 and f"demote_{kind}" in data and demote > 0:
                self.fail(f"statistics.demote_{kind}", f"set without promote_{kind}")
