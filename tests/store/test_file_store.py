"""The file store: every call across real processes, timeouts, atomic add, cleanup of the
file by its last user, garbage files and bad paths."""

import gc
import multiprocessing as mp
import os
import re
import threading
import time

import pytest

import meshcoll
from conftest import spawn
from meshcoll import _C

FileStore = _C.FileStore


# Process bodies (module level: spawn pickles them by name). Each store is a local, so it
# is closed when the body returns.

def _exchange(rank, path, n):
    store = FileStore(path, 10)
    mine = os.urandom(1000 + 37 * rank) + b"\x00\xff"  # every byte value may appear
    store.set(f"rank{rank}", mine)
    return mine, [store.get(f"rank{r}") for r in range(n)]


def _adder(rank, path, count):
    store = FileStore(path, 10)
    store.add("joined", 1)
    store.wait(["go"])  # all four start together, so the adds contend
    return [store.add("counter", 1) for _ in range(count)]


@pytest.mark.timeout(30)
def test_set_get_binary_across_processes(tmp_path):
    path = str(tmp_path / "store")
    parent = FileStore(path, 10)  # a user throughout: the file lives until it closes
    out = spawn(3, _exchange, path, 3, timeout=20)
    for mine, seen in out:
        assert seen == [m for m, _ in out]
        assert mine[-2:] == b"\x00\xff"
    for r, (mine, _) in enumerate(out):
        assert parent.get(f"rank{r}") == mine
    assert parent.num_keys() == 3
    assert os.path.exists(path)  # the children closed, the parent still uses it
    del parent
    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.timeout(30)
