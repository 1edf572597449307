"""``tandem profile``: measure a real engine and fit the simulator's step model (``simulator.step_model``)."""

from profiling.fit import DecodePoint, PrefillPoint, fit_step_model

__all__ = ["DecodePoint", "PrefillPoint", "fit_step_model"]
