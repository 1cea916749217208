"""Tier 3: the NCCL backend on real GPUs, one process per GPU.

Every test that needs a GPU skips with the reason ``meshcoll.nccl.nccl_available()`` gives
(so CI without GPUs reports a clear skip); the missing-library / no-GPU error tests, which
run everywhere, are in test_nccl_unavailable.py. Ranks are launched by ``run_nccl`` below, the shared launcher of tests/conftest.py
with ``backend="nccl"``: each rank calls ``meshcoll.init(backend="nccl", device=rank)``.
Arrays are PyTorch CUDA tensors unless a test says otherwise (CuPy where installed).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from conftest import launch

import meshcoll
from meshcoll import _C
from meshcoll.nccl import nccl_available

OK, WHY = nccl_available()
NGPU = int(_C.cuda_device_count()) if OK else 0
try:
    import torch
    HAVE_TORCH_CUDA = OK and torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is in the GPU image
    HAVE_TORCH_CUDA = False

needs_gpu = pytest.mark.skipif(not OK, reason=f"NCCL backend unavailable: {WHY}")
needs_torch = pytest.mark.skipif(not HAVE_TORCH_CUDA,
                                 reason=f"needs PyTorch with CUDA ({WHY if not OK else 'no torch.cuda'})")


def gpus(n):
    return pytest.mark.skipif(NGPU < n, reason=f"needs {n} GPUs, {NGPU} visible ({WHY})")


# ---- launcher ------------------------------------------------------------------------

def run_nccl(world, fn, *, deadline=180.0, timeout=60.0, env=None, may_die=(), **kwargs):
    """``run_ranks`` (tests/conftest.py) on the NCCL backend, rank r on GPU r, NVLink
    multicast off; ``deadline`` bounds the whole run, ``timeout`` each rank's init."""
    return launch(world, fn, timeout=deadline, init_timeout=timeout,
                  env={"NCCL_NVLS_ENABLE": "0", **(env or {})}, may_die=may_die,
                  backend="nccl", **kwargs)


def destroy_failed(g):
    """Destroys group ``g`` after a test made it fail: destroy() may raise that failure again
    (a rank that never saw it)."""
    try:
        g.destroy()
    except meshcoll.MeshcollError:
        pass


# ---- reference data --------------------------------------------------------------------

DTYPES = ["int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = ["sum", "prod", "min", "max", "avg"]
TOL = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-5, "float64": 1e-12}


def _data(seed, rank, n, dtype, op="sum"):
    """Rank ``rank``'s input, reproducible on every rank (for the numpy reference)."""
    rng = np.random.default_rng([seed, rank])
    if dtype in ("int8", "uint8", "int32", "int64"):
        lo = 0 if dtype == "uint8" else -3
        return rng.integers(lo, 4, n).astype(np.int64)
    if op == "prod":
        return rng.uniform(0.5, 1.5, n)
    return rng.standard_normal(n) + 0.25


def _tensor(values, dtype):
    import torch
    t = torch.tensor(values, dtype=torch.float64 if dtype.startswith(("float", "bfloat")) else torch.int64)
    return t.to(getattr(torch, dtype)).cuda()


def _exact(values, dtype):
    """What the inputs are after rounding to ``dtype`` (float64 / int64 numpy)."""
    t = _tensor(values, dtype)
    return t.cpu().double().numpy() if dtype.startswith(("float", "bfloat")) else t.cpu().numpy()


def _reduce(arrays, op, dtype):
    a = np.stack(arrays)
    if op == "sum":
        r = a.sum(0)
    elif op == "prod":
        r = a.prod(0)
    elif op == "min":
        r = a.min(0)
    elif op == "max":
        r = a.max(0)
    else:
        r = a.mean(0)
    if dtype in ("int8", "uint8", "int32", "int64"):  # wrap as the device does
        r = r.astype(getattr(np, dtype)).astype(np.int64)
    return r


