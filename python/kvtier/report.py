"""Presenting simulator results: the text summaries of ``kvtier sim run`` / ``sim sweep``, and
``kvtier report <dir>``, one self-contained HTML page of everything a simulator command wrote
into a directory.

The page holds, in this order: every reproduction table (``rows.json``, written by ``kvtier sim
reproduce`` into its ``--out-dir``), every sweep (``sweep.json`` of ``kvtier sim sweep``), every
single run (a JSON file from ``kvtier sim run --out``), and every plot (``*.png``, embedded as
``data:`` URIs). It references nothing outside itself, so it can be mailed or archived as is.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kvtier.errors import KvtierError, shown
from kvtier.results import field_of, nan_for_null, output_file, replacing

if TYPE_CHECKING:  # the simulator is loaded by the command that runs it, not by every CLI start
    from kvtier.sim.reproduce import RowJson
    from kvtier.sim.run import SimResult, SweepResult


def sim_summary(r: SimResult) -> str:
    t, p, h = r["ttft_s"], r["tpot_s"], r["hit_rate_tokens"]
    lines = [
        f"sim {r['config']}: {r['requests']} requests, {r['model']} on {r['hardware']}, policy {r['policy']['name']}",
        f"  TTFT s   mean {t['mean']:.3f}  p50 {t['p50']:.3f}  p99 {t['p99']:.3f}",
        f"  TPOT ms  mean {p['mean'] * 1e3:.2f}  p50 {p['p50'] * 1e3:.2f}  p99 {p['p99'] * 1e3:.2f}",
        f"  throughput {r['throughput_requests_per_s']:.2f} req/s, {r['throughput_total_tokens_per_s']:.0f} tokens/s",
        f"  hit rate (tokens) device {h['device']:.1%} host {h['host']:.1%} ssd {h['ssd']:.1%} "
        f"total {h['total']:.1%}; blocks {r['hit_rate_blocks']:.1%}",
        f"  blocked I/O {r['blocked_io_s']:.2f} s ({r['blocked_io_fraction_of_busy']:.1%} of busy time), "
        f"{r['preemptions']} preemptions, SLO attainment {r['slo']['attainment']:.1%}",
        f"  {r['events']} events in {r['wall_s']:.1f} s wall for {r['sim_time_s']:.0f} s simulated",
    ]
    built = r.get("policy_params") or {}  # absent from results written before it was reported
    filled = [
        f"{k} {v}" for k, v in built.items() if k not in r["policy"] and isinstance(v, int | float | str)
    ]
    if filled:  # what the policy ran with that the config left out (defaults, the node's B_xfer)
        lines.insert(1, f"  policy defaults: {', '.join(filled)}")
    unfinished = r.get("unfinished_requests", 0)  # absent from results written before it was reported
    if unfinished:  # a max_sim_s cut: a replay that stalls raises instead (kvtier.sim.stall)
        lines.insert(
            1,
            f"  {unfinished} requests unfinished at the max_sim_s cut ({r['sim_time_s']:.0f} s): "
            "the metrics are the finished requests'",
        )
    c = r.get("cluster")  # absent from results written before it was reported
    if c is not None:
        shape = (
            f"{c['engines']} engines" if c["engines"] else f"{c['prefill_engines']}P + {c['decode_engines']}D"
        )
        placed = c["requests_per_engine"]
        spread = f", requests per engine {min(placed)}-{max(placed)}" if placed else ""
        lines.append(
            f"  cluster {shape} behind {c['router']}{spread}; peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
        )
    return "\n".join(lines)


def sweep_summary(r: SweepResult) -> str:
    lines = [f"sweep {r['config']} over rates {r['rates_per_s']}"]
    for name, results in r["series"].items():
        for res in results:
            lines.append(
                f"  {name:10s} rate {res['rate_per_s']:7.3f}  TTFT p50 {res['ttft_s']['p50']:8.3f} s  "
                f"p99 {res['ttft_s']['p99']:8.3f} s  TPOT p50 {res['tpot_s']['p50'] * 1e3:7.2f} ms  "
                f"{res['throughput_total_tokens_per_s']:9.0f} tok/s"
            )
    lines.append(f"  plots: {', '.join(r['plots'])}")
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return html.escape("" if v is None else str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def reproduction_rows(data: Mapping[str, object], where: str) -> list[RowJson]:
    """The rows of a ``rows.json`` (untrusted JSON: a :class:`KvtierError` names the row and the
    missing or ill-typed field). A row written before ``note``, ``paper_range`` or
    ``within_30_percent`` existed has them empty."""
    rows: list[RowJson] = []
    for i, r in enumerate(field_of(data, "rows", list, where)):
        at = f"{where}: rows[{i}]"
        if not isinstance(r, dict):
            raise KvtierError(f"{at} is {shown(r)}; expected an object")
        lo_hi = r.get("paper_range")
        paper_range = None
        if lo_hi is not None:
            lo, hi = lo_hi if isinstance(lo_hi, list) and len(lo_hi) == 2 else (None, None)
            if not (isinstance(lo, int | float) and isinstance(hi, int | float)):
                raise KvtierError(f"{at}: `paper_range` is {shown(lo_hi)}; expected [low, high]")
            paper_range = (lo, hi)
        row: RowJson = {
            "paper": field_of(r, "paper", str, at),
            "metric": field_of(r, "metric", str, at),
            "paper_ratio": None if r.get("paper_ratio") is None else field_of(r, "paper_ratio", float, at),
            "kvtier_ratio": field_of(r, "kvtier_ratio", float, at, null_is_nan=True),
            "paper_range": paper_range,
            "note": field_of(r, "note", str, at) if "note" in r else "",
            "within_30_percent": (
                None if r.get("within_30_percent") is None else field_of(r, "within_30_percent", bool, at)
            ),
        }
        rows.append(row)
    return rows


def _reproduction(path: Path, data: Mapping[str, object]) -> str:
    header = ["paper", "metric", "paper value", "kvtier", "within 30%", "note"]
    rows = []
    for r in reproduction_rows(data, str(path)):
        lo_hi = r["paper_range"]
        paper = (
            r["paper_ratio"] if r["paper_ratio"] is not None else (f"{lo_hi[0]}-{lo_hi[1]}" if lo_hi else "-")
        )
        rows.append([r["paper"], r["metric"], paper, r["kvtier_ratio"], r["within_30_percent"], r["note"]])
    return f"<h2>Reproduction: {html.escape(str(path.parent))}</h2>" + _table(header, rows)


def _sweep(path: Path, data: SweepResult) -> str:
    header = ["policy", "rate /s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "tokens/s"]
    rows = [
        [name, res["rate_per_s"], res["ttft_s"]["p50"], res["ttft_s"]["p99"], res["tpot_s"]["p50"] * 1e3,
         res["throughput_total_tokens_per_s"]]
        for name, results in data["series"].items()
        for res in results
    ]  # fmt: skip
    return f"<h2>Sweep {html.escape(str(data['config']))} ({html.escape(path.name)})</h2>" + _table(
        header, rows
    )


def _run(path: Path, data: SimResult) -> str:
    summary = sim_summary(data)  # a `kvtier sim run --out` file (older: no `cluster`)
    return f"<h2>Run {html.escape(str(data['config']))} ({html.escape(path.name)})</h2><pre>{html.escape(summary)}</pre>"


def _section(path: Path, data: object) -> str | None:
    """The section of one JSON file, or None for a file that is no kvtier result. A file that looks
    like one (its key) but lacks or mistypes what the section reads is a KvtierError naming it."""
    if not isinstance(data, dict):
        return None
    if "rows" in data:
        return _reproduction(path, data)  # checks every row itself
    kind = "sweep" if "series" in data else "run" if "ttft_s" in data and "config" in data else None
    if kind is None:
        return None
    from kvtier.sim import run  # the types' runtime form: their fields say which nulls are floats

    # A figure that was NaN (no request to average) was written as null: NaN again, as the run printed it.
    data = nan_for_null(data, run.SweepResult if kind == "sweep" else run.SimResult)
    try:
        if kind == "sweep":  # the keys read are SweepResult's
            return _sweep(path, cast("SweepResult", data))
        return _run(path, cast("SimResult", data))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        problem = f"no {e}" if isinstance(e, KeyError) else shown(str(e), 120)
        raise KvtierError(
            f"{path}: looks like a kvtier sim {kind} result but is not one ({problem}); expected what "
            f"`kvtier sim {'sweep' if kind == 'sweep' else 'run --out'}` writes"
        ) from None


def write_html(directory: str | Path, out: str | Path | None = None) -> Path:
    """Writes the report of `directory` (see the module docs) to `out` (default
    ``directory/report.html``) and returns its path; a directory with nothing to report is an error."""
    root = Path(directory)
    if not root.is_dir():
        raise KvtierError(f"{str(root)!r} is not a directory; expected a simulator output directory")
    sections: list[str] = []
    for path in sorted(root.rglob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # not UTF-8 too
            raise KvtierError(f"{path}: not a readable JSON file ({e})") from e
        if (section := _section(path, data)) is not None:
            sections.append(section)
    for path in sorted(root.rglob("*.png")):
        data64 = base64.b64encode(path.read_bytes()).decode()
        name = html.escape(str(path.relative_to(root)))
        sections.append(
            f'<figure><img alt="{name}" src="data:image/png;base64,{data64}"><figcaption>{name}</figcaption></figure>'
        )
    if not sections:
        raise KvtierError(f"nothing to report in {str(root)!r}: no rows.json, sweep.json, run JSON or plot")
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:nth-child(-n+2){text-align:left}"
        "img{max-width:100%}figure{margin:1em 0}"
    )
    page = (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvtier report: {html.escape(str(root))}</title>"
        f"<style>{style}</style></head><body><h1>kvtier report: {html.escape(str(root))}</h1>"
        + "".join(sections)
        + "</body></html>\n"
    )
    target = Path(out) if out is not None else root / "report.html"
    with replacing(target) as file:  # whole or not at all
        file.write(page)
    return target


def add_command(sub: Any) -> None:
    """`kvtier report` (called where the CLI registers its subcommands)."""
    cmd = sub.add_parser("report", help="one self-contained HTML page of a simulator output directory")
    cmd.add_argument(
        "directory", help="an --out-dir of kvtier sim reproduce / sweep, or where sim run --out wrote"
    )
    cmd.add_argument("--out", default=None, help="the HTML file (default DIRECTORY/report.html)")

    def main(args: argparse.Namespace) -> None:
        print(write_html(args.directory, output_file(args.out, "--out")))

    cmd.set_defaults(func=main)
