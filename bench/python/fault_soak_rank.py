"""One rank of a fault-injection soak episode (fault_soak.py's driver starts one process per
rank): read the episode's plan, run its steps with the fault this rank injects, check every
result against numpy, and write a report the driver judges.

    python bench/python/fault_soak_rank.py EPISODE_DIR RANK      # as the driver runs it
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import soak  # noqa: E402  (the random steps and their numpy references)
from fault_soak import (  # noqa: E402  (the plan, drawn by the driver)
    ARRAY_SPOILS, BADARGS, INIT_TIMEOUT, dtype_named, steps_of, write_json)


# ---- the rank ---------------------------------------------------------------------------

def spoil(x: np.ndarray, what: str):
    """``x`` made unacceptable in the way ``what`` names; the name of what was done (an
    unsupported dtype where the asked-for spoiling would leave ``x`` acceptable)."""
    if what == "big_endian" and x.dtype.itemsize > 1 and x.dtype.kind in "iuf":
        return x.astype(x.dtype.newbyteorder(">")), what
    if what == "non_contiguous" and x.size > 1:
        wide = np.empty(x.shape + (2,), x.dtype)
        wide[..., 0] = x
        return wide[..., 0], what
    if what == "read_only":
        x = x.copy()
        x.setflags(write=False)
        return x, what
    return x.astype(np.complex64), "unsupported_dtype"


def overlapping(big_shape, small_shape, m: dict, in_place: Optional[int], dt, keep: list):
    """(big, small): two arrays over one buffer, ``small`` starting inside ``big`` at the
    element offset ``m["at"]`` points to, never ``in_place`` (the offset of the call's
    in-place form; None where it has none), so they overlap at least partly."""
    nb, ns = int(np.prod(big_shape)), int(np.prod(small_shape))
    at = min(int(m["at"] * nb), nb - 1)
    if at == in_place:
        at = at + 1 if at + 1 < nb else at - 1
    buf = np.zeros(nb + ns, dt)
    keep.append(buf)
    m["applied"] = f"overlap at element {at} of {nb}"
    return buf[:nb].reshape(big_shape), buf[at:at + ns].reshape(small_shape)


def unmapped_like(a: np.ndarray, how: str) -> np.ndarray:
    """An array of ``a``'s dtype and shape over memory unmapped (munmap) under it: from its
    first byte ("whole"), or from a page boundary in its middle ("tail"; "whole" where it
    holds one element)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    size = (a.nbytes // page + 2) * page
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), "mmap failed"
    if how == "tail" and a.size > 1:
        # The array's first half in the mapped pages, the rest in the last page, unmapped.
        start = addr + size - page - a.itemsize * (a.size // 2)
        assert libc.munmap(addr + size - page, page) == 0
    else:
        start = addr
        assert libc.munmap(addr, size) == 0
    buf = (ctypes.c_char * a.nbytes).from_address(start)
    return np.frombuffer(buf, a.dtype).reshape(a.shape)


def call_step(g, st, timeout: float, mod: Optional[dict], keep: list) -> List[str]:
    """This rank's part of step ``st``, with ``mod`` (the victim's disagreement or bad
    argument) applied; returns what was wrong with the results (a modified call's results are
    not checked). Every array handed to the library is appended to ``keep``."""
    n, r = g.size, g.rank
    m = mod or {}
    mismatch = m.get("kind") == "mismatch"
    bad = m.get("what") if m.get("kind") in BADARGS else None
    what = m.get("what") if mismatch else None
    kind, dt, op, root, tag = st.kind, st.dtype, st.op, st.root, st.root
    count, cols, rows = st.count, st.cols, list(st.rows)
    if what == "kind":
        kind = "broadcast" if kind == "all_reduce" else "all_reduce"
    elif what == "dtype":
        dt = next(d for d in soak.DTYPES if d.name == m["dtype"])
    elif what == "op":
        op = m["op"]
    elif what == "root":
        root = (root + 1) % n
    elif what in ("count", "width"):
        count, cols = count + 1, cols + 1
    elif what == "tag":
        tag += 1
    elif what == "split":
        rows = list(m["rows"])
    if bad == "timeout":
        timeout = -1.0
    if bad == "root":
        root = n
    if bad == "op":
        op = "median"
    if bad == "tag":
        tag = -1
    problems: List[str] = []

    def inp(member, shape, op_=op, salt=0):
        size = int(np.prod(shape))
        return soak.member_input(np.resize(st.base[salt:], size), member, dt, op_, shape)

    def mine(a):
        """This rank's copy of its input, spoiled if that is the bad argument."""
        a = a.copy()
        if bad == "unmapped":  # not kept: reading it would end this process
            a, m["applied"] = unmapped_like(a, m["how"]), f"unmapped ({m['how']})"
            return a
        if bad in ARRAY_SPOILS + ("read_only",):
            a, m["applied"] = spoil(a, bad)
        keep.append(a)
        return a

    def out_array(shape):
        o = np.empty(shape if bad != "out" else (shape[0] + 1,) + tuple(shape[1:]), dt)
        keep.append(o)
        return o

    def check(label, got, want, op_=None):
        """``want`` is a function: a modified call may have no reference (an unknown op)."""
        if mod is None:
            msg = soak.same(np.asarray(got), np.asarray(want()), op_)
            if msg:
                problems.append(f"step {st.index} {label}: {msg}")

    if kind in ("all_reduce", "all_reduce_async"):
        algo = "shm" if g.transport.startswith("shm") and st.shm_algo else st.algo
        batch = st.batch if kind == "all_reduce_async" else 1
        works = []
        for b in range(batch):
            xs = [inp(i, (max(1, count >> b),), salt=2 * b) for i in range(n)]
            x = mine(xs[r]) if b == 0 else xs[r].copy()
            if not (b == 0 and bad == "unmapped"):
                keep.append(x)
            want = (lambda xs=xs: soak.reference(xs, op, dt))
            if kind == "all_reduce":
                g.all_reduce(x, op, algorithm=algo, timeout=timeout)
                check(f"all_reduce {op} {dt.name} algo={algo}", x, want, op)
            else:
                works.append((g.all_reduce(x, op, async_op=True, timeout=timeout), x, want))
        for b, (w, x, want) in enumerate(works):
            w.wait()
            check(f"async all_reduce #{b} {op} {dt.name}", x, want, op)
    elif kind == "reduce":
        xs = [inp(i, (count,)) for i in range(n)]
        x = mine(xs[r])
        g.reduce(x, root, op, timeout=timeout)
        check(f"reduce {op} {dt.name} root={root}", x,
              lambda: soak.reference(xs, op, dt) if r == root else xs[r], op)
    elif kind == "broadcast":
        xs = [inp(i, (count,), None) for i in range(n)]
        x = mine(xs[r])
        g.broadcast(x, root, timeout=timeout)
        check(f"broadcast {dt.name} root={root}", x, lambda: xs[root])
    elif kind == "all_gather":
        xs = [inp(i, (cols, 2), None) for i in range(n)]
        if bad == "overlap":  # x over out, not as out's block r (the in-place form)
            out, x = overlapping((n, cols, 2), (cols, 2), m, r * cols * 2, dt, keep)
            x[...] = xs[r]
        else:
            out, x = out_array((n, cols, 2)) if bad == "out" else None, mine(xs[r])
        got = g.all_gather(x, out, timeout=timeout)
        check(f"all_gather {dt.name}", got, lambda: np.stack(xs))
    elif kind == "all_gather_v":
        xs = [inp(i, (st.rows[i], cols), None) for i in range(n)]
        got, counts = g.all_gather_v(mine(xs[r]), timeout=timeout)
        check(f"all_gather_v {dt.name}", got, lambda: np.concatenate(xs))
        if mod is None and counts != st.rows:
            problems.append(f"step {st.index} all_gather_v counts {counts}, expected {st.rows}")
    elif kind == "reduce_scatter":
        xs = [inp(i, (2 * n, cols)) for i in range(n)]
        if bad == "overlap":  # out over x, not as x's block r (the in-place form)
            x, out = overlapping((2 * n, cols), (2, cols), m, 2 * r * cols, dt, keep)
            x[...] = xs[r]
        else:
            out, x = out_array((2, cols)) if bad == "out" else None, mine(xs[r])
        got = g.reduce_scatter(x, out, op=op, timeout=timeout)
        check(f"reduce_scatter {op} {dt.name}", got,
              lambda: soak.reference(xs, op, dt)[2 * r:2 * r + 2], op)
    elif kind == "reduce_scatter_v":
        total = sum(st.rows)
        xs = [inp(i, (total, cols)) for i in range(n)]
        counts = rows if bad != "counts" else rows[:-1] + [rows[-1] + 1]
        got = g.reduce_scatter_v(mine(xs[r]), counts, op=op, timeout=timeout)
        off = sum(st.rows[:r])
        check(f"reduce_scatter_v {op} {dt.name}", got,
              lambda: soak.reference(xs, op, dt)[off:off + st.rows[r]], op)
    elif kind == "all_to_all":
        xs = [inp(i, (2 * n, cols), None) for i in range(n)]
        if bad == "overlap":  # all_to_all has no in-place form: any overlap
            x, out = overlapping((2 * n, cols), (2 * n, cols), m, None, dt, keep)
            x[...] = xs[r]
        else:
            out, x = out_array((2 * n, cols)) if bad == "out" else None, mine(xs[r])
        got = g.all_to_all(x, out, timeout=timeout)
        check(f"all_to_all {dt.name}", got,
              lambda: np.concatenate([xs[i][2 * r:2 * r + 2] for i in range(n)]))
    elif kind == "all_to_all_v":
        mx = st.matrix  # mx[i][j]: rows member i sends to member j
        xs = [inp(i, (int(mx[i].sum()), cols), None) for i in range(n)]
        send = [int(v) for v in mx[r]]
        if bad == "counts":
            send[-1] += 1
        got, counts = g.all_to_all_v(mine(xs[r]), send, timeout=timeout)
        want = [xs[i][int(mx[i][:r].sum()):int(mx[i][:r + 1].sum())] for i in range(n)]
        check(f"all_to_all_v {dt.name}", got, lambda: np.concatenate(want))
        if mod is None and counts != [int(mx[i][r]) for i in range(n)]:
            problems.append(f"step {st.index} all_to_all_v counts {counts}")
    elif kind == "gather":
        xs = [inp(i, (count,), None) for i in range(n)]
        got = g.gather(mine(xs[r]), root, timeout=timeout)
        if r == root:
            check(f"gather {dt.name} root={root}", got, lambda: np.stack(xs))
        elif got is not None and mod is None:
            problems.append(f"step {st.index} gather returned data on a non-root rank")
    elif kind == "scatter":
        full = inp(st.root, (n, cols), None)
        if bad == "overlap":  # the root's out over x, not as x[root] (the in-place form)
            x, out = overlapping((n, cols), (cols,), m, root * cols, dt, keep)
            x[...] = full
            got = g.scatter(x, root, out=out, timeout=timeout)
        elif r == root or bad == "out":  # x given: an out= of another size is a bad argument
            out = out_array((cols,)) if bad == "out" else None
            got = g.scatter(mine(full), root, out=out, timeout=timeout)
        else:
            if bad == "unmapped":
                o, m["applied"] = unmapped_like(np.empty(cols, dt), m["how"]), "unmapped out"
            else:
                o = out_array((cols,))
            if bad in ARRAY_SPOILS:
                o, m["applied"] = spoil(o, bad)
                keep.append(o)
            got = g.scatter(None, root, out=o, timeout=timeout)
        check(f"scatter {dt.name} root={root}", got, lambda: full[r])
    elif kind == "sendrecv":
        xs = [inp(i, (count,), None) for i in range(n)]
        want = xs[(r - 1) % n]
        buf = np.empty(st.count, st.dtype)  # the receive side is never modified
        if bad in ("read_only", "non_contiguous"):
            buf, m["applied"] = spoil(buf, bad)
        keep.append(buf)
        peer = n if bad == "peer" else (r + 1) % n
        src = xs[r].copy() if bad in (None, "read_only", "non_contiguous") else mine(xs[r])
        if bad != "unmapped":
            keep.append(src)
        # The call with the bad argument comes first, so that nothing is under way when it
        # raises (a retry repeats both).
        if bad in ("read_only", "non_contiguous"):
            wr = g.irecv(buf, (r - 1) % n, tag=st.root, timeout=timeout)
            ws = g.isend(src, peer, tag=tag, timeout=timeout)
        else:
            ws = g.isend(src, peer, tag=tag, timeout=timeout)
            wr = g.irecv(buf, (r - 1) % n, tag=st.root, timeout=timeout)
        ws.wait()
        wr.wait()
        check(f"send/recv {dt.name}", buf, lambda: want)
    elif kind == "barrier":
        g.barrier(timeout=timeout)
    else:
        raise AssertionError(kind)
    return problems


def call_block(g, plan, st, timeout: float, mod: Optional[dict], keep: list) -> List[str]:
    """Step ``st`` as a coalesced block of small all_reduces (plan["block"]); the victim's
    mismatch forms another block: one element moved from a call to the next ("split"), one
    more element, another dtype or op in one call, or the last call made after the block."""
    n, r = g.size, g.rank
    calls = [list(c) for c in plan["block"]]
    what = mod.get("what") if mod else None
    if what is not None:
        i = mod["call_index"]
        if what == "split":
            calls[i][0] -= 1
            calls[(i + 1) % len(calls)][0] += 1
        elif what == "count":
            calls[i][0] += 1
        elif what == "dtype":
            calls[i][1] = mod["dtype"]
        elif what == "op":
            calls[i][2] = mod["op"]
    todo = []
    for j, (count, name, op) in enumerate(calls):
        dt = dtype_named(name)
        xs = [soak.member_input(np.resize(st.base[j:], count), i, dt, op, (count,))
              for i in range(n)]
        x = xs[r].copy()
        keep.append(x)
        todo.append((x, op, xs, dt))
    with g.coalesced(timeout=timeout):
        for x, op, _, _ in (todo[:-1] if what == "outside" else todo):
            g.all_reduce(x, op, timeout=timeout)
    if what == "outside":
        g.all_reduce(todo[-1][0], todo[-1][1], timeout=timeout)
    problems = []
    for j, (x, op, xs, dt) in enumerate(todo if mod is None else ()):
        msg = soak.same(x, soak.reference(xs, op, dt), op)
        if msg:
            problems.append(f"step {st.index} block call {j} {op} {dt.name}: {msg}")
    return problems


def call_threads(g, plan, st, timeout: float) -> List[str]:
    """Step ``st``: two threads each make plan["threads"]["iters"] async all_reduces on the
    group, each waited on before the next, checked against numpy. Calls from two threads
    pair across ranks in whatever order each rank issued them: the README promises a
    ConcurrentCallError on every rank (or results that are right). A thread stops at its
    first error; the first error raised on this rank is the step's."""
    n, r = g.size, g.rank
    spec = plan["threads"]
    dt, count = np.dtype(spec["dtype"]), spec["count"]
    problems: List[str] = []
    errors: list = []

    def loop(t):
        for i in range(spec["iters"]):
            if errors:
                return
            xs = [np.random.default_rng([plan["seed"], t, i, q]).integers(-8, 9, count)
                  .astype(dt) for q in range(n)]
            x = xs[r].copy()
            try:
                g.all_reduce(x, "sum", async_op=True, timeout=timeout).wait()
            except Exception as e:  # noqa: BLE001
                errors.append((time.monotonic(), e))
                return
            msg = soak.same(x, soak.reference(xs, "sum", dt), "sum")
            if msg:
                problems.append(f"step {st.index} thread {t} call {i}: {msg}")

    threads = [threading.Thread(target=loop, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    return problems


def call_ddp(state: dict, plan, s: int, timeout: float, mod: Optional[dict],
             keep: list) -> List[str]:
    """Step ``s`` of a DataParallel episode: in step 0 DataParallel is made over the group
    (the victim's mismatch: a parameter of another shape, name or dtype); then every step
    hands over each gradient in backward order and waits for the averages (against numpy)."""
    from meshcoll import DataParallel
    g, n, r = state["group"], state["group"].size, state["group"].rank
    sizes = plan["ddp"]
    names = [f"w{i}" for i in range(len(sizes))]
    if s == 0:
        params = {nm: np.zeros(sz) for nm, sz in zip(names, sizes)}
        what = mod.get("what") if mod else None
        if what == "shape":
            params[names[-1]] = np.zeros(sizes[-1] + 1)
        elif what == "name":
            params["v" + names[-1]] = params.pop(names[-1])
        elif what == "dtype":
            params[names[-1]] = np.zeros(sizes[-1], np.float32)
        cap = max(1, sum(sizes) * 8 // 3) / 2**20  # about three buckets
        state["ddp"] = DataParallel(params, group=g, bucket_cap_mb=cap)
    ddp = state["ddp"]

    def grad(q, i):
        return np.random.default_rng([plan["seed"], s, q, i]).standard_normal(sizes[i])

    grads = {}
    for i in reversed(range(len(names))):
        grads[i] = grad(r, i)
        keep.append(grads[i])
        ddp.grad_ready(names[i], grads[i])
    ddp.wait()
    problems = []
    for i in range(len(names)):
        want = sum(grad(q, i) for q in range(n)) / n
        if not np.allclose(grads[i], want, rtol=1e-12, atol=1e-12):
            bad = int((~np.isclose(grads[i], want, rtol=1e-12, atol=1e-12)).sum())
            problems.append(f"step {s} DataParallel {names[i]}: {bad} of {sizes[i]} elements "
                            f"differ from the average")
    return problems


def run_step(g, plan, st, timeout: float, mod: Optional[dict], keep: list,
             state: dict) -> List[str]:
    """This rank's part of step ``st``, as the episode makes it."""
    episode = plan.get("episode", "plain")
    if episode == "coalesced" and st.index == plan["fault"]["step"]:
        return call_block(g, plan, st, timeout, mod, keep)
    if episode == "threads" and st.index == plan["fault"]["step"]:
        return call_threads(g, plan, st, timeout)
    if episode == "ddp":
        return call_ddp(state, plan, st.index, timeout, mod, keep)
    return call_step(g, st, timeout, mod, keep)


def failure(e: BaseException, step: int, t0: float) -> dict:
    """What a rank reports of an exception: class, message, step, seconds in the call, and
    when it was raised (wall clock: the driver compares it with the fault's time)."""
    return {"cls": type(e).__name__, "msg": str(e), "step": step,
            "elapsed": time.monotonic() - t0, "t": time.time()}


def worker(epdir: str, rank: int) -> int:
    import faulthandler
    faulthandler.register(signal.SIGUSR1)  # the driver asks for the stacks of a hang
    import meshcoll
    with open(os.path.join(epdir, "plan.json")) as f:
        plan = json.load(f)
    n, fault, timeout = plan["world"], plan["fault"], plan["timeout"]
    episode = plan.get("episode", "plain")
    victim = rank == fault["victim"] or episode == "threads"  # there every rank is one
    rep = {"rank": rank, "steps_done": 0, "wrong": [], "arg_error": None, "error": None,
           "completed": False, "late_writes": [], "destroy_error": None, "applied": None,
           "pid": os.getpid()}
    out_path = os.path.join(epdir, f"rank{rank}.json")
    progress = os.path.join(epdir, f"rank{rank}.progress")

    def at(text):
        with open(progress, "w") as f:
            f.write(text)

    at("init")
    try:
        if plan["store"] == "driver":
            store = meshcoll.TCPStore("127.0.0.1", plan["port"], timeout=INIT_TIMEOUT)
            pg = meshcoll.init(rank=rank, world_size=n, store=store, timeout=INIT_TIMEOUT)
        else:
            pg = meshcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1",
                               master_port=plan["port"], timeout=INIT_TIMEOUT)
        if "hosts" in plan and pg._hier is None:
            raise RuntimeError(f"not hierarchical on hosts {plan['hosts']} ({pg.transport})")
        state = {}
        if episode == "ddp":  # its calls take the group's timeout: a group of its own
            state["group"] = pg.new_group(list(range(n)), timeout=timeout)
    except Exception as e:  # noqa: BLE001 - every failure is reported
        rep["error"] = failure(e, -1, time.monotonic())
        write_json(out_path, rep)
        return 1
    rep["transport"] = pg.transport
    steps = steps_of(plan)
    for i, st in enumerate(steps):
        st.index = i
    pending = None  # a kill timer or stop helper that has not fired yet
    keep: list = []
    closing = plan.get("closing", True)
    for s in range(plan["steps"] + closing):
        at(f"step {s}")
        mod = None
        if victim and s == fault["step"]:
            write_json(os.path.join(epdir, f"fault_at.{rank}.json"), time.time())
            k = fault["kind"]
            if k == "kill" and fault["when"] == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            elif k == "kill":
                pending = threading.Timer(fault["delay"], os.kill,
                                          (os.getpid(), signal.SIGKILL))
                pending.start()
            elif k == "stop":
                # A timer stops this process inside the call (a helper process could not
                # start that fast); the helper ends the stop.
                then = "CONT" if fault["then"] == "cont" else "KILL"
                pending = subprocess.Popen(
                    ["sh", "-c", f"sleep {fault['delay'] + fault['hold']}; "
                                 f"kill -{then} {os.getpid()}"])
                threading.Timer(fault["delay"], os.kill, (os.getpid(), signal.SIGSTOP)).start()
            elif k == "late":
                time.sleep(fault["hold"])
            elif k != "threads":
                mod = dict(fault)
        if s == plan["steps"] and pending is not None:
            # The fault has not landed yet: let it land before the closing call, so that it
            # is still a fault during the job.
            if isinstance(pending, threading.Timer):
                os.kill(os.getpid(), signal.SIGKILL)
            pending.wait()
        keep = []
        t0 = time.monotonic()
        try:
            if s < plan["steps"]:
                problems = run_step(pg, plan, steps[s], timeout, mod, keep, state)
            else:  # the closing call: needs every rank
                x = np.full(3, rank, np.int64)
                keep.append(x)
                pg.all_reduce(x, timeout=timeout)
                problems = [] if np.all(x == n * (n - 1) // 2) else [f"closing all_reduce: {x}"]
        except (ValueError, TypeError) as e:
            if mod is None or mod["kind"] not in BADARGS:
                rep["error"] = failure(e, s, t0)
                break
            rep["arg_error"] = failure(e, s, t0)
            rep["applied"] = mod.get("applied", mod["what"])
            if fault["then"] == "exit":
                write_json(out_path, rep)
                return 1  # as a program does when the exception propagates
            keep = []
            t0 = time.monotonic()
            try:
                problems = run_step(pg, plan, steps[s], timeout, None, keep, state)
            except Exception as e2:  # noqa: BLE001
                rep["error"] = failure(e2, s, t0)
                break
        except Exception as e:  # noqa: BLE001 - meshcoll errors and anything unexpected
            rep["error"] = failure(e, s, t0)
            break
        if mod is not None and mod["kind"] in BADARGS:
            rep["applied"] = mod.get("applied", mod["what"])
        rep["steps_done"] += 1
        rep["wrong"] += problems
    else:
        rep["completed"] = True
    at("reported")
    snapshot = [a.copy() for a in keep]
    write_json(out_path, rep)
    if isinstance(pending, subprocess.Popen):
        pending.wait()
    # Wait until the driver says every rank is done (a stopped peer resumed or died), then
    # look for writes into the failed call's arrays that came after it returned.
    release = os.path.join(epdir, "release")
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
    if rep["error"] is not None:
        for a, b in zip(keep, snapshot):
            if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                diff = np.flatnonzero(a.view(np.uint8).ravel() != b.view(np.uint8).ravel())
                rep["late_writes"].append(
                    f"{diff.size} of {a.nbytes} bytes of an array of the failed call (step "
                    f"{rep['error']['step']}) changed after the call raised")
    at("destroy")
    try:
        meshcoll.destroy()
    except Exception as e:  # noqa: BLE001
        rep["destroy_error"] = f"{type(e).__name__}: {e}"
    write_json(out_path, rep)
    at("done")
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], int(sys.argv[2])))
