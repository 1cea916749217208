"""The MESHCOLL_* settings: what each variable means, its default, and its check.

Read once: ``meshcoll.init`` reads the group settings (``group_options_from_env``) and hands
them to every group; the compiled module installs the core's (``core_config_from_env``) when
it is imported (Note [Configuration] in csrc/common/config.h). Who this process is (rank,
world size, master) is _rendezvous.py's. Pure Python with no import of the C++ extension.

Every function takes ``environ=`` (a mapping) so tests pass plain dicts; it defaults to
``os.environ``. An empty value counts as unset, because ``export MESHCOLL_TIMEOUT=`` is how
shells and job scripts usually "clear" one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

TIMEOUT = "MESHCOLL_TIMEOUT"
SOCKET_IFNAME = "MESHCOLL_SOCKET_IFNAME"
TRANSPORT = "MESHCOLL_TRANSPORT"
SHM_BYTES = "MESHCOLL_SHM_BYTES"
HIERARCHY = "MESHCOLL_HIERARCHY"
ALGO = "MESHCOLL_ALGO"
MAX_TIMEOUT_S = 1e7  # as csrc/python/fastcall.h: a longer deadline would overflow the clock
DEFAULT_TIMEOUT_S = 300.0  # as kDefaultTimeout in csrc/common/deadline.h
DEBUG = "MESHCOLL_DEBUG"
# Read into the C++ core's Config (core_config_from_env; Note [Configuration]).
HOST_ID = "MESHCOLL_HOST_ID"
CMA = "MESHCOLL_CMA"
SHM_ALL_REDUCE = "MESHCOLL_SHM_ALL_REDUCE"
SHM_ALL_REDUCE_PATHS = ("auto", "flat", "scalable")  # its values
SHM_SINGLE_COPY_BYTES = "MESHCOLL_SHM_SINGLE_COPY_BYTES"
SHM_SPIN_US = "MESHCOLL_SHM_SPIN_US"
SIMD = "MESHCOLL_SIMD"
NCCL_TRACE = "MESHCOLL_NCCL_TRACE"
NCCL_LIBRARY = "MESHCOLL_NCCL_LIBRARY"
NCCL_SPLIT = "MESHCOLL_NCCL_SPLIT"
NCCL_DIRECT_BYTES = "MESHCOLL_NCCL_DIRECT_BYTES"
ON_ERROR = "MESHCOLL_ON_ERROR"
ON_ERROR_CHOICES = ("raise", "abort")
HOST_TIMERS = "MESHCOLL_HOST_TIMERS"
CHECK = "MESHCOLL_CHECK"
CHECK_MODES = ("async", "strict", "off")
# How the settings agreement names a group's members (Note [Shared settings]).
MEMBERS = "the group's members (new_group's ranks, in order)"
NAME = "the group's name (new_group's or split's name=)"
BACKEND = "the group's backend (new_group's backend=)"
FAULT = "MESHCOLL_FAULT"

TRANSPORTS = ("auto", "shm", "tcp")  # the values of MESHCOLL_TRANSPORT

WHO = "meshcoll.init"  # who raises, in the messages of the readers init calls


def value_of(env: Mapping[str, str], name: str) -> Optional[str]:
    """The variable's value, stripped; None when unset or empty."""
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def parse_int(text: str, name: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise ValueError(f"{WHO}: {name}={text!r} is not an integer") from None


def timeout_from_env(default: float = DEFAULT_TIMEOUT_S,
                     environ: Optional[Mapping[str, str]] = None) -> float:
    """The default collective timeout in seconds: MESHCOLL_TIMEOUT, else `default`."""
    env = os.environ if environ is None else environ
    text = value_of(env, TIMEOUT)
    if text is None:
        return float(default)
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"meshcoll: {TIMEOUT}={text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"meshcoll: {TIMEOUT}={text!r} must be a number of seconds > 0 and "
                         f"at most {MAX_TIMEOUT_S:g} (about 116 days)")
    return value


def socket_ifname_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The network interface TCP should bind to (MESHCOLL_SOCKET_IFNAME), or None."""
    env = os.environ if environ is None else environ
    return value_of(env, SOCKET_IFNAME)

def transport_from_env(environ: Optional[Mapping[str, str]] = None) -> str:
    """``MESHCOLL_TRANSPORT``: auto (default), shm or tcp."""
    env = os.environ if environ is None else environ
    value = (value_of(env, TRANSPORT) or "auto").lower()
    if value not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT}={value!r}: use one of {', '.join(TRANSPORTS)}")
    return value


def hierarchy_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``MESHCOLL_HIERARCHY``: 1 (default) lets groups spanning hosts reduce through shared
    memory inside each host (Note [Hierarchy]); 0 keeps all of it on TCP."""
    env = os.environ if environ is None else environ
    value = value_of(env, HIERARCHY) or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{HIERARCHY}={value!r}: use 0 or 1")
    return value == "1"


