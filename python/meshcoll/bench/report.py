"""meshcoll-bench's output: nccl-tests-style tables (out-of-place and in-place columns),
JSON lines, CSV and a busbw plot."""

from __future__ import annotations

import argparse
import csv
import json
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from meshcoll import __version__

from .cases import PLACEMENTS, Record, Series, format_size, transport_name

if TYPE_CHECKING:
    from meshcoll.process_group import ProcessGroup


def header(series: Series, args: argparse.Namespace, pg: ProcessGroup,
           device_note: str = "") -> str:
    """``device_note``: what the NCCL backend adds (library version, array library)."""
    extra = f"  transport={transport_name(pg)}"
    if series.algo is not None:
        extra += f"  algo={series.algo}"
    if series.op in ("broadcast", "reduce"):
        extra += f"  root={args.root}"
    timing = (" (host clock around -n calls and a device synchronize)"
              if args.backend == "nccl" else "")
    return "\n".join([
        f"# meshcoll {__version__}  {series.op}  backend={args.backend}  ranks={pg.size}  "
        f"iters={args.iters} warmup={args.warmup_iters}{extra}{device_note}",
        f"# time: median of {args.repeats} repeat(s) of the slowest rank's mean per call{timing}",
        f"#{'':37}{'out-of-place':^33}{'in-place':^33}".rstrip(),
        "#" + f"{'size':>11}{'count':>10}{'type':>9}{'redop':>7}" + _GROUP_HEAD * 2,
        ("#" + f"{'(B)':>11}{'(elems)':>10}{'':>9}{'':>7}" + _GROUP_UNITS * 2).rstrip(),
    ])


_GROUP_HEAD = f"{'time':>9}{'algbw':>8}{'busbw':>8}{'#wrong':>8}"
_GROUP_UNITS = f"{'(us)':>9}{'(GB/s)':>8}{'(GB/s)':>8}{'':>8}"
_NA_GROUP = f"{'N/A':>9}{'N/A':>8}{'N/A':>8}{'N/A':>8}"  # the op has no such form


def _group(r: Optional[Record]) -> str:
    if r is None:
        return _NA_GROUP
    t = r["time"]
    ts = f"{t:9.2f}" if t < 1e5 else f"{t:9.0f}"
    wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
    return f"{ts}{r['algbw']:8.2f}{r['busbw']:8.2f}{wrong:>8}"


def format_row(recs: Sequence[Record]) -> str:
    """One table row: the records of one series at one size, out of place and in place
    (``cases.PLACEMENTS``; a form the op lacks shows N/A)."""
    by = {r["in_place"]: r for r in recs}
    r = recs[0]
    return (f"{r['size']:12d}{r['count']:10d}{r['type']:>9}{r['redop']:>7}"
            f"{_group(by.get(False))}{_group(by.get(True))}")


def table_rows(records: Sequence[Record]) -> List[List[Record]]:
    """Records grouped into rows (one series and size each), in order."""
    rows: Dict[Tuple[str, int], List[Record]] = {}
    for r in records:
        rows.setdefault((r["series"], r["size"]), []).append(r)
    return list(rows.values())


def footer(records: Sequence[Record]) -> str:
    avg = sum(r["busbw"] for r in records) / len(records) if records else 0.0
    return f"# Avg bus bandwidth : {avg:.4g}"


def print_tables(series: Sequence[Series], records: Sequence[Record], args: argparse.Namespace,
                 pg: ProcessGroup, device_note: str = "", *, streamed: bool = False) -> None:
    """One table per series, each closed by its average busbw. ``streamed``: the only
    series' header and rows were already printed as they came; only the footer is left."""
    for i, s in enumerate(series):
        recs = [r for r in records if r["series"] == s.label]
        if not streamed:
            print(("\n" if i else "") + header(s, args, pg, device_note))
            for row in table_rows(recs):
                print(format_row(row))
        print(footer(recs), flush=True)
    for op in dict.fromkeys(s.op for s in series):
        lines = comparison(op, records, pg) if args.backend == "cpu" else []
        if lines:
            print("\n" + "\n".join(lines), flush=True)