def _close(got, want, dtype, what, fails):
    got = got.detach().cpu()
    got = got.double().numpy() if dtype.startswith(("float", "bfloat")) else got.numpy().astype(np.int64)
    want = np.asarray(want).reshape(got.shape)
    if dtype in TOL:
        scale = np.maximum(np.abs(want), 1.0)
        bad = np.abs(got - want) > TOL[dtype] * scale
    else:
        bad = got != want
    if got.dtype.kind == "f":
        bad |= np.isnan(got)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        fails.append(f"{what} {dtype}: {int(bad.sum())} wrong, first at {i}: "
                     f"got {got.ravel()[i]}, want {want.ravel()[i]}")


# ---- bodies (run on every rank) ----------------------------------------------------------

def _all_collectives(pg, n, seed):
    import torch
    fails = []
    r, w = pg.rank, pg.size
    for dtype in DTYPES:
        floating = dtype.startswith(("float", "bfloat"))
        for op in OPS:
            if op == "avg" and not floating:
                continue
            ins = [_exact(_data(seed, k, n, dtype, op), dtype) for k in range(w)]
            x = _tensor(ins[r], dtype)
            pg.all_reduce(x, op=op)
            _close(x, _reduce(ins, op, dtype), dtype, f"all_reduce[{op}]", fails)
            # out-of-place reduce onto the last rank
            x = _tensor(ins[r], dtype)
            pg.reduce(x, dst=w - 1, op=op)
            _close(x, _reduce(ins, op, dtype) if r == w - 1 else ins[r], dtype,
                   f"reduce[{op}]", fails)
        ins = [_exact(_data(seed + 1, k, n, dtype), dtype) for k in range(w)]
        x = _tensor(ins[r], dtype)
        pg.broadcast(x, src=w - 1)
        _close(x, ins[w - 1], dtype, "broadcast", fails)
        _close(pg.all_gather(_tensor(ins[r], dtype)), np.stack(ins), dtype, "all_gather", fails)
        # uneven: rank k holds k+1 rows of 3
        rows = [_exact(_data(seed + 2, k, 3 * (k + 1), dtype), dtype).reshape(k + 1, 3)
                for k in range(w)]
        out, counts = pg.all_gather_v(_tensor(rows[r], dtype).reshape(r + 1, 3))
        assert counts == [k + 1 for k in range(w)], counts
        _close(out, np.concatenate(rows), dtype, "all_gather_v", fails)
        for op in ("sum", "max") + (("avg",) if floating else ()):
            big = [_exact(_data(seed + 3, k, w * n, dtype), dtype) for k in range(w)]
            red = _reduce(big, op, dtype)
            got = pg.reduce_scatter(_tensor(big[r], dtype).reshape(w, n), op=op)
            _close(got, red[r * n:(r + 1) * n], dtype, f"reduce_scatter[{op}]", fails)
            counts = [k + 1 for k in range(w)]
            tot = sum(counts)
            big = [_exact(_data(seed + 4, k, tot * 2, dtype), dtype) for k in range(w)]
            red = _reduce(big, op, dtype).reshape(tot, 2)
            got = pg.reduce_scatter_v(_tensor(big[r], dtype).reshape(tot, 2), counts, op=op)
            lo = sum(counts[:r])
            _close(got, red[lo:lo + counts[r]], dtype, f"reduce_scatter_v[{op}]", fails)
        blocks = [_exact(_data(seed + 5, k, w * n, dtype), dtype).reshape(w, n) for k in range(w)]
        got = pg.all_to_all(_tensor(blocks[r], dtype).reshape(w, n))
        _close(got, np.stack([blocks[k][r] for k in range(w)]), dtype, "all_to_all", fails)
        # all_to_all_v: rank k sends (k + j) % 3 + 1 rows to rank j
        sc = [[(k + j) % 3 + 1 for j in range(w)] for k in range(w)]
        src = [_exact(_data(seed + 6, k, sum(sc[k]) * 2, dtype), dtype).reshape(-1, 2) for k in range(w)]
        got, rc = pg.all_to_all_v(_tensor(src[r], dtype).reshape(-1, 2), sc[r])
        assert rc == [sc[k][r] for k in range(w)], rc
        want = np.concatenate([src[k][sum(sc[k][:r]):sum(sc[k][:r + 1])] for k in range(w)])
        _close(got, want, dtype, "all_to_all_v", fails)
        got = pg.gather(_tensor(ins[r], dtype), dst=0)
        if r == 0:
            _close(got, np.stack(ins), dtype, "gather", fails)
        else:
            assert got is None
        full = np.stack(ins)
        got = pg.scatter(_tensor(full.ravel(), dtype).reshape(w, n) if r == w - 1 else None,
                         src=w - 1, out=_tensor(np.zeros(n), dtype))
        _close(got, full[r], dtype, "scatter", fails)
        if w > 1:  # ring: send right, receive from the left
            y = _tensor(np.zeros(n), dtype)
            if r % 2 == 0:
                pg.send(_tensor(ins[r], dtype), (r + 1) % w)
                pg.recv(y, (r - 1) % w)
            else:
                pg.recv(y, (r - 1) % w)
                pg.send(_tensor(ins[r], dtype), (r + 1) % w)
            _close(y, ins[(r - 1) % w], dtype, "send/recv", fails)
    pg.barrier()
    torch.cuda.synchronize()
    return fails


