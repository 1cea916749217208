"""Fault-injection soak: many short jobs of random verified collectives, each with one injected
fault, checked for the right error on every rank and zero wrong results.

    python bench/python/fault_soak.py --minutes 10 --max-ranks 4
    python bench/python/fault_soak.py --minutes 2 --transport tcp --faults kill,stop --seed 7
    python bench/python/fault_soak.py --seed 7 --episodes 12 --only 11   # replay one episode
    python bench/python/fault_soak.py --minutes 2 --faults hier,coalesced,ddp --max-ranks 4

The driver runs one episode at a time. Episode i draws, from a generator seeded with
(seed, i): the world size (2 to ``--max-ranks``), the transport (MESHCOLL_TRANSPORT=shm or
tcp; on shm, cross-memory attach off in 3 of 10), who hosts the store (the driver, or rank
0 as under meshcoll-run), 3-8 steps of
soak.py's random collectives (every collective, op and dtype, the _v variants, send/recv in a
ring, barrier; soak.Step draws them and soak.member_input makes every member's input, so
every rank computes every result with numpy and checks it), and ONE fault at a random step
on a random rank (the victim):

    kill      SIGKILL, before the step's call or from a timer 0-10 ms into it
    stop      SIGSTOP 0-5 ms into the call (from a timer thread), held for the call's
              timeout + 1-1.5 s, then SIGCONT or SIGKILL (from a helper process)
    late      the victim sleeps for timeout + 1 s instead of calling, then calls
    mismatch  the victim calls with another count, dtype, op, root, tag, split or row width,
              or another collective
    badarg    the victim passes a bad argument (unsupported or big-endian dtype, non-contiguous
              or read-only array, out= of the wrong size, root or peer out of range, unknown
              op, counts that do not sum, negative tag or timeout), then either retries the
              call correctly ("retry": the job must go on as if nothing happened) or exits
              ("exit")
    overlap   as badarg, the bad argument an out= that overlaps x partly (all_gather,
              reduce_scatter, all_to_all, the root of scatter), never as the in-place form
    unmapped  as badarg, the bad argument an array over memory unmapped (munmap) under it,
              from its first byte or from a page boundary inside it

and episodes of other kinds (``--faults`` names them too):

    hier      ranks on two emulated hosts (MESHCOLL_HOST_ID per rank, at least 3 ranks, the
              transport left to meshcoll), so the world group is hierarchical; the fault
              (kill, stop, late, mismatch or badarg) hits a hierarchical call (all_reduce,
              broadcast, all_gather)
    coalesced the fault's step is a ``with group.coalesced():`` block of 2-6 small
              all_reduces; the fault is kill, stop, late or mismatch: the victim forms
              another block (one element moved from a call to the next, one more element,
              another dtype or op in one call, or its last call made after the block)
    threads   no fault: at one step two threads on every rank each make 50-200 async
              all_reduces on the world group, each waited on before the next
    ddp       meshcoll.DataParallel over numpy arrays (2-6 parameters, about three
              buckets) on a group with the call timeout: every step hands over each gradient
              and waits for the averages; the fault is kill, stop (in a step) or mismatch
              (the victim's DataParallel has a parameter of another shape, name or dtype)

A mismatch episode ends at the disagreeing call in half of the draws (no later step, no
closing call), as a job whose last call disagreed would.

After the steps every rank makes one closing all_reduce (unless the episode ends at a
disagreement). A rank stops at its first error,
keeps the arrays of the failed call, and reports (a JSON file per rank) every check, every
wrong result and its error (class, message, step, time in the call). Once every rank has
reported or died, the driver tells them to compare the kept arrays with their copies taken at
the error (a change is a write into this process's memory after its call returned: a wrong
result) and to destroy the group.

Expected outcome (a WRONG ERROR otherwise), with each error raised within the call's timeout
+ 2 s:
    kill, stop, late  every other rank: PeerError or TimeoutError naming the victim (global
                      rank); a resumed or late victim: any meshcoll error
    mismatch          every rank: MismatchError, or (a rank that learns of it at a later
                      call) AbortedError / PeerError that says "mismatch"; a rank that
                      returned normally from the disagreeing call and ended the episode with
                      no error is SILENT (Note [Late raise points] lists the other raise
                      points the README allows)
    badarg            the victim: ValueError or TypeError (overlap, unmapped: ValueError);
                      then, retry: no error anywhere and every result right; exit: every
                      other rank PeerError, TimeoutError or AbortedError naming the victim
    threads           every rank: ConcurrentCallError, or PeerError / AbortedError with its
                      message ("another thread"); or no error and every result right
and on every episode: no error raised before the fault (wall clock: the victim notes the time
it injects the fault; ranks drift apart by a call or two, so a peer may rightly fail in an
earlier step than the victim's), no wrong result, destroy() clean, no process alive after the
hard limit (a HANG: the driver dumps the stacks to rank<r>.err, kills all), nothing of the job
left in /dev/shm, no stray process. A timeout whose diagnosis says a healthy rank never
reached a call that the healthy rank had finished (it raised later, in a call with a higher
sequence number, or never) counts as a MISBLAME (issue 16 item 14).

The driver prints a table per (fault, transport; hier:kill is a kill in a hier episode):
episodes, episodes fully right, episodes with a wrong error, wrong results (late writes
included), episodes with a silent rank, with an error that does not name the victim
(misnamed) and with a misblame, hangs, leftovers, setup failures (init did not complete),
median and max time to the expected error; then the problems of every failing episode with
the exact messages (the first 12). The exit code is 1 if any episode failed.
``--json`` writes one record per episode. Failing episodes keep their directory (plan, reports,
each rank's stderr) under ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import soak  # noqa: E402  (the random steps and their numpy references)

# One rank of an episode (fault_soak_rank.py), started by run_episode.
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_soak_rank.py")

FAULTS = ("kill", "stop", "late", "mismatch", "badarg")
# Episode kinds beyond a plain episode with one of FAULTS (the docstring says what each does);
# hier, coalesced and ddp draw their fault from SUB_FAULTS.
EPISODES = ("hier", "coalesced", "threads", "ddp", "overlap", "unmapped")
KINDS = FAULTS + EPISODES
SUB_FAULTS = {"hier": ("kill", "stop", "late", "mismatch", "badarg"),
              "coalesced": ("kill", "stop", "late", "mismatch"),
              "ddp": ("kill", "stop", "mismatch")}
BADARGS = ("badarg", "overlap", "unmapped")  # a refused argument, then a retry or an exit
HIERARCHICAL = ("all_reduce", "all_reduce_async", "broadcast", "all_gather")
# Collectives whose out= a rank passes itself (overlap episodes put it over x).
WITH_OUT = ("all_gather", "reduce_scatter", "all_to_all", "scatter")
BLOCK_MISMATCH = ("split", "count", "dtype", "op", "outside")
# Note [Late raise points]: where the README lets a rank that returned normally from a call
# on which ranks disagreed raise instead. "next call": its next call on the group raises the
# failure (README, Errors: "The first call or wait() to hear of a failure raises it").
# "destroy": over TCP a rank whose part of the call only sends learns of the disagreement at
# its next call or, when none follows, at destroy() (README, Errors, MismatchError; Note
# [Farewell] in csrc/transport/transport.h): a rank whose destroy() raised it after a clean
# episode is right, not silent.
LATE_RAISE_POINTS = ("next call", "destroy")
TRANSPORTS = ("shm", "tcp")
INIT_TIMEOUT = 30.0
SLACK = 2.0  # an error must come within the call's timeout plus this
SHOWN = 12  # problems printed per failing episode
REDUCING = {"all_reduce", "all_reduce_async", "reduce", "reduce_scatter", "reduce_scatter_v"}
BITWISE = {"band", "bor", "bxor"}

# What one rank may change to disagree with the others, by collective.
MISMATCH = {
    "all_reduce": ("count", "dtype", "op", "kind"),
    "all_reduce_async": ("count", "dtype", "op"),
    "reduce": ("count", "dtype", "op", "root", "kind"),
    "broadcast": ("count", "dtype", "root", "kind"),
    "all_gather": ("count", "dtype", "kind"),
    "all_gather_v": ("width", "dtype"),
    "reduce_scatter": ("count", "dtype", "op", "kind"),
    "reduce_scatter_v": ("split", "dtype", "op"),
    "all_to_all": ("count", "dtype", "kind"),
    "all_to_all_v": ("width", "dtype"),
    "gather": ("count", "dtype", "root", "kind"),
    "scatter": ("count", "dtype", "root"),
    "sendrecv": ("tag", "count", "dtype"),
    "barrier": ("kind",),
}
# Bad arguments one rank may pass, by collective; ARRAY_SPOILS make an array unacceptable.
ARRAY_SPOILS = ("unsupported_dtype", "big_endian", "non_contiguous")
BADARG = {
    "all_reduce": ARRAY_SPOILS + ("read_only", "op", "timeout"),
    "all_reduce_async": ARRAY_SPOILS + ("read_only", "op", "timeout"),
    "reduce": ARRAY_SPOILS + ("op", "root", "timeout"),
    "broadcast": ARRAY_SPOILS + ("root", "timeout"),
    "all_gather": ARRAY_SPOILS + ("out", "timeout"),
    "all_gather_v": ARRAY_SPOILS + ("timeout",),
    "reduce_scatter": ARRAY_SPOILS + ("out", "op", "timeout"),
    "reduce_scatter_v": ARRAY_SPOILS + ("counts", "op", "timeout"),
    "all_to_all": ARRAY_SPOILS + ("out", "timeout"),
    "all_to_all_v": ARRAY_SPOILS + ("counts", "timeout"),
    "gather": ARRAY_SPOILS + ("root", "timeout"),
    "scatter": ARRAY_SPOILS + ("out", "root", "timeout"),
    "sendrecv": ARRAY_SPOILS + ("read_only", "peer", "tag", "timeout"),
    "barrier": ("timeout",),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="run time (default 10)")
    p.add_argument("--episodes", type=int, default=0, help="stop after this many episodes")
    p.add_argument("--only", type=int, default=None, help="run only episode ONLY (a replay)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-ranks", type=int, default=4, help="largest world (2-8, default 4)")
    p.add_argument("--transport", choices=("both",) + TRANSPORTS, default="both")
    p.add_argument("--faults", default=",".join(KINDS),
                   help=f"comma-separated subset of {','.join(KINDS)} (default: all)")
    p.add_argument("--timeout", type=float, default=2.5, help="per-call timeout, seconds")
    p.add_argument("--max-bytes", default="256K", help="largest input of a step (default 256K)")
    p.add_argument("--json", default=None, help="append one record per episode to this file")
    p.add_argument("--keep", default=None, help="copy failing episodes' directories here")
    p.add_argument("--quiet", action="store_true", help="no line per episode")
    args = p.parse_args(argv)
    args.faults = [f for f in args.faults.split(",") if f]
    bad = [f for f in args.faults if f not in KINDS]
    if bad or not args.faults:
        p.error(f"--faults: unknown {bad}; use a subset of {','.join(KINDS)}")
    if not 2 <= args.max_ranks <= 8:
        p.error("--max-ranks must be 2-8")
    return args


# ---- the plan: everything about an episode, drawn by the driver ------------------------

def steps_of(plan) -> List[soak.Step]:
    """The episode's steps, the same on every rank and in the driver (group None there)."""
    world = [("world", None, list(range(plan["world"])))]
    return [soak.Step(plan["seed"], s, world, plan["max_bytes"]) for s in range(plan["steps"])]