# The largest MESHCOLL_SHM_BYTES: a segment (with its control block) must fit the C++ core's
# size_t and off_t, or a value like 10**20 reached the core's constructor and failed there
# with pybind11's list of signatures. 2**50, which no /dev/shm holds, still goes through:
# a group then falls back to TCP saying there is no room (or fails, with shm forced).
SHM_BYTES_MAX = 1 << 60


def shm_bytes_from_env(environ: Optional[Mapping[str, str]] = None) -> int:
    """``MESHCOLL_SHM_BYTES``: each rank's shared-memory data area (default 4 MiB), a whole
    number of bytes from 4096 to SHM_BYTES_MAX; ValueError naming the variable otherwise."""
    env = os.environ if environ is None else environ
    text = value_of(env, SHM_BYTES)
    if text is None:
        return 4 << 20
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if not 4096 <= value <= SHM_BYTES_MAX:
        raise ValueError(f"{SHM_BYTES}={text!r}: give a whole number of bytes from 4096 to "
                         f"{SHM_BYTES_MAX} (2**60), e.g. 4194304 (4 MiB, the default)")
    return value


def algorithm_from_env(environ: Optional[Mapping[str, str]] = None) -> str:
    """``MESHCOLL_ALGO``: the CPU backend's all_reduce algorithm for "auto" calls (default
    auto; CollectiveConfig checks the name)."""
    env = os.environ if environ is None else environ
    return value_of(env, ALGO) or "auto"


