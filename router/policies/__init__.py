"""Routing policies: one per module, behind the ``RoutingPolicy`` interface in ``base``; ``PolicyName``
names them (the router's ``policy`` setting, ``TANDEM_ROUTER_POLICY``)."""

from router.policies.base import Candidate, Decision, PolicyName, ReasonCode, RoutingPolicy, RoutingRequest
from router.policies.cache_aware import CacheAware, CacheAwareConfig, PeerReach, PrefixLookup
from router.policies.least_loaded import LeastLoaded
from router.policies.round_robin import RoundRobin

__all__ = [
    "CacheAware",
    "CacheAwareConfig",
    "PeerReach",
    "Candidate",
    "Decision",
    "LeastLoaded",
    "PolicyName",
    "PrefixLookup",
    "ReasonCode",
    "RoundRobin",
    "RoutingPolicy",
    "RoutingRequest",
]