def comparison(op: str, records: Sequence[Record], pg: ProcessGroup) -> List[str]:
    """``--algo`` with several algorithms of ``op``: one row per size, one column per
    algorithm, the time in us of its in-place form (the out-of-place one where the op has
    none); ``*`` marks the fastest, ``a`` what auto picks (CollectiveConfig.select, the
    selection table: Note [Selection table] in csrc/cpu/algo/select.cc)."""
    recs = [r for r in records if r["op"] == op and r["algo"] is not None]
    algos = list(dict.fromkeys(r["algo"] for r in recs))
    if len([a for a in algos if a != "auto"]) < 2:
        return []
    in_place = True in PLACEMENTS[op]
    times: Dict[int, Dict[str, float]] = {}
    for r in recs:
        if r["in_place"] == in_place:
            times.setdefault(r["size"], {})[r["algo"]] = r["time"]
    shm = transport_name(pg) == "shm"
    width = max(10, *(len(a) + 2 for a in algos))
    lines = [f"# {op}: time (us) per algorithm, {pg.size} ranks over {transport_name(pg)}; "
             "* fastest, a: what auto picks",
             "#" + f"{'size':>11}" + "".join(f"{a:>{width}}" for a in algos)]
    for size, row in times.items():
        name, arity = pg.config.select(op, size, pg.size, shm)
        auto = f"tree:{arity}" if name == "tree" and arity != "binomial" else name
        best = min((t, a) for a, t in row.items() if a != "auto")[1]
        cells = []
        for a in algos:
            if a not in row:
                cells.append(f"{'-':>{width}}")
                continue
            mark = ("*" if a == best else "") + ("a" if a == auto else "")
            cells.append(f"{row[a]:>{width - 2}.1f}{mark:<2}")
        lines.append(f"{size:12d}" + "".join(cells))
    return lines


def write_json(records: Sequence[Record], path: str) -> None:
    """One ``json.dumps`` record per line."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


CSV_FIELDS = ("op", "algo", "series", "in_place", "size", "count", "type", "redop", "root",
              "time", "algbw", "busbw", "wrong", "ranks", "backend", "transport", "iters",
              "warmup", "repeats", "library", "version", "times")


def write_csv(records: Sequence[Record], path: str) -> None:
    """The JSON records' fields, one row per record (``times``: the repeats' times in us,
    separated by spaces; None: an empty cell)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in records:
            w.writerow({**{k: r[k] for k in CSV_FIELDS if k != "times"},
                        "times": " ".join(f"{t:.3f}" for t in r["times"])})


def check_plot_dependencies() -> None:
    """--plot needs matplotlib: found before any rank starts, not after the benchmark ran."""
    try:
        import matplotlib  # noqa: F401  (imported, not looked up: a broken install fails here too)
    except ImportError as e:
        raise SystemExit(f"meshcoll-bench: --plot needs matplotlib, which does not import "
                         f"({e}): pip install \".[plot]\" in a clone of meshcoll; nothing "
                         "was run") from None


def plot_records(records: Sequence[Record], path: str, *, title: Optional[str] = None,
                 key: str = "series") -> None:
    """busbw against size, one line per distinct ``record[key]``; writes ``path``."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("meshcoll-bench: --plot needs matplotlib "
                         "(pip install \".[plot]\" in a clone of meshcoll)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    def name_of(r: Record) -> str:
        # An op measured both ways gets a line for each.
        both = len(PLACEMENTS.get(r.get("op", ""), ())) > 1
        return f"{r[key]} ({'in-place' if r['in_place'] else 'out-of-place'})" if both \
            else str(r[key])

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(map(name_of, records)):
        pts = sorted((r["size"], r["busbw"]) for r in records if name_of(r) == name)
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
