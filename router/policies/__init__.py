"""Routing policies: one per module, behind the ``RoutingPolicy`` interface in ``base``; ``PolicyName``
names them (the router's ``policy`` setting, ``TANDEM_ROUTER_POLICY``)."""

import enum

from router.policies.base import Candidate, Decision, ReasonCode, RoutingPolicy, RoutingRequest
from router.policies.cache_aware import CacheAware, CacheAwareConfig, PrefixLookup
from router.policies.least_loaded import LeastLoaded
from router.policies.round_robin import RoundRobin


class PolicyName(enum.StrEnum):
    CACHE_AWARE = "cache_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


__all__ = [
    "CacheAware",
    "CacheAwareConfig",
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
