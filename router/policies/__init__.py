"""Routing policies: one per module, behind the ``RoutingPolicy`` interface in ``base``."""

from router.policies.base import Candidate, Decision, RoutingPolicy, RoutingRequest
from router.policies.least_loaded import LeastLoaded

__all__ = ["Candidate", "Decision", "LeastLoaded", "RoutingPolicy", "RoutingRequest"]