def dtype_named(name: str) -> np.dtype:
    return next(d for d in soak.DTYPES if d.name == name)


def other_dtype(rng, dt: np.dtype, op: Optional[str]) -> str:
    """A dtype other than ``dt`` with which ``op`` is still valid."""
    ok = [d for d in soak.DTYPES if d != dt
          and not (op in BITWISE and soak.is_float(d)) and not (op == "avg" and d == np.bool_)]
    return ok[int(rng.integers(len(ok)))].name


def other_op(rng, dt: np.dtype, op: str) -> str:
    ok = [o for o in soak.OPS if o != op
          and not (o in BITWISE and soak.is_float(dt)) and not (o == "avg" and dt == np.bool_)]
    return ok[int(rng.integers(len(ok)))]


def make_plan(args, index: int) -> dict:
    rng = np.random.default_rng([args.seed, index])
    world = int(rng.integers(2, args.max_ranks + 1))
    transport = (args.transport if args.transport != "both"
                 else TRANSPORTS[int(rng.integers(2))])
    drawn = args.faults[int(rng.integers(len(args.faults)))]
    episode, kind = "plain", drawn
    if drawn in SUB_FAULTS:
        episode, kind = drawn, SUB_FAULTS[drawn][int(rng.integers(len(SUB_FAULTS[drawn])))]
    elif drawn == "threads":
        episode = "threads"
    if episode == "hier":
        # Two emulated hosts, one with two ranks or more, and the transport left to meshcoll:
        # the world group is hierarchical (3 ranks even where --max-ranks is 2).
        world, transport = max(world, 3), "hier"
    plan = {"index": index, "world": world, "transport": transport,
            "store": "rank0" if rng.random() < 0.5 else "driver",
            "seed": int(rng.integers(1 << 31)), "steps": int(rng.integers(3, 9)),
            "timeout": args.timeout, "max_bytes": soak.parse_size(args.max_bytes),
            "episode": episode}
    # The collectives the fault's step may be, where it matters.
    fits = {"hier": HIERARCHICAL, "overlap": WITH_OUT,
            # (an empty x has no memory to be missing: not the _v collectives)
            "unmapped": [k for k in soak.KINDS if k != "barrier" and not k.endswith("_v")]}.get(
        "hier" if episode == "hier" else kind)
    if fits is None:
        at = int(rng.integers(plan["steps"]))
    else:
        while True:  # another schedule until one of its steps fits
            ok = [i for i, st in enumerate(steps_of(plan)) if st.kind in fits]
            if ok:
                at = ok[int(rng.integers(len(ok)))]
                break
            plan["seed"] = int(rng.integers(1 << 31))
    if episode == "ddp" and kind == "mismatch":
        at = 0  # the layouts are compared when DataParallel is made, in step 0
    st = steps_of(plan)[at]
    call = {"coalesced": "coalesced block", "ddp": "DataParallel",
            "threads": "async all_reduce from 2 threads"}.get(episode, st.kind)
    fault = {"kind": kind, "step": at, "victim": int(rng.integers(world)), "call": call}
    if kind == "kill":
        fault["when"] = "before" if rng.random() < 0.4 else "during"
        fault["delay"] = round(float(rng.uniform(0, 0.01)), 4)
    elif kind == "stop":
        fault["delay"] = round(float(rng.uniform(0, 0.005)), 4)
        fault["hold"] = round(args.timeout + float(rng.uniform(1.0, 1.5)), 3)
        fault["then"] = "cont" if rng.random() < 0.7 else "kill"
    elif kind == "late":
        fault["hold"] = args.timeout + 1.0
    elif kind == "mismatch" and episode == "coalesced":
        plan["block"] = draw_block(rng)
        fault["what"] = BLOCK_MISMATCH[int(rng.integers(len(BLOCK_MISMATCH)))]
        calls = plan["block"]
        i = int(rng.integers(len(calls)))
        if fault["what"] == "split" and not any(c[0] > 1 for c in calls):
            fault["what"] = "count"
        if fault["what"] == "split":  # the same total: one element moved to the next call
            i = next(j for j in range(len(calls)) if calls[j][0] > 1)
        fault["call_index"] = i
        if fault["what"] == "dtype":
            fault["dtype"] = other_dtype(rng, dtype_named(calls[i][1]), calls[i][2])
        elif fault["what"] == "op":
            fault["op"] = other_op(rng, dtype_named(calls[i][1]), calls[i][2])
    elif kind == "mismatch" and episode == "ddp":
        fault["what"] = ("shape", "name", "dtype")[int(rng.integers(3))]
    elif kind == "mismatch":
        choices = list(MISMATCH[st.kind])
        if st.kind == "reduce_scatter_v" and sum(st.rows) == 0:
            choices.remove("split")  # no row to move
        what = choices[int(rng.integers(len(choices)))]
        fault["what"] = what
        reducing = st.kind in REDUCING
        if what == "dtype":
            fault["dtype"] = other_dtype(rng, st.dtype, st.op if reducing else None)
        elif what == "op":
            fault["op"] = other_op(rng, st.dtype, st.op)
        elif what == "split":  # the same total, one row moved to another rank
            rows = list(st.rows)
            i = next(k for k, v in enumerate(rows) if v)
            rows[i] -= 1
            rows[(i + 1) % world] += 1
            fault["rows"] = rows
    elif kind == "badarg":
        choices = BADARG[st.kind]
        fault["what"] = choices[int(rng.integers(len(choices)))]
        fault["then"] = "retry" if rng.random() < 0.5 else "exit"
    elif kind in ("overlap", "unmapped"):
        fault["what"] = kind
        fault["then"] = "retry" if rng.random() < 0.5 else "exit"
        if kind == "overlap":
            # Where out= starts over x (or x over out=), as a fraction of the larger array.
            fault["at"] = round(float(rng.uniform(0, 1)), 4)
            if st.kind == "scatter":
                fault["victim"] = st.root  # off the root x is never read
        else:  # unmapped from x's first byte, or from a page boundary inside x
            fault["how"] = "whole" if rng.random() < 0.5 else "tail"
    plan["fault"] = fault
    # Shared memory without cross-memory attach takes the copy-through-segments paths.
    plan["cma"] = "0" if transport in ("shm", "hier") and rng.random() < 0.3 else "1"
    if episode == "hier":
        while True:  # every rank on host a or b, both hosts used
            hosts = ["ab"[int(b)] for b in rng.integers(0, 2, world)]
            if len(set(hosts)) == 2:
                break
        plan["hosts"] = hosts
    elif episode == "coalesced" and "block" not in plan:
        plan["block"] = draw_block(rng)
    elif episode == "threads":
        plan["threads"] = {"iters": int(rng.integers(50, 201)),
                           "count": int(rng.integers(1, 4097)),
                           "dtype": ("int32", "int64", "float32")[int(rng.integers(3))]}
    elif episode == "ddp":
        plan["ddp"] = [int(v) for v in rng.integers(1, 3000, int(rng.integers(2, 7)))]
    if kind == "mismatch" and rng.random() < 0.5:
        # No call after the disagreeing one: a rank that returned from it without an error
        # ends the episode cleanly ("silent"), as a job whose last call disagreed would.
        plan["steps"], plan["closing"] = at + 1, False
    return plan


