"""Tier 1: pipeline schedules and the simulator, pure logic, no processes.

Imports go straight to meshcoll.pipeline.schedule/simulate so that these run
even before the C++ extension is built.
"""

import pytest

from meshcoll.pipeline.schedule import (
    Action,
    DeadlockError,
    Kind,
    Schedule,
    ScheduleError,
    from_compute_orders,
    make_schedule,
)
from meshcoll.pipeline.simulate import simulate, validate

pytestmark = pytest.mark.timeout(60)

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


def _approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def _valid_configs():
    """Every (name, num_stages, m, v) the issue asks to pass, p in 1..8, m in 1..16."""
    for p in range(1, 9):
        for m in range(1, 17):
            for name in ("gpipe", "1f1b", "zero_bubble"):
                yield name, p, m, 1
            if m % p == 0:
                for v in (1, 2, 3, 4):
                    yield "interleaved_1f1b", p * v, m, v
            if m % max(1, m // p) == 0:
                for v in (2, 3, 4):
                    yield "interleaved_zero_bubble", p * v, m, v
            yield "zero_bubble_v", 2 * p, m, 2
            if m >= 2 * p:
                yield "dualpipe_v", 2 * p, m, 2


# ---------------------------------------------------------------- theory


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 13, 16])
def test_gpipe_1f1b_bubble_matches_theory(name, p, m):
    res = simulate(make_schedule(name, p, m), t_f=1.0, t_b=2.0)
    assert res.makespan == _approx((m + p - 1) * 3.0)
    assert res.bubble_fraction == tuple(_approx((p - 1) / (m + p - 1)) for _ in range(p))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("t_b", [1.0, 2.0])
def test_interleaved_bubble_matches_theory(p, v, groups, t_b):
    m = groups * p  # Megatron's rule: m % p == 0
    res = simulate(make_schedule("interleaved_1f1b", p * v, m, virtual_stages=v), t_f=1.0, t_b=t_b)
    for frac in res.bubble_fraction:
        assert frac == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_zero_bubble_with_free_w_is_1f1b(p, m):
    # B = I + W: with t_w = 0 an I costs a whole B and every F/I lands where 1F1B puts F/B.
    zb = simulate(make_schedule("zero_bubble", p, m), t_f=1.0, t_b=2.0, t_w=0.0)
    ref = simulate(make_schedule("1f1b", p, m), t_f=1.0, t_b=2.0)
    assert zb.makespan == ref.makespan
    assert zb.bubble_fraction == ref.bubble_fraction
    for zl, rl in zip(zb.timeline, ref.timeline):
        z = [(s, e, a.stage, a.microbatch) for s, e, a in zl if a.kind in (F, I)]
        r = [(s, e, a.stage, a.microbatch) for s, e, a in rl if a.kind in (F, B)]
        assert z == r


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("t", [(1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (1.0, 1.0, 0.25)])
def test_zero_bubble_beats_1f1b(p, m, t):
    t_f, t_b, t_w = t
    zb = simulate(make_schedule("zero_bubble", p, m), t_f, t_b, t_w)
    ref = simulate(make_schedule("1f1b", p, m), t_f, t_b, t_w)
    assert zb.busy == ref.busy  # same work, split differently
    assert all(z < r for z, r in zip(zb.bubble_fraction, ref.bubble_fraction))
    if m >= p:
        # ZB-H1's bubble (Qi et al.): (p-1)(T_F + T_B - T_W) with T_B = t_b - t_w, T_W = t_w.
        assert zb.makespan == _approx(m * (t_f + t_b) + (p - 1) * (t_f + t_b - 2 * t_w))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("m", [1, 3, 4, 9, 16])
def test_peak_activations(p, m):
    one = simulate(make_schedule("1f1b", p, m)).peak_activations
    assert one == tuple(min(p - r, m) for r in range(p))
    assert max(one) <= p
    assert simulate(make_schedule("gpipe", p, m)).peak_activations == (m,) * p
    # ZB-H1 defers rank r's Ws by r microbatches but keeps 1F1B's bound of p.
    assert simulate(make_schedule("zero_bubble", p, m), t_w=1.0).peak_activations == (min(p, m),) * p


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (3, 3), (4, 4)])
def test_interleaved_peak_is_megatron_warmup(p, v):
    m = 2 * p
    res = simulate(make_schedule("interleaved_1f1b", p * v, m, virtual_stages=v))
    assert res.peak_activations == tuple(min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p))


