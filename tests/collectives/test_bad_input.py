"""Bad arguments raise the builtin a user would catch (ValueError, TypeError), before anything
is queued, and leave the group usable: the next collective still works on every rank."""

import numpy as np
import pytest

import meshcoll


def readonly(a):
    a = np.array(a)
    a.setflags(write=False)
    return a


def bad_calls(pg):
    """(label, thunk, exception class, text the message must contain). Every rank makes the
    same calls, so none of them may desynchronise the group."""
    n = pg.size
    f = np.zeros(8, np.float32)
    strided = np.zeros(16, np.float32)[::2]
    fortran = np.zeros((3, 4), np.float32, order="F")
    calls = []

    # Non-contiguous arrays: ValueError, for every entry point that takes one.
    for name, fn in [
        ("all_reduce", lambda x: pg.all_reduce(x)),
        ("reduce", lambda x: pg.reduce(x, 0)),
        ("broadcast", lambda x: pg.broadcast(x, 0)),
        ("all_gather", lambda x: pg.all_gather(x)),
        ("all_gather_v", lambda x: pg.all_gather_v(x)),
        ("gather", lambda x: pg.gather(x, 0)),
        ("send", lambda x: pg.send(x, (pg.rank + 1) % n)),
        ("recv", lambda x: pg.recv(x, (pg.rank + 1) % n)),
    ]:
        calls.append((f"{name} strided", lambda fn=fn: fn(strided), ValueError, "contiguous"))
        calls.append((f"{name} fortran", lambda fn=fn: fn(fortran), ValueError, "contiguous"))
    calls += [
        ("reduce_scatter strided", lambda: pg.reduce_scatter(np.zeros((2 * n, 4))[:, ::2]),
         ValueError, "contiguous"),
        ("all_to_all strided", lambda: pg.all_to_all(np.zeros((2 * n, 4))[:, ::2]),
         ValueError, "contiguous"),
        ("scatter strided", lambda: pg.scatter(np.zeros((n, 4))[:, ::2], 0),
         ValueError, "contiguous"),
        ("all_gather out strided",
         lambda: pg.all_gather(f, out=np.zeros((n, 16), np.float32)[:, ::2]),
         ValueError, "contiguous"),
    ]

    # Read-only arrays where the result is written: ValueError.
    calls += [
        ("all_reduce read-only", lambda: pg.all_reduce(readonly(f)), ValueError, "read-only"),
        ("all_reduce async read-only", lambda: pg.all_reduce(readonly(f), async_op=True),
         ValueError, "read-only"),
        ("all_reduce bytes", lambda: pg.all_reduce(b"\0" * 8), ValueError, "read-only"),
        ("reduce read-only", lambda: pg.reduce(readonly(f), 0), ValueError, "read-only"),
        ("broadcast read-only", lambda: pg.broadcast(readonly(f), 0), ValueError, "read-only"),
        ("recv read-only", lambda: pg.recv(readonly(f), (pg.rank + 1) % n), ValueError,
         "read-only"),
        ("all_gather out read-only",
         lambda: pg.all_gather(f, out=readonly(np.zeros((n, 8), np.float32))),
         ValueError, "read-only"),
        ("reduce_scatter out read-only",
         lambda: pg.reduce_scatter(np.zeros(n * 2, np.float32),
                                   out=readonly(np.zeros(2, np.float32))),
         ValueError, "read-only"),
    ]

    # Dtypes the core does not carry: TypeError naming the dtype.
    for dt in ["complex64", "complex128", "int16", "uint32", "longdouble"]:
        calls.append((f"all_reduce {dt}", lambda dt=dt: pg.all_reduce(np.zeros(4, dt)),
                      TypeError, np.dtype(dt).name))
        calls.append((f"broadcast {dt}", lambda dt=dt: pg.broadcast(np.zeros(4, dt), 0),
                      TypeError, np.dtype(dt).name))
    obj = np.array([1, None, "x"], dtype=object)
    calls += [
        ("all_reduce object", lambda: pg.all_reduce(obj), TypeError, "object"),
        ("broadcast object", lambda: pg.broadcast(obj, 0), TypeError, "object"),
        ("all_gather object", lambda: pg.all_gather(obj), TypeError, "object"),
        ("send object", lambda: pg.send(obj, (pg.rank + 1) % n), TypeError, "object"),
        ("all_reduce list", lambda: pg.all_reduce([1.0, 2.0]), TypeError, "list"),
        ("all_reduce int", lambda: pg.all_reduce(3), TypeError, "int"),
        ("all_gather out dtype", lambda: pg.all_gather(f, out=np.zeros((n, 8), np.float64)),
         TypeError, "float64"),
    ]

    # Roots and peers out of range: ValueError naming the bad value.
    for bad in (n, -1, n + 5):
        calls += [
            (f"reduce dst={bad}", lambda b=bad: pg.reduce(np.zeros(4), b), ValueError, str(bad)),
            (f"broadcast src={bad}", lambda b=bad: pg.broadcast(np.zeros(4), b), ValueError,
             str(bad)),
            (f"gather dst={bad}", lambda b=bad: pg.gather(np.zeros(4), b), ValueError, str(bad)),
            (f"scatter src={bad}", lambda b=bad: pg.scatter(np.zeros((n, 4)), b), ValueError,
             str(bad)),
            (f"send peer={bad}", lambda b=bad: pg.send(np.zeros(4), b), ValueError, str(bad)),
            (f"recv peer={bad}", lambda b=bad: pg.recv(np.zeros(4), b), ValueError, str(bad)),
        ]
    calls += [
        ("send to self", lambda: pg.send(np.zeros(4), pg.rank), ValueError, "itself"),
        ("recv from self", lambda: pg.irecv(np.zeros(4), pg.rank), ValueError, "itself"),
        ("send tag -1", lambda: pg.send(np.zeros(4), (pg.rank + 1) % n, tag=-1), ValueError,
         "tag"),
        ("send tag 2**32", lambda: pg.send(np.zeros(4), (pg.rank + 1) % n, tag=2**32),
         ValueError, "tag"),
    ]

    # Shapes that do not split: ValueError.
    calls += [
        ("reduce_scatter 0-d", lambda: pg.reduce_scatter(np.zeros((), np.float32)), ValueError,
         "0-d"),
        ("all_to_all 0-d", lambda: pg.all_to_all(np.zeros((), np.float32)), ValueError, "0-d"),
        ("reduce_scatter out shape", lambda: pg.reduce_scatter(np.zeros(2 * n), out=np.zeros(3)),
         ValueError, "out"),
        ("all_gather out shape", lambda: pg.all_gather(f, out=np.zeros((n, 9), np.float32)),
         ValueError, "out"),
        ("reduce_scatter_v counts length",
         lambda: pg.reduce_scatter_v(np.zeros(4), [4] + [0] * n), ValueError, "counts"),
        ("reduce_scatter_v counts sum",
         lambda: pg.reduce_scatter_v(np.zeros(4), [5] + [0] * (n - 1)),
         ValueError, "counts"),
        ("reduce_scatter_v negative",
         lambda: pg.reduce_scatter_v(np.zeros(4), [5, -1] + [0] * (n - 2) if n > 1 else [-1]),
         ValueError, "counts"),
        ("all_to_all_v counts sum", lambda: pg.all_to_all_v(np.zeros(4), [3] + [0] * (n - 1)),
         ValueError, "send_counts"),
        ("all_to_all out aliasing", lambda: pg.all_to_all(f, out=f), ValueError, "out"),
        ("scatter wrong rows", lambda: pg.scatter(np.zeros((n + 1, 2)), 0), ValueError, "shape"),
        # The C++ entry points make out only for a numpy x (Note [Synchronous gathers]).
        ("all_gather_sync out=None, not numpy",
         lambda: pg._backend.all_gather_sync(bytearray(8), None, None, None), TypeError,
         "out=None is for a numpy x"),
        ("reduce_scatter_sync out=None, not numpy",
         lambda: pg._backend.reduce_scatter_sync(bytearray(8 * n), None, "sum", None, None),
         TypeError, "out=None is for a numpy x"),
    ]
    if n > 1:  # with one rank every length divides evenly
        calls += [
            ("reduce_scatter not divisible", lambda: pg.reduce_scatter(np.zeros(2 * n + 1)),
             ValueError, "divisible"),
            ("all_to_all not divisible", lambda: pg.all_to_all(np.zeros((2 * n + 1, 3))),
             ValueError, "divisible"),
        ]

    # Unknown reduction ops and algorithms, and other bad settings: ValueError.
    for op in ("add", "SUM", "", "mean"):
        calls += [
            (f"all_reduce op={op!r}", lambda op=op: pg.all_reduce(np.zeros(4), op), ValueError,
             "unknown reduction op"),
            (f"reduce op={op!r}", lambda op=op: pg.reduce(np.zeros(4), 0, op), ValueError,
             "unknown reduction op"),
            (f"reduce_scatter op={op!r}", lambda op=op: pg.reduce_scatter(np.zeros(n), op=op),
             ValueError, "unknown reduction op"),
        ]
    for algo in ("rings", "Ring", "", "nccl"):
        calls.append((f"all_reduce algorithm={algo!r}",
                      lambda algo=algo: pg.all_reduce(np.zeros(4), algorithm=algo),
                      ValueError, "algorithm"))
        calls.append((f"CollectiveConfig algorithm={algo!r}",
                      lambda algo=algo: meshcoll.CollectiveConfig(algo), ValueError, "algorithm"))
    calls += [
        ("all_reduce timeout=-1", lambda: pg.all_reduce(np.zeros(4), timeout=-1), ValueError,
         "timeout"),
        ("all_reduce timeout=nan", lambda: pg.all_reduce(np.zeros(4), timeout=float("nan")),
         ValueError, "timeout"),
        ("broadcast timeout=inf", lambda: pg.broadcast(np.zeros(4), 0, timeout=float("inf")),
         ValueError, "timeout"),
        ("new_group timeout=-1", lambda: pg.new_group([0], timeout=-1), ValueError,
         "new_group: timeout"),
    ]
    # A timeout that is not a number: TypeError naming the call and the argument, the same
    # check for calls and for new_group / split (which once took the str "5").
    for what, call in [
        ("all_reduce", lambda t: pg.all_reduce(np.zeros(4), timeout=t)),
        ("all_reduce", lambda t: pg.all_reduce(np.zeros(4), timeout=t, async_op=True)),
        ("broadcast", lambda t: pg.broadcast(np.zeros(4), 0, timeout=t)),
        ("all_gather", lambda t: pg.all_gather(f, timeout=t)),
        ("barrier", lambda t: pg.barrier(timeout=t)),
        ("Work.wait", lambda t: pg.barrier(async_op=True).wait(timeout=t)),
        ("new_group", lambda t: pg.new_group([0], timeout=t)),
        ("split", lambda t: pg.split(0, timeout=t)),
    ]:
        for bad in ("5", [5], b"5"):
            calls.append((f"{what} timeout={bad!r}", lambda call=call, bad=bad: call(bad),
                          TypeError, f"{what}: timeout must be a number of seconds"))
    return calls


