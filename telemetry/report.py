"""``tandem lake report``: one HTML page with PNG plots, from the lake.

Sections (each a query in ``telemetry.query`` terms, then one matplotlib figure, Agg backend):

    hit_rate_over_time   fleet / routed / engine cached tokens over prompt tokens, per time bucket
    hit_rate_by_session  the same per session (top sessions by prompt tokens) and per tenant
    latency              TTFT and ITL (mean, p99) distributions, log scale, with p50/p99 marks
    pd_decisions         requests per routing decision and per prefill -> decode pair, and reasons
    transfers            KV transfer time distribution and time against bytes

An empty lake (or one without request rows) still produces ``index.html``, saying so.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import duckdb  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

from telemetry.query import connect  # noqa: E402

SECTIONS = ("hit_rate_over_time", "hit_rate_by_session", "latency", "pd_decisions", "transfers")


@dataclass(slots=True)
class Report:
    out: Path
    index: Path
    images: list[Path] = field(default_factory=list)
    requests: int = 0
    empty: bool = False


def _rows(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple]:
    return con.execute(sql).fetchall()


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _hit_rate_over_time(con: duckdb.DuckDBPyConnection, out: Path) -> Path:
    span = _rows(con, "SELECT epoch(max(event_time)) - epoch(min(event_time)) FROM requests")[0][0] or 0
    bucket = "1 minute" if span <= 6 * 3600 else "1 hour"
    rows = _rows(
        con,
        f"""SELECT time_bucket(INTERVAL '{bucket}', event_time) AS t,
                  sum(fleet_cached_tokens) / nullif(sum(prompt_tokens), 0),
                  sum(routed_cached_tokens) / nullif(sum(prompt_tokens), 0),
                  sum(engine_cached_tokens) / nullif(sum(prompt_tokens), 0)
           FROM requests GROUP BY t ORDER BY t""",
    )
    fig, ax = plt.subplots(figsize=(9, 4))
    ts = [r[0] for r in rows]
    for i, label in enumerate(("fleet had it", "routed node had it", "engine reused")):
        ax.plot(ts, [r[i + 1] if r[i + 1] is not None else float("nan") for r in rows], marker="o", label=label)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title(f"Hit-rate breakdown per {bucket}")
    ax.legend()
    fig.autofmt_xdate()
    return _save(fig, out / "hit_rate_over_time.png")


def _hit_rate_by_session(con: duckdb.DuckDBPyConnection, out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "session_id", "top sessions"), (axes[1], "tenant_id", "tenants")):
        rows = _rows(
            con,
            f"""SELECT coalesce({key}, '(none)') AS k,
                      sum(fleet_cached_tokens) / nullif(sum(prompt_tokens), 0),
                      sum(routed_cached_tokens) / nullif(sum(prompt_tokens), 0),
                      sum(engine_cached_tokens) / nullif(sum(prompt_tokens), 0)
               FROM requests GROUP BY k ORDER BY sum(prompt_tokens) DESC NULLS LAST LIMIT 15""",
        )
        xs = range(len(rows))
        w = 0.27
        for i, label in enumerate(("fleet", "routed", "engine")):
            ax.bar([x + (i - 1) * w for x in xs], [r[i + 1] or 0 for r in rows], w, label=label)
        ax.set_xticks(list(xs), [str(r[0])[:14] for r in rows], rotation=60, ha="right", fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"Hit rate by {title}")
        ax.legend(fontsize=7)
    return _save(fig, out / "hit_rate_by_session.png")


def _latency(con: duckdb.DuckDBPyConnection, out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, cols, title in (
        (axes[0], ("ttft_s",), "TTFT"),
        (axes[1], ("itl_mean_s", "itl_p99_s"), "ITL (per-request mean and p99)"),
    ):
        for col in cols:
            vals = [r[0] for r in _rows(con, f"SELECT {col} FROM requests WHERE {col} > 0")]
            if not vals:
                continue
            vals.sort()
            p50, p99 = vals[len(vals) // 2], vals[min(len(vals) - 1, int(len(vals) * 0.99))]
            ax.hist(vals, bins=40, alpha=0.6, label=f"{col} p50={p50 * 1e3:.0f}ms p99={p99 * 1e3:.0f}ms")
        ax.set_xlabel("seconds")
        ax.set_title(title)
        ax.legend(fontsize=7)
    return _save(fig, out / "latency.png")


def _pd_decisions(con: duckdb.DuckDBPyConnection, out: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    queries = (
        ("coalesce(routing_decision, '(none)')", "decision"),
        ("coalesce(prefill_node, '-') || ' -> ' || coalesce(decode_node, '-')", "prefill -> decode"),
        ("coalesce(routing_reason, '(none)')", "reason"),
    )
    for ax, (expr, title) in zip(axes, queries, strict=True):
        rows = _rows(con, f"SELECT {expr} AS k, count(*) FROM requests GROUP BY k ORDER BY 2 DESC LIMIT 15")
        ax.barh([str(r[0])[:30] for r in rows], [r[1] for r in rows])
        ax.invert_yaxis()
        ax.set_title(f"Requests by {title}")
        ax.tick_params(axis="y", labelsize=7)
    return _save(fig, out / "pd_decisions.png")


def _transfers(con: duckdb.DuckDBPyConnection, out: Path) -> Path:
    rows = _rows(con, "SELECT transfer_s, transfer_bytes FROM requests WHERE transfer_s IS NOT NULL")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    if rows:
        axes[0].hist([r[0] for r in rows], bins=40)
        axes[1].scatter([(r[1] or 0) / 1e6 for r in rows], [r[0] for r in rows], s=6)
    else:
        for ax in axes:
            ax.text(0.5, 0.5, "no KV transfers recorded", ha="center", va="center", transform=ax.transAxes)
    axes[0].set_title("KV transfer time")
    axes[0].set_xlabel("seconds")
    axes[1].set_title("Transfer time vs size")
    axes[1].set_xlabel("MB")
    axes[1].set_ylabel("seconds")
    return _save(fig, out / "transfers.png")


_RENDER: dict[str, Callable[[duckdb.DuckDBPyConnection, Path], Path]] = {
    "hit_rate_over_time": _hit_rate_over_time,
    "hit_rate_by_session": _hit_rate_by_session,
    "latency": _latency,
    "pd_decisions": _pd_decisions,
    "transfers": _transfers,
}


def _summary(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    r = _rows(
        con,
        """SELECT count(*), count(DISTINCT session_id), min(event_time), max(event_time),
                  quantile_cont(ttft_s, 0.5), quantile_cont(ttft_s, 0.99),
                  sum(fleet_cached_tokens) / nullif(sum(prompt_tokens), 0),
                  sum(routed_cached_tokens) / nullif(sum(prompt_tokens), 0),
                  sum(engine_cached_tokens) / nullif(sum(prompt_tokens), 0),
                  count(*) FILTER (WHERE status <> 'ok')
           FROM requests""",
    )[0]

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:.1f}%"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    others = {t: _rows(con, f"SELECT count(*) FROM {t}")[0][0] for t in ("tool_calls", "feedback", "errors")}
    return [
        ("requests", str(r[0])),
        ("sessions", str(r[1])),
        ("from", str(r[2])),
        ("to", str(r[3])),
        ("TTFT p50 / p99", f"{ms(r[4])} / {ms(r[5])}"),
        ("hit rate fleet / routed / engine", f"{pct(r[6])} / {pct(r[7])} / {pct(r[8])}"),
        ("requests not ok", str(r[9])),
        *((t, str(n)) for t, n in others.items()),
    ]


def render_report(lake: Path, out: Path, *, on_step: Callable[[str], None] | None = None) -> Report:
    """Render ``out/index.html`` and its PNGs from ``lake``. ``on_step(name)`` after each section."""
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out=out, index=out / "index.html")
    con = connect(lake)
    try:
        rep.requests = _rows(con, "SELECT count(*) FROM requests")[0][0]
        if rep.requests == 0:
            rep.empty = True
            rep.index.write_text(
                "<!doctype html><html><head><meta charset='utf-8'><title>Tandem lake report</title></head>"
                f"<body><h1>Tandem lake report</h1><p>The lake at <code>{html.escape(str(lake))}</code> "
                "holds no request records yet: nothing to plot. Start <code>tandem telemetry consume</code>"
                " and send some traffic.</p></body></html>\n"
            )
            return rep
        summary = _summary(con)
        for name in SECTIONS:
            rep.images.append(_RENDER[name](con, out))
            if on_step is not None:
                on_step(name)
    finally:
        con.close()
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary)
    imgs = "".join(
        f"<h2>{html.escape(p.stem.replace('_', ' '))}</h2><img src='{p.name}' alt='{p.stem}'>" for p in rep.images
    )
    rep.index.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>Tandem lake report</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:left}"
        "img{max-width:100%}</style></head><body><h1>Tandem lake report</h1>"
        f"<p>Lake: <code>{html.escape(str(lake))}</code></p><table>{rows}</table>{imgs}</body></html>\n"
    )
    return rep
