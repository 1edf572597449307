"""Admission: API keys and tenants, rate limits (Redis Lua), priority classes and per-node queues.

FastAPI glue lives in ``router.admission.http``; the ``tandem keys`` CLI in ``router.admission.cli``.
"""

from router.admission.context import AdmissionContext, AdmissionSettings
from router.admission.deadline import DEADLINE_HEADER, request_deadline
from router.admission.key_records import bearer_token, hash_key
from router.admission.keys import ApiKeyInfo, KeyStore, Tenant
from router.admission.priority import AdmissionController, NodeQueueStats
from router.admission.priority_class import PRIORITY_HEADER, Priority, resolve_priority
from router.admission.ratelimit import Admission, Gatekeeper, GlobalLimits

__all__ = [
    "DEADLINE_HEADER",
    "PRIORITY_HEADER",
    "Admission",
    "AdmissionContext",
    "AdmissionController",
    "AdmissionSettings",
    "ApiKeyInfo",
    "Gatekeeper",
    "GlobalLimits",
    "KeyStore",
    "NodeQueueStats",
    "Priority",
    "Tenant",
    "bearer_token",
    "hash_key",
    "request_deadline",
    "resolve_priority",
]
