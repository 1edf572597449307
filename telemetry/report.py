"""``tandem lake report``: one HTML page with PNG plots and tables, from the lake.

What counts (the page says it too):
    reached an engine   a request row with a decode node and a status other than ``rejected``. Only
                        these enter hit rates and latency plots: a rejected request (4xx, 429, 503,
                        refused at the edge or by admission) computed nothing, and one 100 MB prompt
                        refused as too long would otherwise add its millions of prompt tokens to the
                        denominator. Requests that never reached an engine are counted apart, by status.
    outcomes            every request row counted once by ``status`` (ok, error, cancelled, rejected);
                        the ``errors`` table holds components' error reports, a different thing, and
                        is labelled so rather than set beside "not ok" as if both counted the same.
    hit rate            sum(cached tokens) / sum(prompt tokens) over requests that reached an engine:
                        fleet (best prefix anywhere), routed (on the node that prefilled, per the index),
                        engine (what the engine confirmed it reused).

Sections (each a DuckDB query over ``telemetry.query.connect``, then one matplotlib figure, Agg):

    hit_rate_over_time   the three hit rates per time bucket
    hit_rate_by_group    per tenant, per session (top 15 by prompt tokens) and per turn position (a
                         session's n-th request that reached an engine, by arrival); also as tables
    miss_attribution     the uncached tokens per time bucket, stacked by kind: cold, evicted, elsewhere,
                         undelivered (``router.kv_index.attribution``); also a table of tokens by kind
                         and, for "elsewhere", by reason
    latency              TTFT and ITL (mean, p99) distributions, with p50/p99 marks
    pd_decisions         requests per routing decision, per prefill -> decode pair, per reason code
                         (``routing_reason_code``; rows from before schema version 2 show as "(no code)")
    transfers            KV transfer time distribution and time against bytes

With ``exports`` (``telemetry.export.view``, read from the session store by the CLI), a table per
export name: format, parts and rows written, the latest run's examples per tenant, its feedback
coverage and what it filtered out by reason; and the tenants' consent.

An empty lake (or one without request rows) still produces ``index.html``, saying so.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import duckdb  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

from telemetry.query import connect  # noqa: E402

if TYPE_CHECKING:
    from telemetry.export.view import ExportView

SECTIONS = ("hit_rate_over_time", "hit_rate_by_group", "miss_attribution", "latency", "pd_decisions", "transfers")

REACHED_ENGINE = "decode_node IS NOT NULL AND coalesce(status, '') <> 'rejected'"
"""SQL condition: the request reached an engine (see the module docstring)."""
_HIT = """sum(fleet_cached_tokens) / nullif(sum(prompt_tokens), 0),
          sum(routed_cached_tokens) / nullif(sum(prompt_tokens), 0),
          sum(engine_cached_tokens) / nullif(sum(prompt_tokens), 0)"""


@dataclass(slots=True)
class Report:
    out: Path
    index: Path
    images: list[Path] = field(default_factory=list)
    requests: int = 0
    empty: bool = False
    summary: list[tuple[str, str]] = field(default_factory=list)
    """The summary table as shown (label, value)."""
    hit_rates: tuple[float | None, float | None, float | None] = (None, None, None)
    """Fleet, routed and engine hit rate over the requests that reached an engine."""
    tables: dict[str, list[tuple[str, int, float | None, float | None, float | None]]] = field(default_factory=dict)
    """Per-group hit rates as shown: group -> rows of (key, requests, fleet, routed, engine)."""


def _rows(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple]:
    return con.execute(sql).fetchall()


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


GroupRow = tuple[str, int, float | None, float | None, float | None]


def _hit_rate_over_time(con: duckdb.DuckDBPyConnection, out: Path, rep: Report) -> Path:
    span = _rows(con, "SELECT epoch(max(event_time)) - epoch(min(event_time)) FROM served")[0][0] or 0
    bucket = "1 minute" if span <= 6 * 3600 else "1 hour"
    rows = _rows(
        con, f"SELECT time_bucket(INTERVAL '{bucket}', event_time) AS t, {_HIT} FROM served GROUP BY t ORDER BY t"
    )
    fig, ax = plt.subplots(figsize=(9, 4))
    ts = [r[0] for r in rows]
    for i, label in enumerate(("fleet had it", "routed node had it", "engine reused")):
        ax.plot(ts, [r[i + 1] if r[i + 1] is not None else float("nan") for r in rows], marker="o", label=label)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title(f"Hit-rate breakdown per {bucket} (requests that reached an engine)")
    ax.legend()
    fig.autofmt_xdate()
    return _save(fig, out / "hit_rate_over_time.png")


_GROUPS: dict[str, str] = {
    # group -> SQL giving (key, requests, fleet, routed, engine), over requests that reached an engine
    "tenant": f"""SELECT coalesce(tenant_id, '(none)') AS k, count(*), {_HIT}
                 FROM served GROUP BY k ORDER BY sum(prompt_tokens) DESC NULLS LAST, k LIMIT 15""",
    "session": f"""SELECT session_id AS k, count(*), {_HIT}
                  FROM served WHERE session_id IS NOT NULL
                  GROUP BY k ORDER BY sum(prompt_tokens) DESC NULLS LAST, k LIMIT 15""",
    "turn position": f"""SELECT CAST(least(turn, 20) AS VARCHAR) || CASE WHEN turn >= 20 THEN '+' ELSE '' END AS k,
                               count(*), {_HIT}
                        FROM (SELECT *, row_number() OVER (PARTITION BY session_id
                                         ORDER BY coalesce(t_arrival, event_time), event_id) AS turn
                              FROM served WHERE session_id IS NOT NULL)
                        GROUP BY least(turn, 20), k ORDER BY least(turn, 20)""",
}


def _hit_rate_by_group(con: duckdb.DuckDBPyConnection, out: Path, rep: Report) -> Path:
    fig, axes = plt.subplots(1, len(_GROUPS), figsize=(15, 4.5))
    for ax, (group, sql) in zip(axes, _GROUPS.items(), strict=True):
        rows: list[GroupRow] = [(str(r[0]), int(r[1]), r[2], r[3], r[4]) for r in _rows(con, sql)]
        rep.tables[group] = rows
        xs = range(len(rows))
        w = 0.27
        for i, label in enumerate(("fleet", "routed", "engine")):
            ax.bar([x + (i - 1) * w for x in xs], [r[i + 2] or 0 for r in rows], w, label=label)
        ax.set_xticks(list(xs), [r[0][:14] for r in rows], rotation=60, ha="right", fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"Hit rate by {group}")
        ax.legend(fontsize=7)
    return _save(fig, out / "hit_rate_by_group.png")


MISS_KINDS = ("cold", "evicted", "elsewhere", "undelivered")


def _miss_attribution(con: duckdb.DuckDBPyConnection, out: Path, rep: Report) -> Path:
    span = _rows(con, "SELECT epoch(max(event_time)) - epoch(min(event_time)) FROM served")[0][0] or 0
    bucket = "1 minute" if span <= 6 * 3600 else "1 hour"
    sums = ", ".join(f"coalesce(sum(miss_{k}_tokens), 0)" for k in MISS_KINDS)
    rows = _rows(
        con,
        f"""SELECT time_bucket(INTERVAL '{bucket}', event_time) AS t, {sums} FROM served
            WHERE uncached_tokens IS NOT NULL GROUP BY t ORDER BY t""",
    )
    by_kind = _rows(
        con,
        """SELECT kind, coalesce(why, ''), sum(tokens) FROM (
               SELECT 'cold' AS kind, NULL AS why, miss_cold_tokens AS tokens FROM served
               UNION ALL SELECT 'evicted', miss_evicted_tier, miss_evicted_tokens FROM served
               UNION ALL SELECT 'elsewhere', miss_elsewhere_reason, miss_elsewhere_tokens FROM served
               UNION ALL SELECT 'undelivered', NULL, miss_undelivered_tokens FROM served)
           WHERE tokens > 0 GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2""",
    )
    rep.tables["miss kind"] = [(f"{k} ({w})" if w else str(k), int(n), None, None, None) for k, w, n in by_kind]
    fig, ax = plt.subplots(figsize=(9, 4))
    if rows:
        ts = [r[0] for r in rows]
        bottom = [0.0] * len(rows)
        width = (1 / 24 / 60 if bucket == "1 minute" else 1 / 24) * 0.8  # in days (matplotlib dates)
        for i, kind in enumerate(MISS_KINDS):
            vals = [float(r[i + 1]) for r in rows]
            ax.bar(ts, vals, width, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.legend()
        fig.autofmt_xdate()
    else:
        ax.text(0.5, 0.5, "no request carries a miss attribution", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("uncached prompt tokens")
    ax.set_title(f"Why prompt tokens were computed, per {bucket}")
    return _save(fig, out / "miss_attribution.png")


def _latency(con: duckdb.DuckDBPyConnection, out: Path, rep: Report) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, cols, title in (
        (axes[0], ("ttft_s",), "TTFT"),
        (axes[1], ("itl_mean_s", "itl_p99_s"), "ITL (per-request mean and p99)"),
    ):
        for col in cols:
            vals = [r[0] for r in _rows(con, f"SELECT {col} FROM served WHERE {col} > 0")]
            if not vals:
                continue
            vals.sort()
            p50, p99 = vals[len(vals) // 2], vals[min(len(vals) - 1, int(len(vals) * 0.99))]
            ax.hist(vals, bins=40, alpha=0.6, label=f"{col} p50={p50 * 1e3:.0f}ms p99={p99 * 1e3:.0f}ms")
        ax.set_xlabel("seconds")
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(fig, out / "latency.png")


def _pd_decisions(con: duckdb.DuckDBPyConnection, out: Path, rep: Report) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    queries = (
        ("coalesce(routing_decision, '(none)')", "decision"),
        ("coalesce(prefill_node, '-') || ' -> ' || coalesce(decode_node, '-')", "prefill -> decode"),
        ("coalesce(routing_reason_code, '(no code)')", "reason code"),
    )
    for ax, (expr, title) in zip(axes, queries, strict=True):
        rows = _rows(con, f"SELECT {expr} AS k, count(*) FROM served GROUP BY k ORDER BY 2 DESC, k LIMIT 15")
        if title == "reason code":
            rep.tables["reason code"] = [(str(r[0]), int(r[1]), None, None, None) for r in rows]
        ax.barh([str(r[0])[:30] for r in rows], [r[1] for r in rows])
        ax.invert_yaxis()
        ax.set_title(f"Requests by {title}")
        ax.tick_params(axis="y", labelsize=7)
    return _save(fig, out / "pd_decisions.png")


def _transfers(con: duckdb.DuckDBPyConnection, out: Path, rep: Report) -> Path:
    rows = _rows(con, "SELECT transfer_s, transfer_bytes FROM served WHERE transfer_s IS NOT NULL")
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


_RENDER: dict[str, Callable[[duckdb.DuckDBPyConnection, Path, Report], Path]] = {
    "hit_rate_over_time": _hit_rate_over_time,
    "hit_rate_by_group": _hit_rate_by_group,
    "miss_attribution": _miss_attribution,
    "latency": _latency,
    "pd_decisions": _pd_decisions,
    "transfers": _transfers,
}


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _summary(con: duckdb.DuckDBPyConnection, rep: Report) -> list[tuple[str, str]]:
    r = _rows(
        con,
        f"""SELECT count(*), count(DISTINCT session_id), min(event_time), max(event_time),
                  quantile_cont(ttft_s, 0.5), quantile_cont(ttft_s, 0.99), {_HIT}
           FROM served""",
    )[0]
    rep.hit_rates = (r[6], r[7], r[8])
    outcomes = dict(_rows(con, "SELECT coalesce(status, '(none)'), count(*) FROM requests GROUP BY 1"))
    never = _rows(
        con,
        f"""SELECT count(*), coalesce(sum(prompt_tokens), 0),
                  count(*) FILTER (WHERE status = 'rejected') FROM requests WHERE NOT ({REACHED_ENGINE})""",
    )[0]
    errors_table = _rows(con, "SELECT count(*), count(request_id) FROM errors")[0]
    others = {t: _rows(con, f"SELECT count(*) FROM {t}")[0][0] for t in ("tool_calls", "feedback")}

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    order = ["ok", "error", "cancelled", "rejected"]
    outcome_text = ", ".join(f"{k} {outcomes[k]}" for k in order + sorted(set(outcomes) - set(order)) if k in outcomes)
    return [
        ("requests (all rows)", str(rep.requests)),
        ("outcomes (requests.status)", outcome_text),
        ("reached an engine", str(r[0])),
        (
            "never reached an engine (not in hit rates or latencies)",
            f"{never[0]} ({never[2]} rejected), {never[1]} prompt tokens",
        ),
        ("sessions (reached an engine)", str(r[1])),
        ("from", str(r[2])),
        ("to", str(r[3])),
        ("TTFT p50 / p99", f"{ms(r[4])} / {ms(r[5])}"),
        ("hit rate fleet / routed / engine", f"{pct(r[6])} / {pct(r[7])} / {pct(r[8])}"),
        ("component error reports (errors table; not request outcomes)", f"{errors_table[0]}"),
        *((t, str(n)) for t, n in others.items()),
    ]


def _table_html(group: str, rows: list[GroupRow]) -> str:
    if group in ("reason code", "miss kind"):
        what = "requests" if group == "reason code" else "uncached tokens"
        head = f"<tr><th>{html.escape(group)}</th><th>{what}</th></tr>"
        body = "".join(f"<tr><td>{html.escape(k)}</td><td>{n}</td></tr>" for k, n, *_ in rows)
    else:
        head = f"<tr><th>{html.escape(group)}</th><th>requests</th><th>fleet</th><th>routed</th><th>engine</th></tr>"
        body = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{n}</td><td>{pct(f)}</td><td>{pct(ro)}</td><td>{pct(e)}</td></tr>"
            for k, n, f, ro, e in rows
        )
    return f"<h3>By {html.escape(group)}</h3><table class='t'>{head}{body}</table>"


def _exports_html(view: ExportView | None) -> str:
    if view is None:
        return ""
    if view.error:
        return f"<h2>exports</h2><p>Session store not readable: {html.escape(view.error)}</p>"
    head = (
        "<tr><th>export</th><th>format</th><th>parts</th><th>rows</th><th>latest run: rows</th>"
        "<th>examples per tenant</th><th>feedback coverage</th><th>filtered</th></tr>"
    )

    def kv(d: dict[str, int]) -> str:
        return html.escape(", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-")

    body = "".join(
        f"<tr><td>{html.escape(e.name)}</td><td>{html.escape(e.format)}</td><td>{e.parts}</td><td>{e.rows}</td>"
        f"<td>{e.last_run_rows}</td><td>{kv(e.per_tenant)}</td><td>{pct(e.feedback_coverage)}</td>"
        f"<td>{kv(e.filtered)}</td></tr>"
        for e in view.exports
    )
    consent = ", ".join(f"{c.tenant_id} ({'allowed' if c.allowed else 'denied'})" for c in view.consents)
    return (
        f"<h2>exports</h2><table class='t'>{head}{body}</table>"
        f"<p>Consent recorded: {html.escape(consent or 'none (no tenant is exported)')}.</p>"
    )


def render_report(
    lake: Path, out: Path, *, on_step: Callable[[str], None] | None = None, exports: ExportView | None = None
) -> Report:
    """Render ``out/index.html`` and its PNGs from ``lake``. ``on_step(name)`` after each section;
    ``exports``: the export view's table too."""
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out=out, index=out / "index.html")
    con = connect(lake)
    try:
        con.execute(f"CREATE TEMP VIEW served AS SELECT * FROM requests WHERE {REACHED_ENGINE}")
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
        rep.summary = _summary(con, rep)
        for name in SECTIONS:
            rep.images.append(_RENDER[name](con, out, rep))
            if on_step is not None:
                on_step(name)
    finally:
        con.close()
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rep.summary)
    tables = {
        "hit_rate_by_group": ("tenant", "session", "turn position"),
        "miss_attribution": ("miss kind",),
        "pd_decisions": ("reason code",),
    }
    parts = []
    for p in rep.images:
        parts.append(f"<h2>{html.escape(p.stem.replace('_', ' '))}</h2><img src='{p.name}' alt='{p.stem}'>")
        parts.extend(_table_html(g, rep.tables[g]) for g in tables.get(p.stem, ()))
    rep.index.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>Tandem lake report</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:left}"
        "table.t{border-collapse:collapse}table.t td,table.t th{border-bottom:1px solid #ddd}"
        "img{max-width:100%}</style></head><body><h1>Tandem lake report</h1>"
        f"<p>Lake: <code>{html.escape(str(lake))}</code>. Hit rates and latencies count only requests that "
        "reached an engine; requests refused before (rejected: 4xx, 429, 503) are counted apart.</p>"
        f"<table>{rows}</table>{''.join(parts)}{_exports_html(exports)}</body></html>\n"
    )
    return rep
