"""``tandem plan``: the cheapest fleet that meets latency targets on a recorded trace, by SIMULATION."""

from planner.search import SLO, Plan, Tried, plan

__all__ = ["SLO", "Plan", "Tried", "plan"]
