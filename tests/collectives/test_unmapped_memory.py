"""An array whose memory is not mapped (munmap'ed under a numpy view), or is mapped without
the access a call needs, is a ValueError on the rank that passed it, before anything is sent
(Note [Unmapped memory] in csrc/python/array_memory.cc), on shared memory and TCP: never a SIGSEGV.

A refused argument on one rank (as a bad dtype is) sends nothing, so its peers' call is still
waiting for that rank: the rank's retry with a good array pairs with it and the job ends
cleanly (README: "its peers wait for it as for any refused argument")."""

import ctypes
import mmap

import numpy as np
import pytest

from conftest import group_on

pytestmark = pytest.mark.timeout(120)

CALL = 20.0  # seconds: a hang fails the call, not the whole test run
PROT_NONE = 0  # not in the mmap module
N = 3 * mmap.PAGESIZE // 8  # float64 elements over three pages

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _mapped(prot):
    """A float64 array of N elements over an anonymous mapping with `prot`; numpy sees it as
    writable whatever `prot` is (a ctypes buffer)."""
    size = N * 8
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    a = np.frombuffer((ctypes.c_char * size).from_address(addr), np.float64)
    a[:] = 1.0
    assert _libc.mprotect(addr, size, prot) == 0
    return a, addr, size


def unmapped():
    a, addr, size = _mapped(mmap.PROT_READ | mmap.PROT_WRITE)
    assert _libc.munmap(addr, size) == 0
    return a


def unmapped_middle():
    """Only the middle page is gone: the ends are fine."""
    a, addr, _ = _mapped(mmap.PROT_READ | mmap.PROT_WRITE)
    assert _libc.munmap(addr + mmap.PAGESIZE, mmap.PAGESIZE) == 0
    return a


def _call(g, name, x):
    if name == "all_reduce":
        return g.all_reduce(x, timeout=CALL)
    if name == "broadcast":
        return g.broadcast(x, 0, timeout=CALL)
    return g.all_gather(x, timeout=CALL)


def _one_rank_bad(pg, victim):
    """Rank `victim` passes each collective an array unmapped whole, then one unmapped in its
    middle page: ValueError each time. Then every rank makes the call with a good array (the
    victim's retry pairs with the call its peers are still waiting in): the right result."""
    out = {}
    for transport in ("shm", "tcp"):
        g = group_on(pg, transport)
        assert g.transport == transport
        n = g.size
        for name in ("all_reduce", "broadcast", "all_gather"):
            refused = []
            if g.rank == victim:
                for make in (unmapped, unmapped_middle):
                    with pytest.raises(ValueError) as e:
                        _call(g, name, make())
                    refused.append(str(e.value))
            x = np.full(N, g.rank + 1.0)
            res = _call(g, name, x)
            want = {"all_reduce": [n * (n + 1) / 2] * 2, "broadcast": [1.0] * 2,
                    "all_gather": [q + 1.0 for q in range(n)]}[name]
            got = [float(x[0]), float(x[-1])] if name != "all_gather" else \
                [float(res[q][0]) for q in range(n)]
            out[(transport, name)] = (got == want, refused)
        g.destroy()
    return out