def test_concurrent_adds_are_atomic(tmp_path):
    path = str(tmp_path / "store")
    parent = FileStore(path, 10)
    results = []
    t = threading.Thread(target=lambda: results.append(spawn(4, _adder, path, 200, timeout=20)))
    t.start()
    deadline = time.monotonic() + 20
    while parent.add("joined", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    parent.set("go", b"1")
    t.join(25)
    assert results, "the adders did not finish"
    seen = sorted(v for per_proc in results[0] for v in per_proc)
    assert seen == list(range(1, 801))  # every add saw a distinct count
    assert parent.get("counter") == b"800"
    assert parent.add("counter", 0) == 800


@pytest.mark.timeout(20)
def test_threads_and_stores_of_one_process_serialise(tmp_path):
    path = str(tmp_path / "store")
    stores = [FileStore(path, 10) for _ in range(2)]  # POSIX locks don't separate these

    def work(s):
        for _ in range(300):
            s.add("n", 1)

    threads = [threading.Thread(target=work, args=(stores[i % 2],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert stores[0].add("n", 0) == 1200


@pytest.mark.timeout(10)
def test_get_of_missing_key_times_out(tmp_path):
    path = str(tmp_path / "store")
    s = FileStore(path, 0.4)
    t0 = time.monotonic()
    with pytest.raises(meshcoll.TimeoutError, match=re.escape(path)) as e:
        s.get("never-set")
    assert 0.4 <= time.monotonic() - t0 < 1.4
    assert "never-set" in str(e.value) and "400 ms" in str(e.value)
    assert isinstance(e.value, TimeoutError)  # the builtin too
    t0 = time.monotonic()
    s.set("here", b"1")
    with pytest.raises(meshcoll.TimeoutError, match=r"wait\(here, gone\).*not set: gone"):
        s.wait(["here", "gone"], timeout=0.2)
    with pytest.raises(meshcoll.TimeoutError):
        s.get("gone", timeout=0)
    assert time.monotonic() - t0 < 1.2


@pytest.mark.timeout(10)
def test_compare_set(tmp_path):
    s = FileStore(tmp_path / "store", 5)  # a pathlib.Path works too
    assert s.compare_set("k", b"", b"first") == b"first"       # absent + empty expected: set
    assert s.compare_set("k", b"wrong", b"x") == b"first"      # mismatch: unchanged
    assert s.compare_set("k", b"first", b"second") == b"second"  # match: set
    assert s.compare_set("absent", b"something", b"x") == b""  # absent + non-empty: unchanged
    assert not s.check(["absent"])
    assert s.get("k") == b"second"


@pytest.mark.timeout(10)
def test_wait_check_delete_num_keys(tmp_path):
    path = str(tmp_path / "store")
    a, b = FileStore(path, 5), FileStore(path, 5)
    assert a.path == path and a.timeout == 5.0
    assert FileStore(path).timeout == 300.0
    assert a.num_keys() == 0  # the users count is not a key
    threading.Timer(0.3, lambda: b.set("late", "text")).start()
    t0 = time.monotonic()
    a.wait(["late"], timeout=5)
    assert 0.2 < time.monotonic() - t0 < 3
    assert a.get("late") == b"text"
    a.set("other", b"")
    assert a.check(["late", "other"]) and not a.check(["late", "missing"])
    assert b.num_keys() == 2
    assert b.delete_key("late") is True
    assert a.delete_key("late") is False
    assert not a.check(["late"])
    assert a.num_keys() == 1
    assert a.add("other", 7) == 7  # an empty value counts as 0, as in the TCP store
    a.set("text", b"abc")
    with pytest.raises(ValueError, match="add.*text.*not a decimal"):
        a.add("text", 1)
    with pytest.raises(ValueError, match="reserved"):
        a.set("__meshcoll_file_store_users__", b"0")
    p = meshcoll.PrefixStore("g", a)
    p.set("x", b"1")
    assert b.get("g/x") == b"1"


@pytest.mark.timeout(10)
def test_last_user_removes_the_file(tmp_path):
    path = str(tmp_path / "store")
    a = FileStore(path, 5)
    b = FileStore(path, 5)
    a.set("k", b"v")
    del a
    gc.collect()
    assert os.path.exists(path)
    assert b.get("k") == b"v"
    del b
    gc.collect()
    assert not os.path.exists(path)
    c = FileStore(path, 5)  # a later job on the same path starts empty
    assert c.num_keys() == 0
    del c
    gc.collect()
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(10)
def test_garbage_file_is_a_clear_error(tmp_path):
    path = tmp_path / "garbage"
    data = b"this is not a store\n" + bytes(range(256))
    path.write_bytes(data)
    with pytest.raises(meshcoll.MeshcollError,
                       match=re.escape(str(path)) + ".*not a meshcoll FileStore file.*byte offset 0"):
        FileStore(path, 1)
    # A valid header then a record whose key length runs past the end of the file.
    torn = tmp_path / "torn"
    torn.write_bytes(b"MCFS\x01\x00\x00\x00" + b"\x01\x05\x00\x00\x00ab")
    with pytest.raises(meshcoll.MeshcollError, match="corrupted.*byte offset 8"):
        FileStore(torn, 1)
    bad_op = tmp_path / "bad_op"
    bad_op.write_bytes(b"MCFS\x01\x00\x00\x00" + b"\x07" + b"\x00" * 8)
    with pytest.raises(meshcoll.MeshcollError, match="record type 7.*byte offset 8"):
        FileStore(bad_op, 1)
    assert path.read_bytes() == data  # neither written to nor deleted


@pytest.mark.timeout(10)
def test_bad_paths_raise(tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "store"
    with pytest.raises(ValueError, match=re.escape(str(missing)) + ".*No such file"):
        FileStore(str(missing), 1)
    with pytest.raises(ValueError, match="Is a directory"):
        FileStore(str(tmp_path), 1)
    with pytest.raises(ValueError, match="timeout"):
        FileStore(str(tmp_path / "s"), -1)


def _hold_lock(path, ready, release):
    import fcntl
    with open(path, "r+b") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)  # a POSIX record lock, as the store takes
        ready.set()
        release.wait(30)


@pytest.mark.timeout(30)
def test_a_held_lock_is_a_timeout_not_a_hang(tmp_path):
    path = str(tmp_path / "store")
    store = FileStore(path, 1.0)
    store.set("k", b"v")
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(path, ready, release), daemon=True)
    holder.start()
    try:
        assert ready.wait(20)
        t0 = time.monotonic()
        with pytest.raises(meshcoll.TimeoutError, match="lock"):
            store.get("k")
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
        holder.join(10)
    assert store.get("k") == b"v"  # usable again once the holder lets go
