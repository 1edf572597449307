"""The device path's cache view and staging on CPU tensors: vLLM's two layouts seen as parts, blocks
staged out to the host mirror and back exactly, the copy ordered behind an engine mark and never
synchronizing anything, checksums the host path's, and the host tier's views."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.device.backend import CpuBackend, DoneEvent, backend_for
from kv_transfer.device.host_tier import TierStaging, wait_for
from kv_transfer.device.staging import DeviceKV, device_parts, runs_of
from kv_transfer.layout import checksum

BLOCKS = 12


def _caches(kv_major: bool, layers: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, 16, 2, 8) if kv_major else (BLOCKS, 2, 16, 16)
    return [torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16) for _ in range(layers)]


@pytest.mark.parametrize(("kv_major", "per_layer"), [(True, 2), (False, 1)])
def test_both_vllm_layouts_become_block_major_parts(kv_major: bool, per_layer: int) -> None:
    caches = _caches(kv_major)
    parts, pmap = device_parts(caches, BLOCKS)
    assert pmap.per_layer == per_layer and len(parts) == 3 * per_layer
    assert all(p.shape == (BLOCKS, caches[0].numel() * 2 // BLOCKS // per_layer) for p in parts)
    # block 5 of layer 1's K half is the bytes of caches[1][0, 5]
    expect = caches[1][0, 5] if kv_major else caches[1][5]
    assert bytes(parts[per_layer].numpy()[5]) == bytes(expect.contiguous().view(torch.uint8).numpy())


def test_layouts_that_are_not_paged_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="axis 0"):
        device_parts([torch.zeros(3, BLOCKS, 4)], BLOCKS)
    with pytest.raises(ValueError, match="contiguous"):
        device_parts([torch.zeros(BLOCKS, 4, 2).transpose(1, 2)], BLOCKS)
    with pytest.raises(ValueError, match="differs"):
        device_parts([torch.zeros(2, BLOCKS, 4), torch.zeros(BLOCKS, 8)], BLOCKS)
    with pytest.raises(ValueError, match="no KV"):
        device_parts([], BLOCKS)


def test_runs_of_cuts_where_ids_stop_being_consecutive() -> None:
    assert runs_of([3, 4, 5, 9, 1, 2]) == [(3, 3), (9, 1), (1, 2)]
    assert runs_of([]) == []


def test_stage_out_then_in_moves_exactly_the_blocks_asked() -> None:
    src = DeviceKV(_caches(True, seed=1), BLOCKS, mirror=True)
    dst = DeviceKV([torch.zeros_like(c) for c in _caches(True)], BLOCKS, mirror=True)
    assert not src.on_host and src.host.layers[0].ctypes.data != src.parts[0].data_ptr()
    ids = [2, 3, 7]
    src.stage_out(ids).synchronize()
    for s, d in zip(src.host.layers, dst.host.layers, strict=True):
        d[ids] = s[ids]  # what a pull does between the two mirrors
    dst.stage_in(ids, layers=[0, 2]).synchronize()
    for p in range(len(src.parts)):
        moved = torch.equal(dst.parts[p][ids], src.parts[p][ids])
        assert moved == (p // 2 in (0, 2)), f"part {p}"
        others = [b for b in range(BLOCKS) if b not in ids]
        assert not dst.parts[p][others].any()


def test_checksums_are_the_host_paths_xxh3_over_the_staged_bytes() -> None:
    kv = DeviceKV(_caches(True, seed=2), BLOCKS, mirror=True)
    kv.stage_out([4, 5]).synchronize()
    assert kv.checksums([4, 5]) == [checksum(p[4:6].contiguous().numpy().tobytes()) for p in kv.parts]


def test_a_host_cache_without_mirror_is_served_in_place() -> None:
    caches = _caches(False)
    kv = DeviceKV(caches, BLOCKS)
    assert kv.on_host and kv.host.layers[0].ctypes.data == caches[0].data_ptr()
    assert isinstance(kv.stage_out([0]), DoneEvent)
    assert kv.host.dtype == "bfloat16" and kv.host.block_shape == [caches[0][0].numel() * 2]


class Recording(CpuBackend):
    """A CPU backend that logs what the staging asks of it."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, object]] = []

    def engine_mark(self) -> DoneEvent:
        ev = DoneEvent()
        self.log.append(("mark", ev))
        return ev

    def copy(self, pairs, after):  # noqa: ANN001, ANN201
        self.log.append(("copy", after))
        self.log.append(("pairs", len(pairs)))
        return super().copy(pairs, after)


def test_every_copy_waits_on_a_fresh_engine_mark_one_copy_per_run_and_part() -> None:
    rec = Recording()
    kv = DeviceKV(_caches(True), BLOCKS, rec, mirror=True)
    kv.stage_out([1, 2, 3, 8], layers=[1])
    mark, copy, pairs = rec.log
    assert mark[0] == "mark" and copy == ("copy", mark[1])
    assert pairs == ("pairs", 2 * 2)  # two runs x the layer's K and V parts


def test_host_tier_views_round_trip_through_the_mirror() -> None:
    src = TierStaging(DeviceKV(_caches(True, seed=3), BLOCKS, mirror=True))
    dst = TierStaging(DeviceKV([torch.zeros_like(c) for c in _caches(True)], BLOCKS, mirror=True))
    out = src.offload_parts([6, 9])
    assert len(out) == 2 and len(out[0]) == len(src.kv.parts)
    for block_views, into in zip(out, dst.load_parts([0, 1]), strict=True):
        for v, i in zip(block_views, into, strict=True):
            i[:] = v  # what the tier's read_scatter does
    wait_for(dst.commit([0, 1]))
    for p in range(len(src.kv.parts)):
        assert torch.equal(dst.kv.parts[p][[0, 1]], src.kv.parts[p][[6, 9]])


def test_cuda_backend_without_a_gpu_says_so() -> None:
    if torch.cuda.is_available():
        assert backend_for("cuda").name == "cuda"
    else:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            backend_for("cuda")
    with pytest.raises(ValueError, match="no KV backend"):
        backend_for("mps")