@needs_torch
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_collective_dtype_and_op(world):
    if NGPU < world:
        pytest.skip(f"needs {world} GPUs, {NGPU} visible")
    results = run_nccl(world, _all_collectives, n=1031, seed=7)
    fails = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not fails, "\n".join(fails)


def _large(pg, n):
    import torch
    x = torch.full((n,), float(pg.rank + 1), device="cuda")
    pg.all_reduce(x)
    y = pg.all_gather(torch.full((n,), float(pg.rank), device="cuda"))
    torch.cuda.synchronize()
    want = pg.size * (pg.size + 1) / 2
    return (bool((x == want).all()),
            all(bool((y[k] == k).all()) for k in range(pg.size)))


@needs_torch
@gpus(2)
def test_large_buffers():
    for ok_reduce, ok_gather in run_nccl(2, _large, n=(64 << 20) + 3):
        assert ok_reduce and ok_gather


def _blocking_p2p(pg, rounds, n):
    """Blocking send/recv make no Work and hold no array (Note [Synchronous point-to-point]):
    the caller's stream orders the transfer before whatever reuses the memory. Rank 0 sends
    a fresh tensor each round and drops it at once, then fills new tensors of its size (the
    caching allocator hands the freed block out again); rank 1 receives each and checks it."""
    import gc
    import weakref
    import torch
    bad, held, returned = [], 0, []
    buf = torch.empty(n, device="cuda")
    for i in range(rounds):
        want = np.random.default_rng(100 + i).standard_normal(n).astype(np.float32)
        if pg.rank == 0:
            t = torch.from_numpy(want).cuda()
            returned.append(pg.send(t, 1))
            alive = weakref.ref(t)
            del t
            gc.collect()
            held += alive() is not None
            for _ in range(3):
                torch.full((n,), -7.0, device="cuda")
        else:
            got = pg.recv(buf, 0)
            returned.append(got is buf)
            if not np.array_equal(got.cpu().numpy(), want):
                bad.append(i)
    torch.cuda.synchronize()
    return bad, held, returned


@needs_torch
@gpus(2)
def test_blocking_send_recv_make_no_work_and_hold_nothing():
    sent, got = run_nccl(2, _blocking_p2p, rounds=20, n=(1 << 20) + 5)
    assert sent[1] == 0 and sent[2] == [None] * 20, sent[1:]
    assert got[0] == [] and got[2] == [True] * 20, got

