"""meshcoll-bench's output: nccl-tests-style tables, JSON lines and a busbw plot."""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

from meshcoll import __version__

from .cases import Series, format_size, transport_name


def header(series: Series, args: argparse.Namespace, pg, device_note: str = "") -> str:
    """``device_note``: what the NCCL backend adds (library version, array library)."""
    extra = f"  transport={transport_name(pg)}"
    if series.op == "all_reduce":
        extra += f"  algo={series.algo}"
    elif series.op in ("broadcast", "reduce"):
        extra += f"  root={args.root}"
    timing = (" (host clock around -n calls and a device synchronize)"
              if args.backend == "nccl" else "")
    return "\n".join([
        f"# meshcoll {__version__}  {series.op}  backend={args.backend}  ranks={pg.size}  "
        f"iters={args.iters} warmup={args.warmup_iters}{extra}{device_note}",
        f"# time: median of {args.repeats} repeat(s) of the slowest rank's mean per call{timing}",
        "#" + f"{'size':>11}{'count':>10}{'type':>9}{'redop':>7}{'time':>9}"
              f"{'algbw':>8}{'busbw':>8}{'#wrong':>8}",
        "#" + f"{'(B)':>11}{'(elems)':>10}{'':>9}{'':>7}{'(us)':>9}{'(GB/s)':>8}{'(GB/s)':>8}",
    ])


def format_row(r: dict) -> str:
    t = r["time"]
    ts = f"{t:9.2f}" if t < 1e5 else f"{t:9.0f}"
    wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
    return (f"{r['size']:12d}{r['count']:10d}{r['type']:>9}{r['redop']:>7}{ts}"
            f"{r['algbw']:8.2f}{r['busbw']:8.2f}{wrong:>8}")


def footer(records: Sequence[dict]) -> str:
    avg = sum(r["busbw"] for r in records) / len(records) if records else 0.0
    return f"# Avg bus bandwidth : {avg:.4g}"


def print_tables(series: Sequence[Series], records: Sequence[dict], args: argparse.Namespace,
                 pg, device_note: str = "", *, streamed: bool = False) -> None:
    """One table per series, each closed by its average busbw. ``streamed``: the only
    series' header and rows were already printed as they came; only the footer is left."""
    for i, s in enumerate(series):
        rows = [r for r in records if r["series"] == s.label]
        if not streamed:
            print(("\n" if i else "") + header(s, args, pg, device_note))
            for r in rows:
                print(format_row(r))
        print(footer(rows), flush=True)


def write_json(records: Sequence[dict], path: str) -> None:
    """One ``json.dumps`` record per line."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def plot_records(records: Sequence[dict], path: str, *, title: Optional[str] = None,
                 key: str = "series") -> None:
    """busbw against size, one line per distinct ``record[key]``; writes ``path``."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("meshcoll-bench: --plot needs matplotlib "
                         "(pip install 'meshcoll[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r[key] for r in records):
        pts = sorted((r["size"], r["busbw"]) for r in records if r[key] == name)
        ax.plot([s for s, _ in pts], [b for _, b in pts], marker="o", ms=3, label=name)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: format_size(int(v)) if v >= 1 else ""))
    bws = [r["busbw"] for r in records if r["busbw"] > 0]
    if bws and max(bws) > 100 * min(bws):
        ax.set_yscale("log")  # small sizes would sit flat on the axis otherwise
    ax.set_xlabel("size (bytes per rank)")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- entry point ---------------------------------------------------------------------
