"""The fault-injection soak (bench/python/fault_soak.py) stays alive: its judge flags every
wrong outcome it exists to catch, and a few fixed-seed episodes of the faults that end right
today (kill -9, disagreements, bad arguments; shm and TCP; 2-3 ranks) run clean end to end,
as does one episode of each other kind (hierarchy, coalesced block, DataParallel, overlapping
buffers, unmapped memory; threads once async calls from two threads are caught).
The long run is ``python bench/python/fault_soak.py --minutes 10``."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python"))
import fault_soak  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 2.5


def _report(rank, cls=None, msg="", step=1, elapsed=0.1, **extra):
    """A rank's report; an error at ``step`` 0 was raised before the fault (at time 0)."""
    rep = {"rank": rank, "steps_done": 3, "wrong": [], "arg_error": None, "completed": cls is None,
           "late_writes": [], "destroy_error": None, "applied": None,
           "error": None if cls is None else {"cls": cls, "msg": msg, "step": step,
                                              "elapsed": elapsed, "t": 1.0 if step else -1.0}}
    rep.update(extra)
    return rep


def _judge(fault, reports, world=3):
    """judge()'s problems for one episode; ``reports[r]`` None: rank r died."""
    plan = {"world": world, "timeout": TIMEOUT, "fault": dict(fault, step=1, victim=1)}
    rec = {"plan": plan, "reports": {r: rep for r, rep in enumerate(reports) if rep},
           "fault_at": 0.0, "hang": False, "stuck": {},
           "leftovers": [], "strays": [], "exit_codes": [0] * world}
    return [text for _, text in fault_soak.judge(rec)["problems"]]


KILL = {"kind": "kill", "when": "during"}
DIED = "rank 1 closed its connection"


def test_judge_accepts_the_right_errors():
    # The victim of a kill leaves no report; the others name it.
    timeout = _report(2, "TimeoutError", "rank(s) 1 never reached this operation")
    assert _judge(KILL, [_report(0, "PeerError", DIED), None, timeout]) == []
    mismatch = {"kind": "mismatch", "what": "op", "op": "max"}
    assert _judge(mismatch, [_report(r, "MismatchError", "collective mismatch")
                             for r in range(3)]) == []
    retry = {"kind": "badarg", "what": "timeout", "then": "retry"}
    bad = _report(1, arg_error={"cls": "ValueError", "msg": "timeout", "step": 1, "elapsed": 0})
    assert _judge(retry, [_report(0), bad, _report(2)]) == []
    # A rank that learns of a disagreement at its next call raises there.
    later = _report(2, "AbortedError", "the group failed: collective mismatch", step=2)
    assert _judge(mismatch, [_report(0, "MismatchError", "collective mismatch"),
                             _report(1, "MismatchError", "collective mismatch"), later]) == []
    # Threads: the rank that saw two threads' calls raises ConcurrentCallError, its peers
    # PeerError with the same message.
    seen = "another thread (id 7) issued all_reduce on this group at the same time"
    assert _judge({"kind": "threads"}, [_report(0, "PeerError", seen),
                                        _report(1, "ConcurrentCallError", seen),
                                        _report(2, "PeerError", seen)]) == []