def _subgroups(pg):
    import torch
    r, w = pg.rank, pg.size
    out = {}
    first = pg.new_group(list(range(w - 1)))  # everyone but the last rank
    if first.is_member:
        x = torch.full((5,), float(r + 1), device="cuda")
        first.all_reduce(x)
        out["new_group"] = float(x[0])
        out["new_group_ranks"] = first.ranks
        inner = first.new_group([0])  # nested: a group of one
        if inner.is_member:
            y = torch.ones(3, device="cuda")
            inner.all_reduce(y)
            out["nested"] = float(y[0])
    else:
        out["new_group"] = None
    half = pg.split(color=r % 2, key=-r)  # reversed order within each color
    x = torch.full((7,), float(r), device="cuda")
    half.all_reduce(x)
    out["split"] = (float(x[0]), half.rank, half.ranks)
    none = pg.split(color=None if r == 0 else 1)
    out["split_none"] = none.is_member
    x = torch.full((2,), 1.0, device="cuda")
    pg.all_reduce(x)  # the parent still works after the splits
    out["parent"] = float(x[0])
    torch.cuda.synchronize()
    return out


@needs_torch
@gpus(2)
@pytest.mark.parametrize("split", ["ncclCommSplit", "store"])
def test_subgroups(split):
    world = 4 if NGPU >= 4 else 2
    if split == "ncclCommSplit" and not _C.nccl_split_supported():
        pytest.skip("the loaded NCCL has no ncclCommSplit")
    env = {"MESHCOLL_NCCL_SPLIT": "1" if split == "ncclCommSplit" else "0"}
    res = run_nccl(world, _subgroups, env=env)
    for r, o in enumerate(res):
        if r < world - 1:
            assert o["new_group"] == sum(k + 1 for k in range(world - 1))
            assert o["new_group_ranks"] == list(range(world - 1))
            if r == 0:
                assert o["nested"] == 1.0
        else:
            assert o["new_group"] is None
        same = [k for k in range(world) if k % 2 == r % 2]
        val, rank_in, ranks = o["split"]
        assert val == sum(same)
        assert ranks == sorted(same, reverse=True) and rank_in == ranks.index(r)
        assert o["split_none"] == (r != 0)
        assert o["parent"] == world


def _cpu_group_beside(pg):
    """An NCCL world with a CPU group (new_group(backend="cpu")) for control data, and back:
    an NCCL group of that CPU group (device= this rank's GPU); all three used."""
    import torch
    r, w = pg.rank, pg.size
    ctl = pg.new_group(list(range(w)), backend="cpu", name="control")
    gpu = ctl.new_group(list(range(w)), backend="nccl", device=pg.device)
    vals = [_data(21, k, 300, "float32") for k in range(w)]
    want = _reduce(vals, "sum", "float32")
    x = _tensor(vals[r], "float32")
    pg.all_reduce(x)
    host = vals[r].astype(np.float32)
    ctl.all_reduce(host)
    y = _tensor(vals[r], "float32")
    gpu.all_reduce(y, op="max")
    torch.cuda.synchronize()
    fails = []
    _close(x, want, "float32", "NCCL world all_reduce", fails)
    if not np.allclose(host, want, rtol=1e-5, atol=1e-5):
        fails.append(f"CPU group all_reduce: {host[:4]} vs {want[:4]}")
    _close(y, _reduce(vals, "max", "float32"), "float32", "NCCL group of the CPU group", fails)
    return fails, [pg.backend_name, ctl.backend_name, gpu.backend_name, gpu.device]


@needs_torch
@gpus(2)
@pytest.mark.timeout(240)
def test_cpu_group_beside_an_nccl_world():
    res = run_nccl(2, _cpu_group_beside)
    for r, (fails, kinds) in enumerate(res):
        assert fails == [], (r, fails)
        assert kinds == ["nccl", "cpu", "nccl", r], (r, kinds)