def _bad_input_body(pg):
    n, rank = pg.size, pg.rank
    wrong = []
    for label, thunk, exc, text in bad_calls(pg):
        try:
            thunk()
        except exc as e:
            if text.lower() not in str(e).lower():
                wrong.append(f"{label}: {exc.__name__} message lacks {text!r}: {e}")
        except Exception as e:  # noqa: BLE001 - report the wrong class
            wrong.append(f"{label}: raised {type(e).__name__}, not {exc.__name__}: {e}")
        else:
            wrong.append(f"{label}: no error")

    # The group still works after all of that, on every rank.
    x = np.full(1031, rank + 1, np.float32)
    pg.all_reduce(x)
    if not np.all(x == n * (n + 1) / 2):
        wrong.append(f"all_reduce after the bad calls gave {x[:4]}")
    y = np.full(5, rank, np.int64)
    pg.broadcast(y, n - 1)
    if not np.all(y == n - 1):
        wrong.append(f"broadcast after the bad calls gave {y}")
    g = pg.all_gather(np.array([rank], np.int32))
    if g.tolist() != [[r] for r in range(n)]:
        wrong.append(f"all_gather after the bad calls gave {g.tolist()}")

    # Inputs that are only read may be read-only, and writable buffers need not be numpy.
    ro = readonly(np.full((2, 3), rank, np.float64))
    if pg.all_gather(ro).tolist() != [np.full((2, 3), r).tolist() for r in range(n)]:
        wrong.append("all_gather of a read-only input")
    if not np.array_equal(pg.reduce_scatter(readonly(np.ones(2 * n, np.float32))),
                          np.full(2, n, np.float32)):
        wrong.append("reduce_scatter of a read-only input")
    buf = bytearray(np.full(4, rank + 1, np.int32).tobytes())
    pg.all_reduce(buf)
    if np.frombuffer(buf, np.int32).tolist() != [n * (n + 1) // 2] * 4:
        wrong.append(f"all_reduce of a bytearray gave {np.frombuffer(buf, np.int32)}")
    return wrong


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,transport", [(1, "tcp"), (2, "tcp"), (2, "shm")])
def test_bad_input(run_ranks, world, transport):
    wrong = [w for r in run_ranks(world, _bad_input_body, timeout=50,
                                  transport=transport) for w in r]
    assert not wrong, f"{len(wrong)} problem(s):\n" + "\n".join(wrong)


def test_init_checks_its_timeout_as_every_call_does():
    assert not meshcoll.is_initialized()
    for bad, cls in (("5", TypeError), (-1, ValueError)):
        with pytest.raises(cls, match=r"meshcoll.init: timeout must be a number of seconds"):
            meshcoll.init(rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                          timeout=bad)
        assert not meshcoll.is_initialized()


def _shm_algorithm_on_tcp_body(pg):
    out = {"transport": pg.transport}
    try:
        pg.all_reduce(np.zeros(4), algorithm="shm")
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - the class is what is checked
        out["error"] = type(e).__name__
    x = np.ones(4)
    try:
        pg.all_reduce(x)
        out["after"] = x.tolist()
    except Exception as e:  # noqa: BLE001
        out["after"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.timeout(30)
def test_shm_algorithm_on_tcp_group(run_ranks):
    for r in run_ranks(2, _shm_algorithm_on_tcp_body, transport="tcp"):
        assert r["transport"] == "tcp"
        assert r["error"] == "ValueError"
        assert r["after"] == [2.0] * 4


def _bad_v_array_then_retry(pg):
    # Rank 1's first call has a big-endian array: it must raise before the _v collective's
    # count exchange, so that its corrected retry pairs with rank 0's one call.
    rng = np.random.default_rng(7 + pg.rank)
    x = rng.standard_normal((4, 3))
    out = []
    for name, call in (("all_to_all_v", lambda a: pg.all_to_all_v(a, [2, 2])),
                       ("all_gather_v", lambda a: pg.all_gather_v(a))):
        if pg.rank == 1:
            try:
                call(x.astype(">f8"))
                out.append(f"{name}: no error")
            except TypeError:
                pass
        got, _ = call(x)
        ref = [np.random.default_rng(7 + r).standard_normal((4, 3)) for r in range(pg.size)]
        want = (np.concatenate([ref[r][2 * pg.rank:2 * pg.rank + 2] for r in range(pg.size)])
                if name == "all_to_all_v" else np.concatenate(ref))
        out.append(f"{name}: {np.array_equal(got, want)}")
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_bad_v_array_raises_before_the_count_exchange(run_ranks, transport):
    res = run_ranks(2, _bad_v_array_then_retry, transport=transport)
    assert res == [["all_to_all_v: True", "all_gather_v: True"]] * 2, res


def _buffer_outputs(pg):
    """bytearray, memoryview and array.array inputs to the collectives that make their output:
    the output is a numpy array of the buffer's format, with numpy's values."""
    import array
    n, r = pg.size, pg.rank
    k = 2 * n
    ref = [np.arange(k, dtype=np.int32) + 100 * q for q in range(n)]  # rank q's x
    makers = {
        "bytearray": lambda a: bytearray(a.astype(np.uint8).tobytes()),
        "memoryview": lambda a: memoryview(bytearray(a.tobytes())).cast("i"),
        "array.array": lambda a: array.array("i", a.tolist()),
    }
    wrong = []
    for kind, make in makers.items():
        dt = np.uint8 if kind == "bytearray" else np.int32
        mine, refs = make(ref[r]), [a.astype(dt) for a in ref]
        blk = k // n
        total = sum(refs)
        cases = [
            ("all_gather", lambda: pg.all_gather(mine), np.stack(refs)),
            ("all_gather async", lambda: pg.all_gather(mine, async_op=True).wait(),
             np.stack(refs)),
            ("all_gather_v", lambda: pg.all_gather_v(mine)[0], np.concatenate(refs)),
            ("reduce_scatter", lambda: pg.reduce_scatter(mine), total[r * blk:(r + 1) * blk]),
            ("reduce_scatter_v", lambda: pg.reduce_scatter_v(mine, [blk] * n),
             total[r * blk:(r + 1) * blk]),
            ("all_to_all", lambda: pg.all_to_all(mine),
             np.concatenate([a[r * blk:(r + 1) * blk] for a in refs])),
            ("all_to_all_v", lambda: pg.all_to_all_v(mine, [blk] * n)[0],
             np.concatenate([a[r * blk:(r + 1) * blk] for a in refs])),
            ("gather", lambda: pg.gather(mine, 0), np.stack(refs) if r == 0 else None),
            # Every rank passes x of the full shape: a 1-d buffer's rows are 0-d blocks.
            ("scatter", lambda: pg.scatter(make(ref[0][:n]), 0), refs[0][r]),
        ]
        for name, call, want in cases:
            try:
                got = call()
            except Exception as e:  # noqa: BLE001 - report the class
                wrong.append(f"{kind} {name}: {type(e).__name__}: {e}")
                continue
            if want is None:
                ok = got is None
            else:
                ok = (type(got) is np.ndarray and got.dtype == dt
                      and np.array_equal(got, want) and got.shape == np.shape(want))
            if not ok:
                wrong.append(f"{kind} {name}: got {got!r}, want {want!r}")
    return wrong


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,transport", [(2, "tcp"), (3, "shm")])
def test_buffer_protocol_inputs_get_numpy_outputs(run_ranks, world, transport):
    wrong = [w for r in run_ranks(world, _buffer_outputs, transport=transport) for w in r]
    assert not wrong, f"{len(wrong)} problem(s):\n" + "\n".join(wrong)


def test_collective_config_selects_what_it_was_given_and_round_trips():
    """An explicit algorithm is the selection at every size (it once answered 'direct' for a
    ring config at 100 bytes); auto picks by size; to_dict/from_dict give the same config."""
    for algo in ("ring", "tree", "direct", "halving_doubling"):
        if algo not in meshcoll._C.algorithm_names():
            continue
        cfg = meshcoll.CollectiveConfig(algo)
        assert [cfg.select_all_reduce(n, 4) for n in (100, 1 << 20, 64 << 20)] == [algo] * 3
    auto = meshcoll.CollectiveConfig()
    assert auto.select_all_reduce(100, 4) != auto.select_all_reduce(64 << 20, 4)
    cfg = meshcoll.CollectiveConfig("ring", tree_threshold_bytes=1024, max_segment_bytes=4096)
    again = meshcoll.CollectiveConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict() == {
        "algorithm": "ring", "tree_threshold_bytes": 1024, "hd_threshold_bytes": 8 << 20,
        "max_segment_bytes": 4096, "tree_arity": "binomial", "reduce_algorithm": "auto",
        "broadcast_algorithm": "auto", "local_all_reduce": "auto", "global_all_reduce": "auto",
        "local_broadcast": "auto", "global_broadcast": "auto"}
    assert "algorithm='ring'" in repr(again)
    with pytest.raises(ValueError, match="unknown keys"):
        meshcoll.CollectiveConfig.from_dict({"algorithm": "ring", "arity": 3})
    with pytest.raises(ValueError, match="algorithm"):
        meshcoll.CollectiveConfig.from_dict({"algorithm": "rign"})