def debug_from_env(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``MESHCOLL_DEBUG``: any value but 0 logs one line per operation on stderr."""
    env = os.environ if environ is None else environ
    value = value_of(env, DEBUG)
    return value is not None and value != "0"


@dataclass(frozen=True)
class GroupOptions:
    """How the groups of a job are built, read from the environment once by
    ``meshcoll.init`` and handed to every group (``new_group(transport=...)`` overrides the
    transport for one subgroup)."""

    transport: str = "auto"     # MESHCOLL_TRANSPORT
    shm_bytes: int = 4 << 20    # MESHCOLL_SHM_BYTES
    hierarchy: bool = True      # MESHCOLL_HIERARCHY
    algorithm: str = "auto"     # MESHCOLL_ALGO
    debug: bool = False         # MESHCOLL_DEBUG
    check: str = "async"        # MESHCOLL_CHECK: NCCL and MPI groups' agreement check: async, strict, off

    def shared(self, backend: str = "cpu") -> Dict[str, str]:
        """The settings every rank of a group on ``backend`` must share, named as users set
        them, with their values as written. CPU ranks that differ would map each other's
        shared memory at different sizes (SIGBUS), or wait for a shared-memory setup or a
        hierarchy that the others never start; NCCL ranks whose agreement check differs
        would wait for a side channel the others never open. So they are compared across
        ranks before anything else is set up (Note [Shared settings] in
        csrc/store/exchange.h). The algorithm is not among them: it travels with every call,
        and ranks that choose differently get a MismatchError there; nor is the timeout,
        which each rank may set for itself."""
        if backend == "nccl":  # checks on a side channel
            return {f"{CHECK} (or new_group's check=)": repr(self.check)}
        if backend == "mpi":  # as NCCL; and builds a hierarchy across hosts, as a CPU group
            return {f"{CHECK} (or new_group's check=)": repr(self.check),
                    HIERARCHY: "1" if self.hierarchy else "0"}
        return {f"{TRANSPORT} (or new_group's transport=)": repr(self.transport),
                SHM_BYTES: str(self.shm_bytes),
                HIERARCHY: "1" if self.hierarchy else "0"}


def _choice(env: Mapping[str, str], name: str, choices: Sequence[str]) -> str:
    """The value of ``name`` (the first choice when unset); ValueError naming it otherwise."""
    value = (value_of(env, name) or choices[0]).strip().lower()
    if value not in choices:
        raise ValueError(f"meshcoll: {name}={value!r}: use one of {', '.join(choices)}")
    return value


def group_options_from_env(environ: Optional[Mapping[str, str]] = None) -> GroupOptions:
    return GroupOptions(transport=transport_from_env(environ), shm_bytes=shm_bytes_from_env(environ),
                        hierarchy=hierarchy_from_env(environ),
                        algorithm=algorithm_from_env(environ), debug=debug_from_env(environ),
                        check=_choice(os.environ if environ is None else environ, CHECK,
                                      CHECK_MODES))


@dataclass(frozen=True)
class CoreConfig:
    """The C++ core's process-wide settings (csrc/common/config.h), field for field; the
    defaults are those of an unset environment and equal the C++ defaults."""

    host_id: str = ""         # MESHCOLL_HOST_ID: same-host identity override ("": derived)
    cma: bool = True          # MESHCOLL_CMA: cross-memory attach on one host
    shm_all_reduce: str = "auto"  # MESHCOLL_SHM_ALL_REDUCE: auto, flat or scalable
    # MESHCOLL_SHM_SINGLE_COPY_BYTES: the smallest single-copy all_reduce (0: by world size)
    shm_single_copy_bytes: int = 0
    shm_spin_us: int = -1     # MESHCOLL_SHM_SPIN_US: a shared-memory wait's spin (-1: by host)
    simd: str = ""            # MESHCOLL_SIMD: cap the reduction kernels ("": no cap)
    nccl_trace: bool = False  # MESHCOLL_NCCL_TRACE: print each NCCL loading step
    nccl_library: str = ""    # MESHCOLL_NCCL_LIBRARY: libnccl.so.2 to try first
    nccl_split: bool = True   # MESHCOLL_NCCL_SPLIT: subgroups through ncclCommSplit
    # MESHCOLL_NCCL_DIRECT_BYTES: the largest call for meshcoll's direct kernels (0: never)
    nccl_direct_bytes: int = 256 << 10
    abort_on_error: bool = False  # MESHCOLL_ON_ERROR=abort: a failed group ends the process
    host_timers: bool = False  # MESHCOLL_HOST_TIMERS: time each fast-path call's steps
    fault: str = ""           # MESHCOLL_FAULT (tests): "kill@<point>" or "stop@<point>", see fault_point


SIMD_LEVELS = ("baseline", "avx2", "avx512")  # the values of MESHCOLL_SIMD
# Where MESHCOLL_FAULT may strike: the fault_point() calls of the C++ core (the steps of a
# group's setup, csrc/common/config.h). A point named nowhere would never fire, and a fault
# test using it would pass without injecting anything.
FAULT_POINTS = ("settings", "shm/host", "shm/created", "shm/mapped", "shm/cma")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = value_of(env, name)
    if text is None:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"meshcoll: {name}={text!r}: use 0 or 1 (or unset it)")
    return text == "1"


def core_config_from_env(environ: Optional[Mapping[str, str]] = None) -> CoreConfig:
    """The C++ core's settings from MESHCOLL_HOST_ID, _CMA, _SHM_ALL_REDUCE,
    _SHM_SINGLE_COPY_BYTES, _SHM_SPIN_US, _SIMD, _NCCL_TRACE,
    _NCCL_LIBRARY, _NCCL_SPLIT, _NCCL_DIRECT_BYTES, _ON_ERROR, _HOST_TIMERS and _FAULT; ValueError naming the variable for a bad value. The
    compiled module installs the result once, when it is imported (Note [Configuration])."""
    env = os.environ if environ is None else environ
    simd = value_of(env, SIMD) or ""
    if simd and simd not in SIMD_LEVELS:
        raise ValueError(f"meshcoll: {SIMD}={simd!r} is not a SIMD level; use "
                         f"{', '.join(SIMD_LEVELS)} (or unset it)")
    fault = value_of(env, FAULT) or ""
    action, _, point = fault.partition("@")
    if fault and (action not in ("kill", "stop") or point not in FAULT_POINTS):
        raise ValueError(f"meshcoll: {FAULT}={fault!r}: use kill@<point> or stop@<point> (fault "
                         f"injection, for tests), where <point> is one of "
                         f"{', '.join(FAULT_POINTS)}; or unset it")
    direct = value_of(env, NCCL_DIRECT_BYTES)
    direct_bytes = 256 << 10 if direct is None else parse_int(direct, NCCL_DIRECT_BYTES)
    if not 0 <= direct_bytes <= 64 << 20:
        raise ValueError(f"meshcoll: {NCCL_DIRECT_BYTES}={direct!r}: use 0 (off) to 67108864 "
                         f"bytes (or unset it: 262144)")
    single = value_of(env, SHM_SINGLE_COPY_BYTES)
    single_copy = 0 if single is None else parse_int(single, SHM_SINGLE_COPY_BYTES)
    if not 0 <= single_copy <= 1 << 40:
        raise ValueError(f"meshcoll: {SHM_SINGLE_COPY_BYTES}={single!r}: use a size in bytes, "
                         "or 0 (or unset it) for the table by world size")
    spin = value_of(env, SHM_SPIN_US)
    spin_us = -1 if spin is None else parse_int(spin, SHM_SPIN_US)
    if not -1 <= spin_us <= 10_000_000:
        raise ValueError(f"meshcoll: {SHM_SPIN_US}={spin!r}: use 0 to 10000000 microseconds, or "
                         "-1 (or unset it) for the host's default")
    return CoreConfig(
        host_id=value_of(env, HOST_ID) or "",
        cma=_flag(env, CMA, True),
        shm_all_reduce=_choice(env, SHM_ALL_REDUCE, SHM_ALL_REDUCE_PATHS),
        shm_single_copy_bytes=single_copy,
        shm_spin_us=spin_us,
        simd=simd,
        nccl_trace=_flag(env, NCCL_TRACE, False),
        nccl_library=value_of(env, NCCL_LIBRARY) or "",
        nccl_split=_flag(env, NCCL_SPLIT, True),
        nccl_direct_bytes=direct_bytes,
        abort_on_error=_choice(env, ON_ERROR, ON_ERROR_CHOICES) == "abort",
        host_timers=_flag(env, HOST_TIMERS, False),
        fault=fault,
    )