def draw_block(rng) -> list:
    """A coalesced block: 2-6 small all_reduces, [count, dtype, op] each, mostly of one dtype
    and op (fused) with now and then a call of its own."""
    def one():
        dt = soak.DTYPES[int(rng.integers(len(soak.DTYPES)))]
        op = soak.OPS[int(rng.integers(len(soak.OPS)))]
        if (op in BITWISE and soak.is_float(dt)) or (op == "avg" and dt == np.bool_):
            op = "max"
        return dt.name, op
    dt, op = one()
    calls = []
    for _ in range(int(rng.integers(2, 7))):
        cdt, cop = one() if rng.random() < 0.2 else (dt, op)
        calls.append([int(rng.integers(1, 2049)), cdt, cop])
    return calls


def label(plan) -> str:
    """The episode's kind as the table shows it: the fault, after its episode's name where
    the episode draws its fault (hier:kill)."""
    ep, kind = plan.get("episode", "plain"), plan["fault"]["kind"]
    return f"{ep}:{kind}" if ep in SUB_FAULTS else kind


def describe(plan) -> str:
    f = plan["fault"]
    extra = ", ".join(f"{k}={v}" for k, v in f.items()
                      if k not in ("kind", "step", "victim", "call"))
    where = plan["transport"] if "hosts" not in plan else f"hosts {''.join(plan['hosts'])}"
    more = ""
    if "block" in plan:
        more = f", block {plan['block']}"
    elif "threads" in plan:
        more = f", threads {plan['threads']}"
    elif "ddp" in plan:
        more = f", parameters {plan['ddp']}"
    who = "every rank" if f["kind"] == "threads" else f"rank {f['victim']}"
    return (f"{label(plan)}({extra}) of {who} at step {f['step']} ({f['call']}); "
            f"world {plan['world']}, {where}"
            f"{'' if plan['cma'] == '1' else ' (no CMA)'}, store on {plan['store']}, "
            f"{plan['steps']} steps{'' if plan.get('closing', True) else ' (no closing call)'}"
            f", timeout {plan['timeout']} s{more}")


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)



