"""``tandem bench kv-transfer``'s results: the samples a run measures, their summary per transport and
size against the memcpy ceiling and NIXL, the targets, the RESULT line and the plot (``bench.kv_transfer``
runs the clusters and says what each figure means)."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console

from kv_transfer.config import TransportName
from kv_transfer.hugepages import advise_huge_pages

if TYPE_CHECKING:
    from bench.kv_transfer import KvBenchConfig

console = Console(stderr=True)


TRANSPORTS = tuple(t.value for t in TransportName if t is not TransportName.AUTO)


CROSS_HOST = (TransportName.TCP.value, TransportName.UCX.value)


@dataclass
class Sample:
    transport: str
    tokens: int
    nbytes: float
    seconds: float
    exposed_s: float | None = None
    """From the prefill leg's answer to the decode engine's last block (our connector only)."""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


def quartiles(values: list[float]) -> tuple[float, float]:
    """(p25, p75), inclusive method (a single value is its own quartiles)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def memcpy_ceiling(nbytes: int, block_nbytes: int, repeats: int = 5) -> float:
    """GB/s of an in-process copy of ``nbytes`` in engine-sized blocks (the same work a transfer does,
    minus everything between two processes)."""
    blocks = max(1, nbytes // block_nbytes)
    src = np.random.default_rng(0).integers(0, 255, size=(blocks, block_nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first, as a warm engine cache is
    for a in (src, dst):  # and on huge pages, as the connector backs the engines' caches
        advise_huge_pages(a.ctypes.data, a.nbytes)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best / 1e9


def block_nbytes_of(samples: list[Sample]) -> float:
    """Bytes of one 128-token block across all layers, from the largest tandem sample."""
    s = max((x for x in samples if x.transport.startswith("tandem")), key=lambda x: x.tokens)
    return s.nbytes / -(-s.tokens // 128)


def _median_ms(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(statistics.median(got) * 1000, 2) if got else None


def summarise(
    samples: list[Sample],
    cfg: KvBenchConfig,
    ttfts: dict[str, float],
    block_nbytes: int,
    fixed: list[Sample] | None = None,
    *,
    memcpy_gbps: float | None = None,
) -> dict:
    """``memcpy_gbps``: the ceiling, when already measured (tests); else measured here."""
    table = _table(samples, cfg.sizes)
    top = str(max(cfg.sizes))
    top_bytes = int(table["tandem-shm"][top]["mbytes"] * 1e6)
    memcpy = memcpy_ceiling(top_bytes, block_nbytes) if memcpy_gbps is None else memcpy_gbps

    def g(name: str) -> float | None:
        return table.get(name, {}).get(top, {}).get("gbps")

    ours = {t: g(f"tandem-{t}") for t in TRANSPORTS}
    best = max((t for t, v in ours.items() if v is not None), key=lambda t: ours[t] or 0.0)
    fixed_s = {t: sorted(x.seconds for x in fixed or () if x.transport == f"fixed-{t}") for t in TRANSPORTS}
    result = {
        "config": cfg.__dict__ | {"sizes": list(cfg.sizes)},
        "transfers": table,
        "samples": [s.__dict__ | {"gbps": round(s.gbps, 3)} for s in samples],
        "memcpy_gbps": round(memcpy, 3),
        "ttft_ms": {k: round(v, 1) for k, v in ttfts.items()},
        "best_gbps": max(v for v in ours.values() if v is not None),
        "tcp_gbps": max((v for t, v in ours.items() if t in CROSS_HOST and v is not None), default=None),
        "nixl_gbps": g("nixl"),
        "nixl_tcp_gbps": g("nixl_tcp"),
        "best_transport": best,
        "pull_fixed_ms": {t: _median_ms(list(v)) for t, v in fixed_s.items()},
        "pull_fixed_spread_ms": {t: _spread_ms(v) for t, v in fixed_s.items()},
        "pull_fixed_count": {t: len(v) for t, v in fixed_s.items()},
        "pull_fixed_samples": [s.__dict__ for s in fixed or ()],
        "exposed_whole_ms": {t: table.get(f"tandem-{t}", {}).get(top, {}).get("exposed_ms") for t in TRANSPORTS},
        "exposed_layerwise_ms": {t: table.get(f"layerwise-{t}", {}).get(top, {}).get("exposed_ms") for t in TRANSPORTS},
    }
    result["targets"] = _targets(result, memcpy)
    console.print(json.dumps(result["targets"]))
    print(result_line(result, ttfts), flush=True)
    return result


def _spread_ms(seconds: list[float]) -> list[float] | None:
    return [round(q * 1000, 2) for q in quartiles(seconds)] if seconds else None


def _table(samples: list[Sample], sizes: tuple[int, ...]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per source (``tandem-<transport>``, ``layerwise-<transport>``, ``nixl``...) and nearest configured
    size: the medians of its samples."""
    by: dict[str, dict[int, list[Sample]]] = {}
    for s in samples:
        size = min(sizes, key=lambda x: abs(x - s.tokens))
        by.setdefault(s.transport, {}).setdefault(size, []).append(s)
    return {
        name: {
            str(size): {
                "tokens": int(statistics.median(x.tokens for x in xs)),
                "mbytes": round(statistics.median(x.nbytes for x in xs) / 1e6, 2),
                "ms": round(statistics.median(x.seconds for x in xs) * 1000, 2),
                "gbps": round(statistics.median(x.gbps for x in xs), 3),
                "exposed_ms": _median_ms([x.exposed_s for x in xs]),
            }
            for size, xs in per_size.items()
        }
        for name, per_size in by.items()
    }


def _targets(result: dict[str, Any], memcpy: float) -> dict[str, Any]:
    fixed_ms = result["pull_fixed_ms"][result["best_transport"]]
    whole, layerwise = result["exposed_whole_ms"], result["exposed_layerwise_ms"]
    return {
        "best_vs_memcpy": round(result["best_gbps"] / memcpy, 3),
        "best_at_least_60pct_memcpy": result["best_gbps"] >= 0.6 * memcpy,
        # None: NIXL was not measured (--no-nixl, or it failed to load); a comparison without its other
        # side is not a pass
        "best_not_slower_than_nixl": None
        if result["nixl_gbps"] is None
        else result["best_gbps"] >= result["nixl_gbps"],
        "tcp_not_slower_than_nixl_tcp": None
        if result["nixl_tcp_gbps"] is None
        else (result["tcp_gbps"] or 0) >= result["nixl_tcp_gbps"],
        "pull_fixed_at_most_3ms": fixed_ms is not None and fixed_ms <= 3.0,
        # on shm and on tcp; None: not measured on one of them
        "layerwise_at_most_30pct_of_whole": None
        if any(layerwise.get(t) is None or whole.get(t) is None for t in ("shm", "tcp"))
        else all((layerwise[t] or 0.0) <= 0.3 * (whole[t] or 0.0) for t in ("shm", "tcp")),
    }


def result_line(result: dict[str, Any], ttfts: dict[str, float]) -> str:
    """The RESULT line: transfer figures at the largest prompt, exposed and fixed on the best transport."""
    best = result["best_transport"]
    spread = result["pull_fixed_spread_ms"][best] or [None, None]
    fields = (
        ("best_gbps", result["best_gbps"]),
        ("memcpy_gbps", result["memcpy_gbps"]),
        ("nixl_gbps", result["nixl_gbps"]),
        ("tcp_gbps", result["tcp_gbps"]),
        ("nixl_tcp_gbps", result["nixl_tcp_gbps"]),
        ("ttft_pd_ms", ttfts.get("pd")),
        ("ttft_colo_ms", ttfts.get("colo")),
        ("exposed_whole_ms", result["exposed_whole_ms"][best]),
        ("exposed_layerwise_ms", result["exposed_layerwise_ms"].get(best)),
        ("pull_fixed_ms", result["pull_fixed_ms"][best]),
        ("ttft_pd_layerwise_ms", ttfts.get("pd_layerwise")),
        ("ttft_pd_sequential_ms", ttfts.get("pd_sequential")),
        ("pull_fixed_p25_ms", spread[0]),
        ("pull_fixed_p75_ms", spread[1]),
    )
    return "RESULT " + " ".join(f"{k}={_fmt(v)}" for k, v in fields)


def _fmt(v: float | None) -> str:
    return "na" if v is None else f"{v:.3f}" if v < 100 else f"{v:.1f}"


def plot(result: dict[str, Any], out_png: Path) -> None:
    """Three panels: whole pulls' GB/s against the memcpy ceiling; the exposed time (prefill's answer to
    every block in place) of whole pulls against layer-wise ones, per transport (layer-wise pulls have
    no GB/s of their own: they span the prefill); and the fixed cost of a 1-block pull, median and
    quartiles, against its 3 ms target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    colors = {t: f"C{i}" for i, t in enumerate((*TRANSPORTS, "nixl", "nixl_tcp"))}
    transfers = result["transfers"]
    for name, sizes in sorted(transfers.items()):
        if name.startswith("layerwise-"):
            continue
        xs = sorted(sizes, key=int)
        label = name.removeprefix("tandem-")
        ax1.plot(
            [sizes[x]["tokens"] for x in xs], [sizes[x]["gbps"] for x in xs], "o-", color=colors[label], label=label
        )
    ax1.axhline(result["memcpy_gbps"], color="grey", linestyle="--", label="memcpy ceiling")
    ax1.set(xlabel="prompt tokens", ylabel="GB/s (median of whole pulls)", title="Whole-pull throughput")
    for t in TRANSPORTS:
        for kind, style in (("tandem", "o-"), ("layerwise", "s--")):
            sizes = transfers.get(f"{kind}-{t}", {})
            xs = [x for x in sorted(sizes, key=int) if sizes[x]["exposed_ms"] is not None]
            if xs:
                label = f"{t} {'whole' if kind == 'tandem' else 'layer-wise'}"
                ax2.plot(
                    [sizes[x]["tokens"] for x in xs],
                    [sizes[x]["exposed_ms"] for x in xs],
                    style,
                    color=colors[t],
                    label=label,
                )
    ax2.axhline(0, color="black", lw=0.8)
    ax2.set_yscale("symlog", linthresh=10)
    ax2.set(xlabel="prompt tokens", ylabel="ms after the prefill's answer (symlog)", title="Exposed transfer time")
    spread = result["pull_fixed_spread_ms"]
    shown = [t for t in TRANSPORTS if result["pull_fixed_ms"].get(t) is not None]
    medians = [result["pull_fixed_ms"][t] for t in shown]
    quartiles = [spread[t] or [m, m] for t, m in zip(shown, medians, strict=True)]
    low = [m - q[0] for m, q in zip(medians, quartiles, strict=True)]
    high = [q[1] - m for m, q in zip(medians, quartiles, strict=True)]
    ax3.bar(shown, medians, yerr=[low, high], capsize=4, color=[colors[t] for t in shown])
    ax3.axhline(3.0, color="grey", linestyle="--", label="target (3 ms)")
    ax3.set(ylabel="ms (median, quartiles)", title="Fixed cost: a 1-block pull")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    dtype = result["config"].get("dtype", "")
    fig.suptitle(f"tandem bench kv-transfer: 1P+1D real engines, {dtype}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
