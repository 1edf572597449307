"""Huge pages for the KV cache: the advice applies to the 2 MiB-aligned part of a buffer, never
touches its contents, and says what it did."""

from __future__ import annotations

import numpy as np

from kv_transfer.hugepages import advise_huge_pages


def test_a_large_buffer_gets_huge_pages_and_keeps_its_bytes() -> None:
    buf = np.random.default_rng(3).integers(0, 255, size=16 << 20, dtype=np.uint8)
    before = buf.copy()
    assert advise_huge_pages(buf.ctypes.data, buf.nbytes) in ("collapsed", "advised", "unsupported")
    np.testing.assert_array_equal(buf, before)


def test_a_buffer_without_a_whole_aligned_huge_page_is_left_alone() -> None:
    buf = np.zeros(1 << 20, np.uint8)
    assert advise_huge_pages(buf.ctypes.data, buf.nbytes) == "too small"
