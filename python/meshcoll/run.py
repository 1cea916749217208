"""meshcoll-run: start the ranks of one node and tear them all down on the first failure.

    meshcoll-run -n 4 train.py --lr 0.1
    meshcoll-run -n 8 --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 -m pkg.train

Each child gets MESHCOLL_RANK, _WORLD_SIZE, _LOCAL_RANK, _LOCAL_WORLD_SIZE,
_NODE_RANK, _MASTER_ADDR, _MASTER_PORT and _TOKEN (names from meshcoll._env).
Their output lines are prefixed with "[rank N] ". The first rank to fail
(non-zero exit or death by a signal) stops the others, and its exit code
becomes ours (128+signum for a signal), so shells and schedulers see the real
reason rather than the SIGTERM we sent to the survivors.

Note [Ranks die with the launcher]
Each child asks the kernel for SIGKILL when the launcher's thread that started it
dies (prctl PR_SET_PDEATHSIG, Linux), so a SIGKILL of meshcoll-run (which runs no
handler) does not leave its ranks running forever as orphans. The rank's own
children are not covered: they are the rank's to manage (and get our SIGTERM to
their process group in every other case).

This module uses only the standard library and meshcoll._env: it must work
before, and without, the C++ extension.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Callable, List, Optional

from meshcoll import __version__, _env

# Survivors get SIGTERM, then this long to run their handlers, then SIGKILL.
GRACE_S = 5.0
_POLL_S = 0.05  # how often we look at the children; also bounds failure latency
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="meshcoll-run",
        usage="%(prog)s [options] script.py [args ...]\n"
              "       %(prog)s [options] -m module [args ...]",
        description="Run one process per rank on this node with the MESHCOLL_* "
                    "variables set; stop all of them when one fails.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("-n", "--nproc-per-node", type=int, default=1, metavar="N",
                   help="ranks to start on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index in 0..nnodes-1 (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="address of node 0, where rank 0 hosts the store (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=0,
                   help="store port; 0 (default) picks a free one, single node only")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="default collective timeout, passed as MESHCOLL_TIMEOUT")
    p.add_argument("--token", default=None,
                   help="job token shared by all nodes (else MESHCOLL_TOKEN, else a random "
                        "one on a single node); prefer MESHCOLL_TOKEN: arguments show in ps")
    p.add_argument("--no-prefix", action="store_true",
                   help="pass the children's output through untouched")
    p.add_argument("-m", dest="module", action="store_true",
                   help="run the target as a module, like python -m")
    # Optional to argparse (which would otherwise list REMAINDER's args as required too):
    # the missing target is reported below, in words.
    p.add_argument("target", metavar="script|module", nargs="?",
                   help="script path, or module with -m")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="arguments for the script (optional)")
    args = p.parse_args(argv)

    if args.target is None:
        p.error("nothing to run: give a script (meshcoll-run -n 2 train.py) or a module "
                "(meshcoll-run -n 2 -m pkg.train)")

    if args.nproc_per_node < 1:
        p.error(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.nnodes < 1:
        p.error(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if not 0 <= args.master_port <= 65535:
        p.error(f"--master-port must be in 0..65535, got {args.master_port}")
    if args.master_port == 0 and args.nnodes > 1:
        p.error("--nnodes > 1 needs a fixed --master-port: a port picked here could "
                "not be known by the other nodes")
    if args.timeout is not None and not args.timeout > 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.token is None:
        args.token = os.environ.get(_env.TOKEN) or None
    if args.token is None:
        if args.nnodes > 1:
            p.error(f"--nnodes > 1 needs a job token shared by all nodes: set the same "
                    f"{_env.TOKEN} (or --token) on every node")
        args.token = secrets.token_hex(16)
    return args


def pick_free_port(addr: str) -> int:
    """A port that is free on `addr` right now.

    The kernel could hand it to someone else before rank 0 binds it; on one
    node that race is rare and shows up as a clear bind error, not a hang.
    """
    family, type_, proto, _, sockaddr = socket.getaddrinfo(
        addr, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, type_, proto) as s:
        s.bind(sockaddr)
        return int(s.getsockname()[1])


def port_in_use(addr: str, port: int) -> bool:
    """Whether another process listens on ``addr:port`` now: a listen there fails with
    EADDRINUSE. The socket options are the store's (SO_REUSEADDR, csrc/common/socket.cc), so
    connections of an earlier job in TIME_WAIT do not count. An address that is not this
    host's (EADDRNOTAVAIL) or does not resolve says nothing: False, and rank 0 reports it."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    for family, type_, proto, _, sockaddr in infos:
        with socket.socket(family, type_, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
                s.listen(1)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


def port_clash_message(addr: str, port: int, came_from: str) -> str:
    """What the launcher says when another process holds the store's port. Every rank of
    this job then fails, but with a symptom of its own: rank 0 cannot listen, the others
    reach the other job's store, which refuses their token."""
    return (f"port clash: {addr}:{port} ({came_from}) is held by another process, most "
            f"likely another job on the same port; this job's rank 0 cannot host its store "
            f"there, and its other ranks reach the other job's store (which refuses their "
            f"token). Pick another --master-port, or 0 to let a one-node job choose a free one")


def _pump(src: BinaryIO, dst: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
    """Copy whole lines from a child's pipe to our stream, each with the prefix.

    One lock for stdout and stderr keeps lines of different ranks from
    interleaving mid-line. We keep draining after our own stream breaks
    (e.g. `| head`) so that no child blocks on a full pipe.
    """
    broken = False
    for line in iter(src.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"  # last line without newline: keep the next rank's prefix in column 0
        if broken:
            continue
        with lock:
            try:
                dst.write(prefix + line)
                dst.flush()
            except (BrokenPipeError, OSError, ValueError):
                broken = True
    src.close()


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _die_with_launcher() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that makes the child die with us (Note [Ranks die with the
    launcher]), or None where prctl does not exist (not Linux)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not after the fork
    except (OSError, AttributeError):
        return None
    launcher, sigkill = os.getpid(), int(signal.SIGKILL)

    def preexec() -> None:
        # In the child, between fork and exec: one system call, nothing that could take a
        # lock another thread of ours held at the fork. The signal comes when the thread that
        # forked us ends, so children are started from the main thread, which lives as long
        # as meshcoll-run does.
        prctl(_PR_SET_PDEATHSIG, sigkill)
        # If we died before the prctl, the signal never comes: the child was re-parented
        # (to init or a subreaper) already. End as the signal would have ended it.
        if os.getppid() != launcher:
            os.kill(os.getpid(), sigkill)
    return preexec


class _Job:
    """The children of this node, their output pumps and the teardown."""

    def __init__(self, args: argparse.Namespace, master_port: int):
        self.args = args
        self.master_port = master_port
        self.port_from = "--master-port" if args.master_port else "picked by meshcoll-run"
        self.procs: List[subprocess.Popen[bytes]] = []
        self.ranks: List[int] = []
        self.pumps: List[threading.Thread] = []
        self.lock = threading.Lock()
        self.signals: List[int] = []  # signals we received, in order

    # -- start -------------------------------------------------------------
    def start(self) -> None:
        a = self.args
        cmd = [sys.executable] + (["-m", a.target] if a.module else [a.target]) + a.args
        preexec = _die_with_launcher()
        for local_rank in range(a.nproc_per_node):
            if self.signals:
                return  # told to stop while starting: start no more
            rank = a.node_rank * a.nproc_per_node + local_rank
            env = dict(os.environ)
            env.update(_env.launcher_env(
                rank=rank, world_size=a.nnodes * a.nproc_per_node,
                local_rank=local_rank, local_world_size=a.nproc_per_node,
                node_rank=a.node_rank, master_addr=a.master_addr,
                master_port=self.master_port, token=a.token, timeout=a.timeout))
            # Without this, a child's print() sits in its buffer until exit, and
            # lines of a crashed rank would never reach us.
            env["PYTHONUNBUFFERED"] = "1"
            if a.nproc_per_node > 1:
                # N ranks x a spinning BLAS thread pool each oversubscribe the cores (torchrun
                # sets the same default); an explicit OMP_NUM_THREADS wins.
                env.setdefault("OMP_NUM_THREADS", "1")
            pipe = None if a.no_prefix else subprocess.PIPE
            # A new session per child: our SIGTERM/SIGKILL then reaches the whole
            # process group, grandchildren included, with os.killpg(child.pid).
            proc = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe,
                                    start_new_session=True, preexec_fn=preexec)
            self.procs.append(proc)
            self.ranks.append(rank)
            if pipe is not None:
                prefix = f"[rank {rank}] ".encode()
                for src, dst in ((proc.stdout, sys.stdout.buffer),
                                 (proc.stderr, sys.stderr.buffer)):
                    t = threading.Thread(target=_pump, args=(src, dst, prefix, self.lock),
                                         daemon=True)
                    t.start()
                    self.pumps.append(t)

    # -- signals -----------------------------------------------------------
    def on_signal(self, signum: int, frame: object) -> None:
        # Children live in their own sessions, so a terminal's Ctrl-C no longer
        # reaches them: forward it. A second signal means "now": SIGKILL.
        self.signals.append(signum)
        self._signal_all(signum if len(self.signals) == 1 else signal.SIGKILL)

    def _signal_all(self, signum: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone (ESRCH); EPERM cannot happen for our own children

    # -- wait and tear down ------------------------------------------------
    def wait(self) -> int:
        """Wait until all ranks succeed or one fails; return our exit code."""
        failed: Optional[int] = None  # index of the first failing child
        while failed is None and not self.signals:
            codes = [p.poll() for p in self.procs]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is None and all(c == 0 for c in codes):
                break
            if failed is None:
                time.sleep(_POLL_S)

        running = sum(p.poll() is None for p in self.procs)
        if self.signals:
            signum = self.signals[0]
            self._log(f"got {_signame(signum)}; forwarded it to the ranks, waiting "
                      f"up to {GRACE_S:g} s for them to exit")
            code = 128 + signum
            # The children got the signal already; give them the grace period
            # to act on it (a KeyboardInterrupt handler, a checkpoint) before SIGKILL.
            self.stop(first=None)
            return code
        if failed is not None:
            proc, rank = self.procs[failed], self.ranks[failed]
            rc = proc.returncode
            if rc < 0:
                what, code = f"was killed by {_signame(-rc)}", 128 - rc
            else:
                what, code = f"failed with exit code {rc}", rc
            stopped = f"; stopped the other {running} rank{'s' if running != 1 else ''}" \
                if running else ""
            self.stop()
            # Node 0 hosts the store. Once every rank of ours is gone, a port still held is
            # held by someone else: that, not the rank that happened to fail first, is the
            # cause (a job that took the port after the check in main, or a picked port
            # taken before rank 0 bound it).
            addr = self.args.master_addr
            self._log(f"rank {rank} (pid {proc.pid}) {what}{stopped}")
            if self.args.node_rank == 0 and port_in_use(addr, self.master_port):
                self._log(port_clash_message(addr, self.master_port, self.port_from))
            return code
        self.stop()
        return 0

    def stop(self, first: Optional[int] = signal.SIGTERM) -> None:
        """Send `first` to every child's process group, SIGKILL what is left after GRACE_S.

        Groups outlive their leader: a grandchild may still hold our pipes, so
        we signal groups, not pids, and also the groups of children that exited.
        """
        if first is not None:
            self._signal_all(first)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            # Reap first: a zombie leader still counts as a group member.
            for p in self.procs:
                p.poll()
            if not any(self._group_alive(p.pid) for p in self.procs):
                break
            time.sleep(_POLL_S)
        left = [r for p, r in zip(self.procs, self.ranks) if self._group_alive(p.pid)]
        if left:
            self._log(f"rank{'s' if len(left) > 1 else ''} {', '.join(map(str, left))} still "
                      f"running {GRACE_S:g} s after the signal: sent SIGKILL")
        self._signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        # After SIGKILL the pipes close; the timeout only guards against a
        # process that left its group (setsid) while holding one.
        for t in self.pumps:
            t.join(timeout=GRACE_S)

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def _log(self, msg: str) -> None:
        with self.lock:
            print(f"meshcoll-run: {msg}", file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    port = args.master_port
    if port == 0:
        try:
            port = pick_free_port(args.master_addr)
        except OSError as e:
            print(f"meshcoll-run: cannot pick a free port on --master-addr "
                  f"{args.master_addr}: {e}", file=sys.stderr)
            return 1

    elif args.node_rank == 0 and port_in_use(args.master_addr, port):
        # Before starting anything: every rank would fail, each with its own symptom.
        print(f"meshcoll-run: {port_clash_message(args.master_addr, port, '--master-port')}",
              file=sys.stderr)
        return 1

    job = _Job(args, port)
    old = {s: signal.signal(s, job.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            job.start()
        except OSError as e:
            job._log(f"cannot start {args.target}: {e}")
            job.stop()
            return 1
        return job.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