@pytest.mark.parametrize("p,v,m", [(p, v, m) for p in (1, 2, 3, 4, 5) for v in (2, 3, 4)
                                   for m in (1, 2, 3, 4, 6, 8, 12) if m % max(1, m // p) == 0])
def test_interleaved_zero_bubble_peak(p, v, m):
    per_round = m // max(1, m // p)
    res = simulate(make_schedule("interleaved_zero_bubble", p * v, m, virtual_stages=v), t_w=1.0)
    assert res.peak_activations == (min((v - 1) * per_round + p, v * m),) * p


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", range(1, 13))
def test_v_schedule_peaks(p, m):
    zbv = simulate(make_schedule("zero_bubble_v", 2 * p, m, virtual_stages=2), t_w=1.0)
    assert zbv.peak_activations == tuple(min(2 * p, m + 1 + r, 2 * m) for r in range(p))
    if m >= 2 * p:
        dpv = simulate(make_schedule("dualpipe_v", 2 * p, m, virtual_stages=2), t_w=1.0)
        assert dpv.peak_activations == (2 * p + 1,) * p


def test_v_schedules_reach_the_issue_bubble():
    # 4 ranks, 2 stages each, 8 microbatches, t_f = t_I = t_w: the three zero-bubble
    # schedules leave 3/51 idle, interleaved 1F1B (p-1)/(vm+p-1) = 3/19.
    kw = dict(t_f=1.0, t_b=2.0, t_w=1.0)
    for name in ("interleaved_zero_bubble", "zero_bubble_v", "dualpipe_v"):
        res = simulate(make_schedule(name, 8, 8, virtual_stages=2), **kw)
        assert res.makespan == _approx(51.0) and res.bubble == _approx(3 / 51), name
    assert simulate(make_schedule("interleaved_1f1b", 8, 8, virtual_stages=2), **kw).bubble == _approx(3 / 19)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_v_placement(p):
    s = make_schedule("zero_bubble_v", 2 * p, 2 * p, virtual_stages=2)
    for r in range(p):
        assert s.stages_of(r) == [r, 2 * p - 1 - r]
    assert s.stage_rank(p - 1) == s.stage_rank(p) == p - 1  # the turn of the V is local
    turn = {str(a) for a in s.actions(p - 1) if not a.kind.is_compute and a.stage in (p - 1, p)}
    assert not turn & ({f"{p - 1}sF{i}" for i in range(2 * p)} | {f"{p}rF{i}" for i in range(2 * p)})
    assert s.stage_rank(0) == s.stage_rank(2 * p - 1) == 0


def test_v_schedule_parameters():
    with pytest.raises(ScheduleError, match=r"zero_bubble_v runs exactly two stages per rank.*virtual_stages=3"):
        make_schedule("zero_bubble_v", 6, 4, virtual_stages=3)
    with pytest.raises(ScheduleError, match=r"dualpipe_v needs num_microbatches >= num_stages \(6\), got 5"):
        make_schedule("dualpipe_v", 6, 5, virtual_stages=2)
    with pytest.raises(ScheduleError, match=r"interleaved_zero_bubble needs virtual_stages >= 2.*zero_bubble"):
        make_schedule("interleaved_zero_bubble", 4, 4)
    with pytest.raises(ScheduleError, match=r"num_microbatches \(5\) must be a multiple of max\(1, 5 // 2\) = 2"):
        make_schedule("interleaved_zero_bubble", 4, 5, virtual_stages=2)


def test_v_wrong_rank_names_the_placement():
    s = make_schedule("zero_bubble_v", 4, 2, virtual_stages=2)
    s = _with(s, 0, list(s.actions(0)) + [Action(2, W, 0)])
    with pytest.raises(ScheduleError, match=r"rank 0: action 2W0 belongs to rank 1 \(stages go down ranks "
                                            r"0..1 and back up in a V: \[0, 1, 1, 0\]\)"):
        validate(s)


def test_comm_latency_adds_two_hops_per_boundary_to_gpipe():
    p, m, c = 4, 5, 0.25
    res = simulate(make_schedule("gpipe", p, m), t_f=1.0, t_b=2.0, t_comm=c)
    assert res.makespan == _approx((m + p - 1) * 3.0 + 2 * (p - 1) * c)


# ---------------------------------------------------------------- every schedule is sound


NAMES = ["gpipe", "1f1b", "zero_bubble", "interleaved_1f1b", "interleaved_zero_bubble",
         "zero_bubble_v", "dualpipe_v"]


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_passes_dependency_checks(name):
    count = 0
    for cfg in _valid_configs():
        if cfg[0] != name:
            continue
        _, stages, m, v = cfg
        sched = make_schedule(name, stages, m, virtual_stages=v)
        res = simulate(sched, t_f=1.0, t_b=2.0, t_w=0.5, t_comm=0.1)  # validates, then plays
        busy_per_rank = m * v * 3.0
        assert res.busy == tuple(_approx(busy_per_rank) for _ in range(sched.num_ranks))
        for r in range(sched.num_ranks):
            stages_here = {a.stage for a in sched.compute_actions(r)}
            assert stages_here == set(sched.stages_of(r))
        count += 1
    assert count > 0


# ---------------------------------------------------------------- parameters


def test_interleaved_needs_m_multiple_of_ranks():
    with pytest.raises(ScheduleError,
                       match=r"num_microbatches % num_ranks == 0.*num_microbatches=6, num_ranks=4"):
        make_schedule("interleaved_1f1b", 8, 6, virtual_stages=2)


def test_stages_must_split_over_virtual_stages():
    with pytest.raises(ScheduleError, match="multiple of virtual_stages"):
        make_schedule("interleaved_1f1b", 7, 8, virtual_stages=2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero_bubble"])
def test_single_chunk_schedules_reject_virtual_stages(name):
    with pytest.raises(ScheduleError, match="virtual_stages=2"):
        make_schedule(name, 4, 4, virtual_stages=2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_counts_must_be_positive_ints(bad):
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive int"):
        make_schedule("1f1b", 2, bad)


def test_unknown_name_lists_choices():
    with pytest.raises(ScheduleError, match=r"unknown schedule 'pipedream'.*'1f1b'"):
        make_schedule("pipedream", 2, 2)


def test_simulator_cost_arguments():
    s = make_schedule("zero_bubble", 2, 2)
    with pytest.raises(ValueError, match="t_w <= t_b"):
        simulate(s, t_b=1.0, t_w=2.0)
    with pytest.raises(ValueError, match="t_comm must be >= 0"):
        simulate(s, t_comm=-1.0)


# ---------------------------------------------------------------- exact layouts


def test_action_names():
    assert str(Action(1, F, 0)) == "1F0"
    assert str(Action(12, W, 3)) == "12W3"
    assert str(Action(2, Kind.SEND_B, 5)) == "2sB5"


def _recv_lookahead(s: Schedule, lookahead: int) -> Schedule:
    """The same compute orders with the RECVs placed `lookahead` computes ahead."""
    orders = [s.compute_actions(r) for r in range(s.num_ranks)]
    return from_compute_orders(s.name, orders, s.num_microbatches, s.virtual_stages, s.placement,
                               recv_lookahead=lookahead)


def test_1f1b_lists_with_comms():
    # Note [Receive lookahead]: each receive is posted one compute before its consumer.
    s = make_schedule("1f1b", 2, 2)
    assert [str(a) for a in s.actions(0)] == ["0F0", "0sF0", "0rB0", "0F1", "0sF1", "0rB1", "0B0", "0B1"]
    assert [str(a) for a in s.actions(1)] == ["1rF0", "1F0", "1rF1", "1B0", "1sB0", "1F1", "1B1", "1sB1"]
    late = _recv_lookahead(s, 0)
    assert [str(a) for a in late.actions(0)] == ["0F0", "0sF0", "0F1", "0sF1", "0rB0", "0B0", "0rB1", "0B1"]
    assert [str(a) for a in late.actions(1)] == ["1rF0", "1F0", "1B0", "1sB0", "1rF1", "1F1", "1B1", "1sB1"]


def test_early_receive_deadlocks_serial_p2p():
    # The builders post receives one compute ahead (to overlap them with that
    # compute): sound when transfers progress in flight, as on both backends, a
    # deadlock when each rank's p2p ops run in issue order (Note [Serial p2p]):
    # 0sF1 queues behind 0rB0, whose gradient 1sB0 queues behind 1rF1, which
    # needs 0sF1. Posted right before their consumers they are sound either way.
    early = make_schedule("1f1b", 2, 2)
    late = _recv_lookahead(early, 0)
    assert simulate(early).makespan == simulate(late, serial_p2p=True).makespan
    with pytest.raises(DeadlockError, match=r"rank 0 at 0sF1 waits for the receive 0rB0 to complete.*"
                                            r"rank 1 at 1sB0 waits for the receive 1rF1 to complete"):
        simulate(early, serial_p2p=True)


@pytest.mark.parametrize("name,stages,m,v", [("1f1b", 4, 8, 1), ("zero_bubble", 5, 3, 1),
                                             ("interleaved_1f1b", 6, 6, 2), ("gpipe", 3, 4, 1),
                                             ("interleaved_zero_bubble", 6, 6, 2),
                                             ("zero_bubble_v", 6, 5, 2), ("dualpipe_v", 6, 7, 2)])
def test_late_receives_lose_nothing_to_serial_p2p(name, stages, m, v):
    s = _recv_lookahead(make_schedule(name, stages, m, virtual_stages=v), 0)
    kw = dict(t_f=1.0, t_b=2.0, t_w=0.5, t_comm=0.3)
    assert simulate(s, serial_p2p=True, **kw).timeline == simulate(s, **kw).timeline


def test_zero_bubble_defers_w_by_rank():
    s = make_schedule("zero_bubble", 3, 4)
    assert [str(a) for a in s.compute_actions(2)] == [
        "2F0", "2I0", "2F1", "2I1", "2F2", "2I2", "2W0", "2F3", "2I3", "2W1", "2W2", "2W3"]
    assert [str(a) for a in s.compute_actions(0)] == [
        "0F0", "0F1", "0F2", "0I0", "0W0", "0F3", "0I1", "0W1", "0I2", "0W2", "0I3", "0W3"]


def test_interleaved_depth_first_order():
    # p=2, v=2, m=2: chunk 0 for mbs 0,1, then chunk 1 (stages 2,3), backwards reversed.
    s = make_schedule("interleaved_1f1b", 4, 2, virtual_stages=2)
    assert [str(a) for a in s.compute_actions(0)] == ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"]
    assert [str(a) for a in s.compute_actions(1)] == ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1"]
    assert s.stages_of(1) == [1, 3] and s.stage_rank(3) == 1


def test_grid_is_time_aligned():
    expected = "\n".join([
        "# 1f1b  ranks=2  virtual_stages=1  microbatches=2  (unit-time steps)",
        "step rank0 rank1",
        "   0   0F0     .",
        "   1   0F1   1F0",
        "   2     .   1B0",
        "   3   0B0   1F1",
        "   4     .   1B1",
        "   5   0B1     .",
    ])
    assert str(make_schedule("1f1b", 2, 2)) == expected


def test_grid_list_order_and_fallback():
    s = make_schedule("gpipe", 2, 1)
    assert s.grid(timed=False).splitlines()[2:] == ["   0   0F0   1F0", "   1   0B0   1B0"]
    broken = from_compute_orders("broken", [[Action(0, F, 0)], [Action(1, F, 0), Action(1, B, 0)]], 1)
    assert "list order; does not simulate: missing action 0B0" in str(broken)


# ---------------------------------------------------------------- the checker names the problem


def _drop(s: Schedule, rank: int, name: str) -> Schedule:
    lists = [list(x) for x in s.per_rank]
    lists[rank] = [a for a in lists[rank] if str(a) != name]
    return Schedule(s.name, s.num_ranks, s.virtual_stages, s.num_microbatches, tuple(map(tuple, lists)))


def _with(s: Schedule, rank: int, acts) -> Schedule:
    lists = list(s.per_rank)
    lists[rank] = tuple(acts)
    return Schedule(s.name, s.num_ranks, s.virtual_stages, s.num_microbatches, tuple(lists), s.placement)


def test_missing_compute_action_is_named():
    s = _drop(make_schedule("1f1b", 4, 8), 1, "1B3")
    with pytest.raises(ScheduleError, match=r"missing action 1B3 on rank 1"):
        simulate(s)


def test_missing_w_is_named():
    s = _drop(make_schedule("zero_bubble", 3, 4), 2, "2W1")
    with pytest.raises(ScheduleError, match=r"missing action 2W1 on rank 2 \(2I1 is scheduled\)"):
        validate(s)


def test_missing_send_is_named():
    s = _drop(make_schedule("1f1b", 3, 3), 1, "1sF2")
    with pytest.raises(ScheduleError, match=r"missing action 1sF2 on rank 1 \(stage 2 on rank 2 needs it\)"):
        validate(s)


def test_duplicate_action_is_named():
    s = make_schedule("gpipe", 2, 2)
    s = _with(s, 0, list(s.actions(0)) + [Action(0, F, 1)])
    with pytest.raises(ScheduleError,
                       match=r"duplicate action 0F1: on rank 0 position \d+ and rank 0 position 8"):
        validate(s)


def test_action_on_wrong_rank_is_named():
    s = make_schedule("1f1b", 2, 1)
    s = _with(s, 0, list(s.actions(0)) + [Action(1, W, 0)])
    with pytest.raises(ScheduleError, match=r"rank 0: action 1W0 belongs to rank 1"):
        validate(s)


def test_consumer_before_its_receive_is_rejected():
    s = make_schedule("1f1b", 2, 1)
    acts = s.actions(1)
    acts.remove(Action(1, Kind.RECV_F, 0))
    acts.insert(acts.index(Action(1, F, 0)) + 1, Action(1, Kind.RECV_F, 0))
    with pytest.raises(ScheduleError,
                       match=r"rank 1: 1rF0 \(position 1\) must come before 1F0 \(position 0\)"):
        validate(_with(s, 1, acts))


def test_channel_order_is_checked():
    s = make_schedule("1f1b", 2, 2)
    acts = s.actions(1)
    acts.remove(Action(1, Kind.RECV_F, 1))
    acts.insert(0, Action(1, Kind.RECV_F, 1))  # posted before 1rF0, though sent after it
    with pytest.raises(ScheduleError,
                       match=r"channel rank 0 -> rank 1: message 0 is sent as the input of 1rF0"):
        validate(_with(s, 1, acts))


def test_receives_are_posted_in_channel_order_even_when_needed_out_of_order():
    # Rank 1 consumes microbatch 1 first; rank 0 sends 0 first, so rank 1 must
    # post 1rF0 before 1rF1 (Note [Channel order]).
    orders = [[Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)],
              [Action(1, F, 1), Action(1, B, 1), Action(1, F, 0), Action(1, B, 0)]]
    s = from_compute_orders("custom", orders, 2)
    assert [str(a) for a in s.actions(1)][:3] == ["1rF0", "1rF1", "1F1"]
    assert simulate(s).makespan == _approx(12.0)


def test_deadlock_is_reported_with_each_stuck_rank():
    orders = [[Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
              [Action(1, F, 1), Action(1, B, 1), Action(1, F, 0), Action(1, B, 0)]]
    with pytest.raises(DeadlockError) as info:
        simulate(from_compute_orders("crossed", orders, 2), serial_p2p=True)
    msg = str(info.value)
    assert "crossed deadlocks" in msg
    assert "rank 0 at 0sF0 waits for the receive 0rB0 to complete" in msg  # posted one compute early
    assert "rank 1 at 1F1 waits for the receive 1rF1 to complete" in msg
    with pytest.raises(DeadlockError) as info:
        simulate(from_compute_orders("crossed", orders, 2))
    msg = str(info.value)
    assert "rank 0 at 0B0 waits for the message for 0rB0 (gradient)" in msg
    assert "rank 1 at 1F1 waits for the message for 1rF1 (activation)" in msg


def test_same_rank_stage_order_deadlock():
    # One rank, two stages: stage 1's forward listed before stage 0's.
    orders = [[Action(1, F, 0), Action(0, F, 0), Action(1, B, 0), Action(0, B, 0)]]
    with pytest.raises(DeadlockError, match=r"rank 0 at 1F0 waits for 0F0"):
        simulate(from_compute_orders("backwards", orders, 1, virtual_stages=2))


def test_compute_orders_reject_comm_actions():
    with pytest.raises(ScheduleError, match="communication action"):
        from_compute_orders("x", [[Action(0, Kind.SEND_F, 0)]], 1)