@pytest.mark.parametrize("case, says", [
    ("another class", "expected PeerError or TimeoutError"),
    ("victim not named", "does not name rank 1"),
    ("healthy rank blamed", "rank(s) [0] never reached a call they had finished"),
    ("too slow", "> timeout + 2 s"),
    ("no error", "rank 2: no error"),
    ("error before the fault", "before the fault"),
    ("wrong result", "1 of 4 elements differ"),
    ("late write", "changed after the call raised"),
    ("mismatch as a timeout", "expected MismatchError"),
    ("bad argument accepted", "expected ValueError or TypeError, got no error"),
    ("destroy raised", "destroy() raised"),
    ("survivor died", "rank 2: died without a report"),
    ("returned from a disagreement", "rank 2: returned normally from step 1"),
    ("overlap refused as a TypeError", "expected ValueError, got TypeError"),
    ("threads: another error", "expected ConcurrentCallError"),
])
def test_judge_flags_every_wrong_outcome(case, says):
    fault = KILL
    reports = [_report(0, "PeerError", DIED), None, _report(2, "PeerError", DIED)]
    if case == "another class":
        reports[2] = _report(2, "AbortedError", "the group was aborted after rank 1 died")
    elif case == "victim not named":
        reports[2] = _report(2, "PeerError", "rank 0 closed its connection")
    elif case == "healthy rank blamed":  # rank 0 had finished seq 5: it raised in seq 6
        reports[0] = _report(0, "PeerError", f"barrier [seq 6] on rank 0 of 3: {DIED}")
        reports[2] = _report(2, "TimeoutError", "all_gather(count=8, int64) [seq 5] on rank 2 "
                                                "of 3: rank(s) 0, 1 never reached this operation")
    elif case == "too slow":
        reports[2] = _report(2, "PeerError", DIED, elapsed=TIMEOUT + fault_soak.SLACK + 0.1)
    elif case == "no error":
        reports[2] = _report(2)
    elif case == "error before the fault":
        reports[2] = _report(2, "PeerError", DIED, step=0)
    elif case == "wrong result":
        reports[2]["wrong"] = ["step 0 all_reduce sum: 1 of 4 elements differ"]
    elif case == "late write":
        reports[2]["late_writes"] = ["8 of 64 bytes changed after the call raised"]
    elif case == "mismatch as a timeout":
        fault = {"kind": "mismatch", "what": "count"}
        reports = [_report(0, "MismatchError", "collective mismatch"),
                   _report(1, "MismatchError", "collective mismatch"),
                   _report(2, "TimeoutError", "rank 2 timed out; rank(s) 1 never reached")]
    elif case == "bad argument accepted":
        fault = {"kind": "badarg", "what": "out", "then": "retry"}
        reports = [_report(0), _report(1), _report(2)]
    elif case == "destroy raised":
        reports[2]["destroy_error"] = "PeerError: store closed"
    elif case == "survivor died":
        reports[2] = None
    elif case == "returned from a disagreement":  # and no call followed: it ended cleanly
        fault = {"kind": "mismatch", "what": "root"}
        reports = [_report(0, "MismatchError", "collective mismatch"),
                   _report(1, "MismatchError", "collective mismatch"), _report(2)]
    elif case == "overlap refused as a TypeError":
        fault = {"kind": "overlap", "what": "overlap", "then": "retry"}
        reports = [_report(0), _report(1, arg_error={"cls": "TypeError", "msg": "x", "step": 1,
                                                     "elapsed": 0}), _report(2)]
    elif case == "threads: another error":
        seen = "another thread (id 7) issued all_reduce on this group at the same time"
        reports = [_report(0, "PeerError", seen), _report(1, "ConcurrentCallError", seen),
                   _report(2, "TimeoutError", "rank(s) 1 never reached this operation")]
        fault = {"kind": "threads"}
    problems = _judge(fault, reports)
    assert len(problems) == 1 and says in problems[0], problems


def test_fixed_seed_episodes_end_in_the_right_errors(capsys):
    # Seed 9's ten episodes: kills during and before calls, disagreements in op, dtype,
    # count and collective, bad roots, dtypes, timeouts and read-only arrays, some retried,
    # some fatal; 2 and 3 ranks; shm and TCP; stores on the driver and on rank 0.
    rc = fault_soak.main(["--episodes", "10", "--seed", "9", "--max-ranks", "3",
                          "--faults", "kill,mismatch,badarg", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.splitlines()[-1].split()[:3] == ["total", "10", "10"], out  # all 10 right


@pytest.mark.parametrize("kind, only", [("hier", 4), ("coalesced", 8), ("ddp", 7),
                                        ("overlap", 5), ("unmapped", 3)])
def test_an_episode_of_each_other_kind_ends_right(kind, only, capsys):
    # Seed 9's episode ``only`` of ``kind``: hier, a disagreement on a hierarchical
    # broadcast's root (3 ranks on two hosts); coalesced, another op in one call of a block
    # that ends the job (no closing call); ddp, a parameter of another dtype at construction
    # over TCP; overlap, reduce_scatter's out= over x, then the retry; unmapped, all_reduce's
    # x half over unmapped memory, then the retry.
    rc = fault_soak.main(["--episodes", "12", "--only", str(only), "--seed", "9",
                          "--max-ranks", "3", "--faults", kind, "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.splitlines()[-1].split()[:3] == ["total", "1", "1"], out


def test_a_threads_episode_ends_in_concurrent_call_errors_or_right_results(capsys):
    rc = fault_soak.main(["--episodes", "12", "--only", "8", "--seed", "9", "--max-ranks", "3",
                          "--faults", "threads", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
