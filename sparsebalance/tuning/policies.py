"""The DST policy registry: name -> ``policy(inst, dst) -> Plan``.

A policy is a pure function of a planning
:class:`~sparsebalance.tuning.instance.Instance` and the run's
:class:`~sparsebalance.config.DSTConfig`, returning a
:class:`~sparsebalance.tuning.plan.Plan` (usually via ``make_plan``). ``--sb-dst`` and
``python -m sparsebalance.tuning plan --policy`` offer these keys (plus "off" for the
driver). A new policy is one file in this package plus one line here.
"""

from __future__ import annotations

from sparsebalance.registry import Registry

from . import anchor, critical_path
from .plan import static_policy

DST_POLICIES = Registry("DST policy", {
    "anchor": anchor.policy,
    "critical-path": critical_path.policy,
    "static": static_policy,
})
"""Name -> DST policy."""
