"""The fit recovers the coefficients that made the points, and keeps them non-negative on noise."""

from __future__ import annotations

import random

import pytest

from profiling.fit import DecodePoint, PrefillPoint, fit_step_model
from simulator.step_model import StepModel


def test_recovers_known_coefficients():
    true = StepModel(base_s=0.01, prefill_s_per_token=3e-4, decode_s_per_seq=2e-3, decode_s_per_ctx_token=1e-7)
    pre = [PrefillPoint(n, true.step_s(n, 0)) for n in (128, 512, 2048, 4096)]
    dec = [DecodePoint(b, c, true.step_s(0, b, b * c)) for b in (1, 4, 16) for c in (256, 2048)]
    got, err = fit_step_model(pre, dec)
    assert err < 1e-6
    for name in ("base_s", "prefill_s_per_token", "decode_s_per_seq", "decode_s_per_ctx_token"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-4)


def test_noise_never_gives_a_negative_coefficient():
    rng = random.Random(0)
    pre = [PrefillPoint(n, 0.02 + 2e-4 * n * rng.uniform(0.7, 1.3)) for n in (100, 200, 400, 800)]
    dec = [DecodePoint(b, 500, 0.02 * rng.uniform(0.7, 1.3)) for b in (1, 2, 4, 8)]  # flat in batch
    got, _ = fit_step_model(pre, dec)
    assert min(got.base_s, got.prefill_s_per_token, got.decode_s_per_seq, got.decode_s_per_ctx_token) >= 0
    with pytest.raises(ValueError):
        fit_step_model(pre[:1], dec)
