"""Tier 1: the schedule planner (meshcoll.pipeline.plan) and its command line (meshcoll-plan,
meshcoll.pipeline.planner_cli), no processes.

The planner plays each schedule through `timeline` with per-action costs; the
references here are `simulate` (uniform costs, its own code path) and closed forms."""

import importlib
import os
import pkgutil

import pytest

import meshcoll
import meshcoll.pipeline
from meshcoll.pipeline import make_schedule, plan, simulate
from meshcoll.pipeline.planner import ascii_timeline
from meshcoll.pipeline.planner_cli import main

pytestmark = pytest.mark.timeout(60)


def _costs(f=1.0, bi=1.0, bw=1.0, send=0.0):
    return {"forward": f, "backward_input": bi, "backward_weight": bw, "send": send}


@pytest.mark.parametrize("p,m", [(1, 4), (2, 4), (3, 6), (4, 8), (4, 5)])
@pytest.mark.parametrize("c", [(1.0, 1.0, 1.0, 0.0), (1.0, 1.5, 0.5, 0.1), (2.0, 1.0, 3.0, 0.25)])
def test_every_entry_matches_simulate(p, m, c):
    f, bi, bw, send = c
    entries = plan(p, m, _costs(f, bi, bw, send))
    assert all(a.makespan <= b.makespan + 1e-9 for a, b in zip(entries, entries[1:]))
    assert {(e.name, e.virtual_stages) for e in entries} >= {("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1),
                                                             ("zero_bubble_v", 2)}
    for e in entries:
        v = e.virtual_stages
        ref = simulate(make_schedule(e.name, p * v, m, virtual_stages=v),
                       t_f=f / v, t_b=(bi + bw) / v, t_w=bw / v, t_comm=send)
        assert e.makespan == pytest.approx(ref.makespan, rel=1e-12)
        assert e.bubble == pytest.approx(ref.bubble, rel=1e-12, abs=1e-12)
        assert e.peak_memory == max(ref.peak_activations) / v


def test_closed_forms_and_memory_marks():
    p, m = 4, 8
    entries = {(e.name, e.virtual_stages): e for e in plan(p, m, _costs(1.0, 1.0, 1.0), memory_limit=4)}
    assert entries[("gpipe", 1)].makespan == (m + p - 1) * 3.0
    assert entries[("1f1b", 1)].makespan == (m + p - 1) * 3.0
    # ZB-V's 2p chunk stashes are p rank shares, 1F1B's bound; GPipe holds all m.
    assert entries[("zero_bubble_v", 2)].peak_memory == p == entries[("1f1b", 1)].peak_memory
    assert entries[("gpipe", 1)].peak_memory == m
    assert entries[("dualpipe_v", 2)].peak_memory == (2 * p + 1) / 2
    for e in entries.values():
        assert e.over_limit == (e.peak_memory > 4)
    assert entries[("gpipe", 1)].over_limit and not entries[("zero_bubble_v", 2)].over_limit


def test_free_weight_gradients_make_zero_bubble_1f1b():
    e = {(x.name, x.virtual_stages): x for x in plan(3, 6, _costs(1.0, 2.0, 0.0))}
    assert e[("zero_bubble", 1)].makespan == e[("1f1b", 1)].makespan


def test_per_rank_costs():
    p, m = 3, 4
    same = plan(p, m, _costs(1.0, 1.0, 1.0, 0.1))
    listed = plan(p, m, {"forward": [1.0] * p, "backward_input": [1.0] * p,
                         "backward_weight": [1, 1, 1], "send": [0.1] * p})
    assert [(e.name, e.makespan) for e in same] == [(e.name, e.makespan) for e in listed]
    # GPipe with one slow rank: its forwards and backwards set the pace (m of each) and the
    # others add one pass each on the way: (m + p - 1) passes of the slow stage if it is last.
    slow = {(e.name, e.virtual_stages): e for e in plan(p, m, {
        "forward": [1, 1, 2], "backward_input": [1, 1, 2], "backward_weight": [0, 0, 0], "send": 0})}
    assert slow[("gpipe", 1)].makespan == 1 + 1 + m * 2 + m * 2 + 1 + 1


def test_cost_errors_name_the_key():
    with pytest.raises(ValueError, match=r"missing \['send'\], unknown \['sned'\]"):
        plan(2, 4, {"forward": 1, "backward_input": 1, "backward_weight": 1, "sned": 0})
    with pytest.raises(ValueError, match=r"costs\['forward'\] has 3 values for 2 pipeline ranks"):
        plan(2, 4, dict(_costs(), forward=[1, 1, 1]))
    with pytest.raises(ValueError, match=r"costs\['send'\] must be finite numbers >= 0"):
        plan(2, 4, dict(_costs(), send=-1))
    with pytest.raises(ValueError, match=r"memory_limit .* must be > 0"):
        plan(2, 4, _costs(), memory_limit=0)


def test_ascii_timeline_is_exact():
    (e,) = [x for x in plan(2, 2, _costs(1.0, 1.0, 1.0)) if x.name == "1f1b"]
    assert e.makespan == 9.0
    assert ascii_timeline(e, width=9).splitlines()[1:] == [
        "# F forward, B backward, . idle", "rank0   FF..BB.BB", "rank1   .FBBFBB.."]
    (zbv,) = [x for x in plan(2, 4, _costs()) if x.name == "zero_bubble_v"]
    assert ascii_timeline(zbv).splitlines()[1] == (
        "# F forward, I backward (input gradient), W backward (weight gradient), . idle, "
        "lower case: the rank's later chunks")


def test_results_print_short():
    # print(simulate(s)) once dumped every event (kilobytes); a result prints a summary.
    s = make_schedule("zero_bubble_v", 8, 16, virtual_stages=2)
    r = simulate(s, t_w=1.0)
    assert repr(r) == str(r) == (
        f"SimResult(makespan={r.makespan:g}, bubble={r.bubble:.4f}, ranks=4, "
        f"max(peak_activations)={max(r.peak_activations)}, "
        f"<{sum(map(len, r.timeline))} events in timeline>)")
    assert repr(s).startswith("Schedule('zero_bubble_v', num_ranks=4, virtual_stages=2, ")
    (e,) = [x for x in plan(4, 16, _costs()) if x.name == "zero_bubble_v"]
    assert repr(e) == (f"PlanEntry('zero_bubble_v', virtual_stages=2, makespan={e.makespan:g}, "
                       f"bubble={e.bubble:.4f}, peak_memory={e.peak_memory:g}, over_limit=False)")
    assert max(len(repr(x)) for x in (r, s, e)) < 200


def test_plan_stays_the_function_when_the_command_line_is_imported():
    # Importing a submodule for the first time binds its name on the package: a lazily
    # imported submodule named like one of the package's functions (the command line was
    # `plan`) replaced the function, and `plan(...)` raised "'module' object is not callable".
    pkg = meshcoll.pipeline
    names = {n: v for n, v in vars(pkg).items() if n in pkg.__all__}
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{m.name}")
    assert {n: getattr(pkg, n) for n in names} == names
    from meshcoll.pipeline import plan as fn
    assert fn is plan and fn(2, 2, _costs())[0].makespan > 0


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"meshcoll-plan {meshcoll.__version__}"


def test_cli_table(capsys):
    assert main(["--stages", "2", "--microbatches", "4", "--forward", "1", "--backward-input", "1",
                 "--backward-weight", "1", "--send", "0,0", "--memory-limit", "2", "--ascii"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# meshcoll pipeline plan  ranks=2  microbatches=4  forward=1  "
                          "backward_input=1  backward_weight=1  send=0  memory_limit=2")
    ranked = [line.split()[1] for line in out.splitlines() if line[:7].strip().isdigit()]
    assert ranked[0] in ("interleaved_zero_bubble", "zero_bubble_v", "dualpipe_v")
    assert "# not applicable: dualpipe_v" not in out  # m = 2p: it applies
    assert "rank1   " in out and " OVER" in out


def test_cli_rejects_bad_counts(capsys):
    assert main(["--stages", "0", "--microbatches", "4", "--forward", "1", "--backward-input", "1",
                 "--backward-weight", "1", "--send", "0"]) == 2
    assert "plan: num_stages must be a positive int, got 0" in capsys.readouterr().err


def test_cli_draws_or_says_matplotlib_is_missing(tmp_path, capsys):
    argv = ["--stages", "2", "--microbatches", "4", "--forward", "1", "--backward-input", "1",
            "--backward-weight", "1", "--send", "0.1", "--draw", str(tmp_path / "pics")]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(argv) == 2
        assert "--draw needs matplotlib, which is not installed" in capsys.readouterr().err
        assert not (tmp_path / "pics").exists()  # checked before any work
        return
    assert main(argv) == 0
    pics = sorted(os.listdir(tmp_path / "pics"))
    assert "zero_bubble_v_v2.png" in pics and "1f1b_v1.png" in pics
    for name in pics:
        with open(tmp_path / "pics" / name, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