def _every_rank_bad(pg):
    """Each kind of unusable memory, on every rank at once: ValueError, and the group stays
    usable (nothing was sent)."""
    x_none, addr, size = _mapped(PROT_NONE)
    x_ro, _, _ = _mapped(mmap.PROT_READ)
    got = {}
    for label, call in [
        ("unmapped all_reduce", lambda: pg.all_reduce(unmapped(), timeout=CALL)),
        ("unmapped small all_reduce", lambda: pg.all_reduce(unmapped()[:4], timeout=CALL)),
        ("PROT_NONE all_reduce", lambda: pg.all_reduce(x_none, timeout=CALL)),
        ("PROT_NONE send", lambda: pg.send(x_none, 1 - pg.rank, timeout=CALL)),
        ("read-only mapping all_reduce", lambda: pg.all_reduce(x_ro, timeout=CALL)),
        ("read-only mapping recv", lambda: pg.recv(x_ro, 1 - pg.rank, timeout=CALL)),
        ("unmapped all_gather out",
         lambda: pg.all_gather(np.ones(N // 2), out=unmapped(), timeout=CALL)),
    ]:
        try:
            call()
            got[label] = "no error"
        except ValueError as e:
            got[label] = str(e)
    # A read-only mapping is fine where the call only reads it.
    if pg.rank == 0:
        pg.send(x_ro, 1, timeout=CALL)
    else:
        got["received"] = pg.recv(np.zeros(N), 0, timeout=CALL)[0]
    x = np.ones(4)
    pg.all_reduce(x, timeout=CALL)
    _libc.munmap(addr, size)
    return got, x.tolist()


@pytest.mark.parametrize("victim", [0, 1])
def test_unmapped_array_on_one_rank_is_a_value_error_and_its_retry_pairs(run_ranks, victim):
    for rank, out in enumerate(run_ranks(2, _one_rank_bad, victim=victim, timeout=100)):
        assert len(out) == 6
        for (transport, name), (right, refused) in out.items():
            assert right, (rank, transport, name)
            assert len(refused) == (2 if rank == victim else 0), (rank, transport, name)
            for text in refused:
                assert text.startswith(name) and "not mapped" in text, text


def test_each_kind_of_unusable_memory_is_a_value_error(run_ranks):
    for rank, (got, x) in enumerate(run_ranks(2, _every_rank_bad, timeout=100)):
        assert x == [2.0] * 4
        assert got.pop("received", 1.0) == 1.0
        assert "not mapped" in got["unmapped all_reduce"], got
        assert "all_reduce" in got["unmapped all_reduce"], got
        assert "not mapped" in got["unmapped small all_reduce"], got  # the ends probe's path
        assert "not readable" in got["PROT_NONE all_reduce"], got
        assert "send" in got["PROT_NONE send"] and "not readable" in got["PROT_NONE send"], got
        assert "not writable" in got["read-only mapping all_reduce"], got
        assert "recv" in got["read-only mapping recv"], got
        assert "not writable" in got["read-only mapping recv"], got
        assert "out" in got["unmapped all_gather out"], got
        assert "not mapped" in got["unmapped all_gather out"], got


# ---- Note [Memory numpy owns]: no probe for memory numpy allocated ---------------------------

def _fault_memory_probes():
    """Makes process_vm_readv and process_vm_writev fail with EFAULT on this thread (a seccomp
    filter; x86-64 only): the probe of Note [Unmapped memory] then finds any array it probes
    unreadable. Returns why not where the machine cannot have the filter (another
    architecture, a kernel without seccomp, a sandbox that forbids it); any other refusal
    (a filter the kernel finds malformed) raises."""
    import errno
    import os
    import platform
    if platform.machine() != "x86_64":
        return f"seccomp filters here are written for x86-64, not {platform.machine()}"
    with open("/proc/self/status") as f:
        if "Seccomp:" not in f.read():
            return "this kernel has no seccomp"

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    allow, efault = 0x7FFF0000, 0x00050000 | 14  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EFAULT
    code = (Insn * 7)(
        Insn(ld, 0, 0, 4),               # seccomp_data.arch
        Insn(jeq, 0, 4, 0xC000003E),     # AUDIT_ARCH_X86_64, else allow
        Insn(ld, 0, 0, 0),               # seccomp_data.nr
        Insn(jeq, 1, 0, 310),            # process_vm_readv
        Insn(jeq, 0, 1, 311),            # process_vm_writev
        Insn(ret, 0, 0, efault),
        Insn(ret, 0, 0, allow))
    prog = Prog(len(code), code)
    prctl = _libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                      ctypes.c_ulong]
    for args in ((38, 1, None, 0, 0),                 # PR_SET_NO_NEW_PRIVS
                 (22, 2, ctypes.byref(prog), 0, 0)):  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        if prctl(*args) != 0:
            e = ctypes.get_errno()
            if e in (errno.EPERM, errno.EACCES):
                return f"the sandbox forbids seccomp filters ({os.strerror(e)})"
            raise OSError(e, f"prctl{args[:2]}: {os.strerror(e)}")
    return None


def _draws(rank):
    """Rank `rank`'s arrays: numpy allocates each (standard_normal's own result)."""
    rng = np.random.default_rng(100 + rank)
    return [rng.standard_normal(k) for k in (1, 5, 3 * N)]


def _owned_memory_is_not_probed(pg):
    """With every probe faulting on the calling thread, arrays numpy allocated (and a view of
    one) still reduce, on shared memory and TCP; an array over other memory is still probed
    (and, here, refused on every rank, so nothing is sent and the group stays usable)."""
    why_not = _fault_memory_probes()
    if why_not is not None:
        return why_not
    out = {}
    for transport in ("shm", "tcp"):
        g = group_on(pg, transport)
        got = _draws(g.rank)
        for x in got:
            g.all_reduce(x, timeout=CALL)
        base = np.zeros(2 * N)
        view = base[N // 2: N // 2 + 7]  # a view whose base owns its memory
        view[:] = np.resize(_draws(g.rank)[1], 7)
        g.all_reduce(view, timeout=CALL)
        foreign = np.frombuffer(bytearray(64), np.float64)  # memory numpy did not allocate
        try:
            g.all_reduce(foreign, timeout=CALL)
            refused = "no error"
        except ValueError as e:
            refused = str(e)
        out[transport] = ([a.tolist() for a in got], view.tolist(), refused)
        g.destroy()
    return out


def test_arrays_numpy_owns_are_not_probed(run_ranks):
    results = run_ranks(2, _owned_memory_is_not_probed, timeout=100)
    if isinstance(results[0], str):
        pytest.skip(results[0])
    want = [a + b for a, b in zip(_draws(0), _draws(1))]
    for out in results:
        for transport, (got, view, refused) in out.items():
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-12, err_msg=transport)
            np.testing.assert_allclose(view, np.resize(want[1], 7), rtol=1e-12)
            assert "not readable" in refused and "all_reduce" in refused, (transport, refused)