# ---- the driver -------------------------------------------------------------------------

def pids_in_groups(pgids) -> List[int]:
    """Live processes whose process group is one of ``pgids``."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids and fields[0] != "Z":
            found.append(int(d))
    return found


def shm_left(pid0: int) -> List[str]:
    """Shared-memory segments of the job whose rank 0 is ``pid0`` (csrc/transport/shm/
    segment.cc names them /meshcoll-<rank 0's pid>-<time>-<rank>)."""
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"meshcoll-{pid0}-")]


def run_episode(plan, workdir: str, hard_limit: float) -> dict:
    import meshcoll
    from meshcoll.run import pick_free_port
    epdir = tempfile.mkdtemp(prefix=f"ep{plan['index']}-", dir=workdir)
    token = secrets.token_hex(8)
    server = None
    if plan["store"] == "driver":
        server = meshcoll.TCPStore("127.0.0.1", 0, is_server=True, timeout=INIT_TIMEOUT,
                                   token=token)
        plan["port"] = server.port
    else:
        plan["port"] = pick_free_port("127.0.0.1")
    write_json(os.path.join(epdir, "plan.json"), plan)
    env = dict(os.environ, MESHCOLL_TRANSPORT=plan["transport"], MESHCOLL_TOKEN=token,
               MESHCOLL_CMA=plan["cma"])
    for var in ("MESHCOLL_HOST_ID", "MESHCOLL_HIERARCHY"):
        env.pop(var, None)
    if "hosts" in plan:  # emulated hosts; the transport is meshcoll's choice (hierarchical)
        del env["MESHCOLL_TRANSPORT"]
    procs = []
    for r in range(plan["world"]):
        if "hosts" in plan:
            env["MESHCOLL_HOST_ID"] = f"host-{plan['hosts'][r]}"
        with open(os.path.join(epdir, f"rank{r}.err"), "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, RANK_SCRIPT, epdir, str(r)],
                env=env, stdout=err, stderr=err, start_new_session=True))
    pgids = {p.pid for p in procs}
    t0 = time.monotonic()
    released = hang = False
    while time.monotonic() - t0 < hard_limit:
        done = [p.poll() is not None or os.path.exists(os.path.join(epdir, f"rank{r}.json"))
                for r, p in enumerate(procs)]
        if all(done) and not released:
            open(os.path.join(epdir, "release"), "w").close()
            released = True
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.02)
    else:
        hang = True
    stuck = {}
    if hang:
        for r, p in enumerate(procs):
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGUSR1)  # faulthandler: the stacks to rank<r>.err
                except ProcessLookupError:
                    pass
                path = os.path.join(epdir, f"rank{r}.progress")
                stuck[r] = open(path).read() if os.path.exists(path) else "?"
        time.sleep(0.5)
    strays = [] if hang else pids_in_groups(pgids)
    if strays:  # a stop helper may be exiting right after its last kill: look again
        time.sleep(0.5)
        strays = pids_in_groups(pgids)
    for pgid in pgids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()
    elapsed = time.monotonic() - t0
    reports = {}
    for r in range(plan["world"]):
        path = os.path.join(epdir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[r] = json.load(f)
    # When the fault was injected: the earliest of the victims' notes (every rank is a victim
    # in a threads episode).
    noted = [json.load(open(os.path.join(epdir, f))) for f in os.listdir(epdir)
             if f.startswith("fault_at.") and f.endswith(".json")]
    fault_at = min(noted) if noted else None
    pid0 = reports[0]["pid"] if 0 in reports else procs[0].pid
    leftovers = shm_left(pid0)
    for name in leftovers:  # counted; now removed so that the soak does not fill /dev/shm
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
    del server
    record = {"plan": plan, "reports": reports, "fault_at": fault_at, "hang": hang, "stuck": stuck,
              "leftovers": leftovers, "strays": strays, "seconds": round(elapsed, 2),
              "exit_codes": [p.returncode for p in procs], "dir": epdir}
    record.update(judge(record))
    return record


RANK_LIST = r"\branks?(?:\(s\))? (\d+(?:(?:, | and )\d+)*)"


def ranks_named(text: str) -> set:
    """Every rank number after "rank", "ranks" or "rank(s)" in ``text``."""
    return {int(d) for m in re.finditer(RANK_LIST, text) for d in re.findall(r"\d+", m.group(1))}


def blamed(msg: str):
    """(sequence number, ranks) for each "rank(s) ... had not arrived / never reached" of a
    timeout's diagnosis: the ranks it says did not reach the call with that sequence number
    (the last one named before it; None if none is)."""
    for m in re.finditer(RANK_LIST + r" (?:had not arrived|never reached)", msg):
        seqs = re.findall(r"\[seq (\d+)\]", msg[:m.start()])
        yield (int(seqs[-1]) if seqs else None), {int(d) for d in re.findall(r"\d+", m.group(1))}


def position(rep: Optional[dict], rank: int) -> float:
    """The sequence number of the call in which ``rank`` raised (inf if it finished the job,
    -1 if unknown: dead, or raised in a point-to-point call, which has none)."""
    if rep is None:
        return -1
    if rep["error"] is None:
        return float("inf")
    m = re.search(rf"\[seq (\d+)\] on rank {rank} of", rep["error"]["msg"])
    return int(m.group(1)) if m else -1


def misblamed(msg: str, reports: dict, victim: int) -> List[int]:
    """Healthy ranks the diagnosis says never reached a call that they had finished: each
    raised later in a call with a higher sequence number, or never raised."""
    return sorted({b for seq, ranks in blamed(msg) if seq is not None for b in ranks
                   if b != victim and position(reports.get(b), b) > seq})


def judge(rec) -> dict:
    """Problems of one episode (kind, text), the times to the expected errors, counts."""
    plan, reports = rec["plan"], rec["reports"]
    f, n, limit = plan["fault"], plan["world"], plan["timeout"] + SLACK
    v, kind = f["victim"], f["kind"]
    problems, times = [], []
    wrong_results = late_writes = 0
    setup = any(rep["error"] and rep["error"]["step"] < 0 for rep in reports.values())
    if rec["hang"]:
        problems.append(("hang", f"still running after the hard limit: "
                                 + ", ".join(f"rank {r} at {w}" for r, w in rec["stuck"].items())))
    if rec["leftovers"]:
        problems.append(("leftover", f"/dev/shm: {rec['leftovers']}"))
    if rec["strays"]:
        problems.append(("leftover", f"stray processes {rec['strays']}"))
    victim_dies = kind == "kill" or (kind == "stop" and f["then"] == "kill")
    for r in range(n):
        rep = reports.get(r)
        if rep is None:
            if not (victim_dies and r == v) and not rec["hang"]:
                problems.append(("wrong error", f"rank {r}: died without a report (exit code "
                                                f"{rec['exit_codes'][r]})"))
            continue
        for w in rep["wrong"]:
            wrong_results += 1
            problems.append(("wrong result", f"rank {r}: {w}"))
        for w in rep["late_writes"]:
            late_writes += 1
            problems.append(("wrong result", f"rank {r}: {w}"))
        err = rep["error"]
        # Note [Late raise points]: a clean episode whose destroy() raised the disagreement.
        raised_at_destroy = (kind == "mismatch" and err is None and rep["completed"]
                             and "destroy" in LATE_RAISE_POINTS
                             and "mismatch" in (rep["destroy_error"] or "").lower())
        if rep["destroy_error"] and not raised_at_destroy:
            problems.append(("wrong error", f"rank {r}: destroy() raised {rep['destroy_error']}"))
        shown = f"{err['cls']} after {err['elapsed']:.2f} s at step {err['step']}: " \
                f"{err['msg']}" if err else "no error"
        if err and (rec["fault_at"] is None or err["t"] < rec["fault_at"]):
            problems.append(("wrong error", f"rank {r}: before the fault: {shown}"))
            continue
        if kind in BADARGS and r == v:
            a = rep["arg_error"]
            # An overlap or unmapped memory is a ValueError (README, API and Errors).
            classes = ("ValueError", "TypeError") if kind == "badarg" else ("ValueError",)
            if a is None or a["cls"] not in classes:
                got = f"{a['cls']}: {a['msg']}" if a else shown
                problems.append(("wrong error", f"rank {r}: bad argument "
                                                f"{rep.get('applied')}: expected "
                                                f"{' or '.join(classes)}, got {got}"))
                continue
        if kind == "threads":
            # README, Threads: ConcurrentCallError on the rank that saw it, PeerError (or
            # AbortedError at a later call) with the same message on the others; or no error
            # and every result right (checked above).
            if err is not None and not (err["cls"] == "ConcurrentCallError" or (
                    err["cls"] in ("PeerError", "AbortedError")
                    and "another thread" in err["msg"])):
                problems.append(("wrong error", f"rank {r}: expected ConcurrentCallError: "
                                                f"{shown}"))
            elif err is not None and err["elapsed"] <= limit:
                times.append(err["elapsed"])
            elif err is not None:
                problems.append(("wrong error", f"rank {r}: took {err['elapsed']:.2f} s > "
                                                f"timeout + {SLACK:g} s: {shown}"))
            continue
        expect_none = kind in BADARGS and f["then"] == "retry"
        if expect_none:
            if err or not rep["completed"]:
                problems.append(("wrong error", f"rank {r}: after a bad argument and a retry "
                                                f"the job should go on: {shown}"))
            continue
        if kind in BADARGS and r == v:
            continue  # it exited
        if err is None and kind == "stop" and r == v and rep["completed"]:
            # Resumed, it found its peers' data in place and finished with right results
            # (checked above): a result that is right is allowed; its peers raised.
            continue
        if err is None and kind == "mismatch" and rep["completed"]:
            if not raised_at_destroy:  # it returned from the call on which ranks disagreed
                problems.append(("silent", f"rank {r}: returned normally from step {f['step']} "
                                           f"({f.get('call')}), on which rank {v} disagreed "
                                           f"({f.get('what')}), and ended the episode without "
                                           f"an error"))
            continue
        if err is None:
            problems.append(("wrong error", f"rank {r}: no error"))
            continue
        if kind == "mismatch":
            ok = err["cls"] == "MismatchError" or (
                err["cls"] in ("AbortedError", "PeerError") and "mismatch" in err["msg"].lower())
            if not ok:
                problems.append(("wrong error", f"rank {r}: expected MismatchError: {shown}"))
                continue
        elif r == v:  # a resumed or late victim
            if err["cls"] not in ("TimeoutError", "PeerError", "AbortedError", "MismatchError"):
                problems.append(("wrong error", f"rank {r} (victim): {shown}"))
            continue
        else:
            classes = ("PeerError", "TimeoutError") + (("AbortedError",) if kind in BADARGS
                                                       else ())
            if err["cls"] not in classes:
                problems.append(("wrong error", f"rank {r}: expected {' or '.join(classes)}: "
                                                f"{shown}"))
                continue
            if v not in ranks_named(err["msg"]):
                problems.append(("misnamed", f"rank {r}: does not name rank {v}: {shown}"))
                continue
            healthy = misblamed(err["msg"], reports, v)
            if healthy:  # the error is right; its diagnosis is not (issue 16 item 14)
                problems.append(("misblame", f"rank {r}: says rank(s) {healthy} never "
                                             f"reached a call they had finished: {shown}"))
        if err["elapsed"] > limit:
            problems.append(("wrong error", f"rank {r}: took {err['elapsed']:.2f} s > timeout "
                                            f"+ {SLACK:g} s: {shown}"))
            continue
        times.append(err["elapsed"])
    return {"problems": problems, "times": times, "wrong_results": wrong_results,
            "late_writes": late_writes, "setup": setup}


# ---- the table ----------------------------------------------------------------------------

def summarize(records, elapsed: float, args) -> int:
    rows: Dict[tuple, dict] = defaultdict(lambda: defaultdict(int))
    times: Dict[tuple, list] = defaultdict(list)
    for rec in records:
        key = (label(rec["plan"]), rec["plan"]["transport"])
        row = rows[key]
        kinds = {k for k, _ in rec["problems"]}
        row["episodes"] += 1
        row["right"] += not rec["problems"]
        row["wrong_err"] += "wrong error" in kinds
        row["wrong_res"] += rec["wrong_results"] + rec["late_writes"]
        row["hangs"] += rec["hang"]
        row["leftover"] += "leftover" in kinds
        row["misblame"] += "misblame" in kinds
        row["misnamed"] += "misnamed" in kinds
        row["silent"] += "silent" in kinds
        row["setup"] += rec["setup"]
        times[key] += rec["times"]
    print(f"# meshcoll fault soak  seed={args.seed}  max-ranks={args.max_ranks}  "
          f"transport={args.transport}  timeout={args.timeout} s  episodes={len(records)}  "
          f"minutes={elapsed / 60:.1f}")
    cols = ("episodes", "right", "wrong_err", "wrong_res", "silent", "misnamed", "misblame",
            "hangs", "leftover", "setup")

    def line(first, second, row, t=()):
        cells = "".join(f" {row[c]:>{len(c)}}" for c in cols)
        med, mx = (f"{np.median(t):.2f}", f"{max(t):.2f}") if t else ("-", "-")
        return f"  {first:>18} {second:>9}{cells} {med:>6} {mx:>6}"

    print(f"# {'fault':>18} {'transport':>9} " + " ".join(cols) + f" {'t_med':>6} {'t_max':>6}")
    total = defaultdict(int)
    for key in sorted(rows):
        print(line(*key, rows[key], times[key]))
        for k, val in rows[key].items():
            total[k] += val
    print(line("total", "", total, sum(times.values(), [])))
    failed = [rec for rec in records if rec["problems"]]
    for rec in failed:
        print(f"\n## episode {rec['plan']['index']}: {describe(rec['plan'])}"
              + (f"  [kept in {rec['kept']}]" if rec.get("kept") else ""))
        for k, text in rec["problems"][:SHOWN]:
            print(f"   {k}: {text[:600]}")
        if len(rec["problems"]) > SHOWN:
            print(f"   ... and {len(rec['problems']) - SHOWN} more problems")
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="meshcoll-fault-soak-")
    records = []
    t0 = time.monotonic()
    index = args.only if args.only is not None else 0
    try:
        while True:
            if args.only is not None and records:
                break
            if args.episodes and index >= args.episodes and args.only is None:
                break
            if not args.episodes and time.monotonic() - t0 >= args.minutes * 60:
                break
            plan = make_plan(args, index)
            hard_limit = INIT_TIMEOUT + 4 * args.timeout + plan["fault"].get("hold", 0) + 10
            rec = run_episode(plan, workdir, hard_limit)
            if rec["problems"] and args.keep:
                os.makedirs(args.keep, exist_ok=True)
                rec["kept"] = shutil.copytree(rec["dir"], os.path.join(
                    args.keep, os.path.basename(rec["dir"])))
            shutil.rmtree(rec["dir"], ignore_errors=True)
            records.append(rec)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({k: v for k, v in rec.items() if k != "dir"}) + "\n")
            if not args.quiet:
                verdict = "ok" if not rec["problems"] else \
                    "FAIL: " + "; ".join(sorted({k for k, _ in rec["problems"]}))
                print(f"[{index:4d}] {rec['seconds']:5.1f} s  {describe(plan)}: {verdict}",
                      flush=True)
            index += 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return summarize(records, time.monotonic() - t0, args)


if __name__ == "__main__":
    sys.exit(main())