def _async_streams(pg):
    import torch
    r = pg.rank
    n = 1 << 16
    x = torch.full((n,), float(r + 1), device="cuda")
    pg.all_reduce(torch.zeros(n, device="cuda"), async_op=True).synchronize()  # connect first
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the caller's stream
    t0 = time.perf_counter()
    w = pg.all_reduce(x, async_op=True)
    w.wait()  # the caller's stream waits for the op: no host block
    host = time.perf_counter() - t0
    pending = not w.is_completed()
    y = x * 2  # ordered after the all_reduce by wait()
    w.synchronize(timeout=30)
    done = w.is_completed()
    torch.cuda.synchronize()
    want = pg.size * (pg.size + 1) / 2
    # explicit stream=: the op runs on a side stream
    s = torch.cuda.Stream()
    z = torch.full((n,), 2.0, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        pg.all_reduce(z, stream=s)
        zz = z + 1
    s.synchronize()
    return dict(host=host, pending=pending, done=done, x_ok=bool((x == want).all()),
                y_ok=bool((y == 2 * want).all()), z_ok=bool((zz == 2.0 * pg.size + 1).all()))


def _host_timers(pg, calls):
    import torch
    from meshcoll import _C
    torch.manual_seed(0)  # the same x on every rank
    x = torch.randn(4, device="cuda")
    want = x.clone()
    out = torch.empty(pg.size, 4, device="cuda")
    _C.host_timers(reset=True)  # what setup made
    for _ in range(calls):
        pg.all_reduce(x)
        pg.all_gather(x, out=out)
        x.div_(pg.size)  # sums of equal inputs: x stays what it was
    torch.cuda.synchronize()
    return _C.host_timers(reset=True), bool(torch.allclose(x, want))


@needs_torch
@gpus(2)
def test_host_timers_time_the_nccl_steps():
    # Note [Host timers] on NCCL: every fast-path call passes each step once, the NCCL
    # steps included. Equal inputs on both ranks keep x a fixed point of sum / size.
    env = {"MESHCOLL_HOST_TIMERS": "1"}
    for rows, same in run_nccl(2, _host_timers, calls=50, env=env):
        assert same
        steps = {step: (n, us) for step, n, us in rows}
        assert list(steps) == ["read arguments and arrays", "shared checks (Backend)",
                               "window tag, ledger, agreement note",
                               "lock", "context, capture query",
                               "slot (waits while the ring of slots is full)", "NCCL call",
                               "completion event", "to the return"], rows
        assert all(n == 100 and us > 0 for n, us in steps.values()), rows


@needs_torch
@gpus(2)
def test_async_op_wait_orders_the_stream_without_blocking():
    for o in run_nccl(2, _async_streams):
        assert o["host"] < 0.05, f"wait() blocked the host for {o['host']:.3f} s"
        assert o["pending"], "the op completed before the caller's sleeping stream released it"
        assert o["done"] and o["x_ok"] and o["y_ok"] and o["z_ok"], o


def _graph(pg):
    import torch
    x = torch.zeros(1024, device="cuda")
    pg.all_reduce(x)  # warm up: connections are made outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pg.all_reduce(x)  # on the capture stream (torch's current stream)
        x.mul_(2)
    ok = []
    for i in range(3):
        x.fill_(pg.rank + i)
        g.replay()
        torch.cuda.synchronize()
        want = 2 * sum(k + i for k in range(pg.size))
        ok.append(bool((x == want).all()))
    return ok


@needs_torch
@gpus(2)
def test_cuda_graph_capture():
    for ok in run_nccl(2, _graph):
        assert all(ok), ok


def _killed(pg):
    import torch
    x = torch.ones(1 << 10, device="cuda")
    pg.all_reduce(x)
    torch.cuda.synchronize()
    if pg.rank == 1:
        os._exit(3)  # dies without a word
    time.sleep(1.0)
    t0 = time.monotonic()
    try:  # the side channel may have found the death already: then the call raises
        w = pg.all_reduce(x, async_op=True)
        w.synchronize(timeout=60)
        kind = "no error"
    except (meshcoll.TimeoutError, meshcoll.PeerError) as e:
        kind = type(e).__name__
    took = time.monotonic() - t0
    try:
        pg.all_reduce(x)
        after = "no error"
    except (meshcoll.TimeoutError, meshcoll.PeerError) as e:
        after = type(e).__name__  # the failure's own type (Note [NCCL failure model])
    return kind, took, after


def _jax(pg):
    import jax
    import jax.numpy as jnp
    import torch
    base = jnp.arange(1024, dtype=jnp.float32) + pg.rank
    # JAX numbers its GPUs its own way: take the one that is this rank's CUDA device.
    x = next(y for y in (jax.device_put(base, d) for d in jax.devices() if d.platform == "gpu")
             if y.__dlpack_device__()[1] == pg.device)
    before = np.asarray(x).copy()
    said = {}
    for label, call in (("all_reduce", lambda: pg.all_reduce(x)),
                        ("all_reduce async", lambda: pg.all_reduce(x, async_op=True)),
                        ("broadcast", lambda: pg.broadcast(x, 0)),
                        ("all_gather", lambda: pg.all_gather(x))):
        try:
            call()
            said[label] = "no error"
        except (ValueError, TypeError) as e:
            said[label] = "immutable" in str(e) and "from_dlpack" in str(e)
    torch.cuda.synchronize()
    return said, bool(np.array_equal(np.asarray(x), before))


@needs_torch
@gpus(2)
def test_jax_arrays_are_never_written():
    """Issue 16 item 3 (Note [Immutable arrays] in csrc/python/array.cc): JAX arrays are
    immutable; an op that would write into one raises saying what to pass, on every rank,
    and the array keeps its values."""
    pytest.importorskip("jax")
    res = run_nccl(2, _jax, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    for said, unchanged in res:
        assert all(v is True for v in said.values()), said
        assert unchanged


@needs_torch
@gpus(2)
def test_killed_rank_becomes_an_error_not_a_hang():
    res = run_nccl(2, _killed, timeout=5.0, may_die=(1,), deadline=120)
    kind, took, after = res[0]
    assert kind in ("TimeoutError", "PeerError"), kind
    assert took < 30, f"the failure took {took:.1f} s to surface"
    assert after in ("TimeoutError", "PeerError"), after


def _cupy(pg):
    import cupy
    with cupy.cuda.Device(pg.device):
        x = cupy.full(33, pg.rank + 1, dtype=cupy.float32)
        pg.all_reduce(x)
        y = pg.all_gather(cupy.arange(4, dtype=cupy.int32) + pg.rank)
        cupy.cuda.Device().synchronize()
        return (float(x[0]), type(y).__module__, cupy.asnumpy(y).tolist())


@needs_gpu
@gpus(2)
def test_cupy_arrays():
    pytest.importorskip("cupy")
    for x0, mod, y in run_nccl(2, _cupy):
        assert x0 == 3.0 and mod.startswith("cupy")
        assert y == [[0, 1, 2, 3], [1, 2, 3, 4]]


@needs_torch
def test_device_array_protocols():
    """The boundary reads PyTorch (fast path), DLPack-only and interface-only objects alike."""
    t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)

    class OnlyDLPack:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    class OnlyCAI:
        def __init__(self, t):
            self.__cuda_array_interface__ = t.__cuda_array_interface__

    for obj in (t, OnlyDLPack(t), OnlyCAI(t)):
        a = _C.read_array(obj, "test", True, True)
        assert (a.ptr, a.size, a.shape, a.dtype, a.ndim) == (t.data_ptr(), 12, (3, 4), "float32", 2)
    b = _C.read_array(OnlyDLPack(t.to(torch.bfloat16)), "test", True, True)
    assert b.dtype == "bfloat16"
    with pytest.raises(ValueError, match="contiguous"):
        _C.read_array(t.t(), "test", True, True)
    with pytest.raises(TypeError, match="CPU|host"):
        _C.read_array(torch.ones(3), "test", True, True)
    with pytest.raises(TypeError, match="host"):
        _C.read_array(np.ones(3), "test", True, True)
    s = torch.cuda.Stream()
    assert _C.read_array(t, "test", True, True, s).stream == s.cuda_stream
    # torch tensors, subclasses too, through DLPack's C exchange API where torch has it
    # (2.10+), else torch's methods: both see torch's current stream when no stream= is given.
    class Sub(torch.Tensor):
        pass
    fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    assert _C._array_reader(t) == _C._array_reader(t.as_subclass(Sub)) == \
        ("dlpack exchange" if fast else "torch")
    for obj in (t, t.as_subclass(Sub)):
        with torch.cuda.stream(s):
            assert _C.read_array(obj, "test", True, True).stream == s.cuda_stream
        a = _C.read_array(obj, "test", True, True)
        assert (a.ptr, a.shape, a.dtype) == (t.data_ptr(), (3, 4), "float32")
        with pytest.raises(ValueError, match="resolve_neg"):
            _C.read_array(torch._neg_view(obj), "test", True, True)


def _bad_calls(pg):
    import torch
    errors = []
    x = torch.ones(4, device="cuda")
    for call in (lambda: pg.broadcast(x, src=pg.size),
                 lambda: pg.all_reduce(torch.ones(4, dtype=torch.bool, device="cuda")),
                 lambda: pg.all_reduce(x, op="band"),
                 lambda: pg.all_reduce(x, algorithm="ring"),
                 lambda: pg.send(x, (pg.rank + 1) % pg.size, tag=5),
                 lambda: pg.all_reduce(np.ones(3)),
                 lambda: pg.all_reduce(torch.ones(4, device=f"cuda:{(pg.device + 1) % 2}")),
                 lambda: pg.all_reduce(x, timeout=0),  # timeouts: the one check, on NCCL too
                 lambda: pg.all_reduce(x, timeout=1e10, async_op=True),
                 lambda: pg.new_group([0, 1], timeout=-1)):
        try:
            call()
            errors.append("no error")
        except (ValueError, TypeError) as e:
            errors.append(type(e).__name__)
    pg.all_reduce(x)  # the group is still fine
    torch.cuda.synchronize()
    errors.append(float(x[0]))
    return errors


@needs_torch
@gpus(2)
def test_bad_arguments_raise_and_leave_the_group_usable():
    for errs in run_nccl(2, _bad_calls):
        assert "no error" not in errs[:-1], errs
        assert errs[-1] == 2.0


# ---- the contract's guarantees on GPUs (csrc/comm/backend.h) -------------------------------

def _dropped_async(pg):
    """Rank 0 issues async all_reduces of tensors it drops at once, with their Work; torch's
    caching allocator hands each freed block to the next tensor of that size, a canary. Rank
    1 joins late. The op holds its tensor until it completes (Note [Owners] in
    csrc/python/array.h), so no canary is written."""
    import torch
    n = 1 << 18
    damaged = 0
    for _ in range(3):
        if pg.rank == 0:
            pg.all_reduce(torch.randn(n, device="cuda"), async_op=True)
            canary = torch.full((n,), 7.0, device="cuda")
            pg.barrier(timeout=30)
            torch.cuda.synchronize()
            damaged += int((canary != 7.0).sum())
        else:
            time.sleep(0.3)
            pg.all_reduce(torch.randn(n, device="cuda"))
            pg.barrier(timeout=30)
    x = torch.full((4,), pg.rank + 1.0, device="cuda")
    pg.all_reduce(x)
    torch.cuda.synchronize()
    return damaged, x.tolist()


@needs_torch
@gpus(2)
def test_dropped_async_tensor_is_not_written_after_free():
    for damaged, x in run_nccl(2, _dropped_async):
        assert damaged == 0, f"{damaged} canary elements overwritten"
        assert x == [3.0] * 4


def _two_threads(pg):
    """Two groups of the same ranks, each driven by its own thread on its own stream."""
    import threading

    import torch
    g1 = pg.new_group(list(range(pg.size)))
    g2 = pg.new_group(list(range(pg.size)))
    errors = []

    def loop(g, seed):
        with torch.cuda.device(pg.device):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for i in range(50):
                    x = torch.full((4099,), float(pg.rank + i + seed), device="cuda")
                    if seed:
                        out = g.all_gather(x, timeout=30)
                        want = torch.stack([torch.full((4099,), float(r + i + seed), device="cuda")
                                            for r in range(pg.size)])
                        ok = bool((out == want).all())
                    else:
                        g.all_reduce(x, timeout=30)
                        ok = bool((x == sum(r + i for r in range(pg.size))).all())
                    if not ok:
                        errors.append(f"{'all_gather' if seed else 'all_reduce'} {i} wrong")

    threads = [threading.Thread(target=loop, args=(g, seed)) for g, seed in ((g1, 0), (g2, 100))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


@needs_torch
@gpus(2)
def test_two_threads_two_groups_two_streams():
    for errors in run_nccl(2, _two_threads):
        assert not errors, errors


def _bad_sizes(pg):
    import torch
    x = torch.ones(8, device="cuda")
    wrong = []
    for label, call, cls in (
            ("all_gather out too big", lambda: pg.all_gather(x, out=torch.empty(8 * pg.size + 1, device="cuda")), ValueError),
            ("reduce_scatter out too small", lambda: pg.reduce_scatter(x, out=torch.empty(1, device="cuda")), ValueError),
            ("scatter out larger than the block", lambda: pg.scatter(torch.ones(pg.size, 3, device="cuda"), 0, out=torch.empty(4, device="cuda")), ValueError),
            ("out dtype", lambda: pg.all_gather(x, out=torch.empty(8 * pg.size, device="cuda", dtype=torch.float16)), TypeError)):
        try:
            call()
            wrong.append(f"{label}: no error")
        except cls:
            pass
        except Exception as e:  # noqa: BLE001
            wrong.append(f"{label}: {type(e).__name__}: {e}")
    pg.all_reduce(x)
    torch.cuda.synchronize()
    return wrong, float(x[0])


@needs_torch
@gpus(2)
def test_out_sizes_checked_before_launch():
    for wrong, v in run_nccl(2, _bad_sizes):
        assert not wrong, wrong
        assert v == 2.0


_EXIT_WITHOUT_DESTROY = """
import os, torch, meshcoll
rank = int(os.environ["MESHCOLL_RANK"])
torch.cuda.set_device(rank)
pg = meshcoll.init(backend="nccl", device=rank)
x = torch.full((1024,), float(rank + 1), device="cuda")
pg.all_reduce(x)
torch.cuda.synchronize()
assert x[0].item() == pg.size * (pg.size + 1) / 2
# every rank ends without destroy(): a rank's agreement thread sees its peers leave while
# its process exits, when the CUDA driver may be gone already
"""


@needs_torch
@gpus(2)
@pytest.mark.timeout(120)
def test_ranks_that_exit_without_destroy_exit_cleanly(tmp_path):
    # A peer that leaves is seen by the agreement thread, which fails the group; at exit that
    # met a deinitialised driver and threw on its own thread: std::terminate, SIGABRT (seen
    # on 3 of 4 ranks of a script that never called destroy()).
    import subprocess
    import sys
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_WITHOUT_DESTROY)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    for _ in range(2):
        p = subprocess.run([sys.executable, "-m", "meshcoll.run", "-n", "2", str(script)],
                           env=env, capture_output=True, text=True, timeout=100)
        out = p.stdout + p.stderr
        assert p.returncode == 0 and "terminate" not in out, out[-3000:]
