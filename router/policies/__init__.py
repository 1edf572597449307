"""Routing policies: one per module, behind the ``RoutingPolicy`` interface in ``base``."""

from router.policies.base import Candidate, Decision, RoutingPolicy, RoutingRequest
from router.policies.cache_aware import CacheAware, CacheAwareConfig, PrefixLookup
from router.policies.least_loaded import LeastLoaded
from router.policies.round_robin import RoundRobin

__all__ = [
    "CacheAware",
    "CacheAwareConfig",
    "Candidate",
    "Decision",
    "LeastLoaded",
    "PrefixLookup",
    "RoundRobin",
    "RoutingPolicy",
    "RoutingRequest",
]
