"""meshcoll-run: start the ranks of one node and tear them all down on the first failure.

    meshcoll-run -n 4 train.py --lr 0.1
    meshcoll-run -n 8 --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 -m pkg.train

Each child gets MESHCOLL_RANK, _WORLD_SIZE, _LOCAL_RANK, _LOCAL_WORLD_SIZE,
_NODE_RANK, _MASTER_ADDR, _MASTER_PORT and _TOKEN (names from meshcoll._rendezvous).
Their output lines are prefixed with "[rank N] ". The first rank to fail
(non-zero exit or death by a signal) stops the others, and its exit code
becomes ours (128+signum for a signal), so shells and schedulers see the real
reason rather than the SIGTERM we sent to the survivors.

Note [The first rank to fail]
"First" is by time, never by rank index. Healthy ranks blocked in a collective
with the failed one fail too, a few milliseconds later (a PeerError when it
closes its connections) or at their timeout; the launcher must name the cause,
not one of them. Two clocks decide:
  - when a rank began to leave the job: ranks that called meshcoll.init note it
    (note_leaving: meshcoll.destroy(), an uncaught exception, interpreter exit)
    in a file under MESHCOLL_RUN_NOTES. This is needed because a rank that
    raises closes its connections while its interpreter shuts down, and its
    peers, told at once, often exit before it does (docs/performance.md);
  - otherwise when its exit was seen: every child has a pidfd, and we sleep in
    poll() on them, so a death is seen within microseconds, not a poll period.
A rank that is stopped (SIGSTOP, SIGTSTP) when the first failure is seen is a
candidate from the moment its stop was seen: its peers then fail by timing out
on it, and it would otherwise never be named.

Note [Ranks die with the launcher]
Each child asks the kernel for SIGKILL when the launcher's thread that started it
dies (prctl PR_SET_PDEATHSIG, Linux), so a SIGKILL of meshcoll-run (which runs no
handler) does not leave its ranks running forever as orphans. The rank's own
children are not covered: they are the rank's to manage (and get our SIGTERM to
their process group in every other case).

This module uses only the standard library and meshcoll._rendezvous: it must work
before, and without, the C++ extension.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import errno
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import BinaryIO, Callable, Collection, Dict, List, Optional, Set, Tuple

from meshcoll import __version__, _rendezvous

# Survivors get SIGTERM, then this long to run their handlers, then SIGKILL.
GRACE_S = 5.0
_POLL_S = 0.05  # how often we look for stopped children and signals (exits wake us at once)
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
        args.token = os.environ.get(_rendezvous.TOKEN) or None
    if args.token is None:
        if args.nnodes > 1:
            p.error(f"--nnodes > 1 needs a job token shared by all nodes: set the same "
                    f"{_rendezvous.TOKEN} (or --token) on every node")
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


# ---- the rank's side of Note [The first rank to fail] ---------------------------------------

_watching_exit = False


def note_leaving(exiting: bool) -> None:
    """Note, once, the moment this rank began to leave the job, for the meshcoll-run that
    started it: ``<pid>.left`` (meshcoll.destroy() too), and ``<pid>.exiting`` when the
    process itself is ending (an uncaught exception, interpreter exit), which also tells the
    launcher to let it finish with its own exit code rather than SIGTERM it. A no-op for
    processes meshcoll-run did not start. Never raises: it runs on exit paths."""
    notes = os.environ.get(_rendezvous.RUN_NOTES)
    if not notes:
        return
    stamp = str(time.monotonic_ns()).encode()  # CLOCK_MONOTONIC: one clock for the host
    for kind in ("left", "exiting") if exiting else ("left",):
        try:
            fd = os.open(os.path.join(notes, f"{os.getpid()}.{kind}"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            continue  # noted before (the first time is the one that counts), or no launcher
        try:
            os.write(fd, stamp)
        except OSError:
            pass
        finally:
            os.close(fd)


def watch_exit() -> None:
    """Called by meshcoll.init in each rank: note an uncaught exception (before the
    traceback is printed and long before the interpreter's shutdown closes the group's
    connections, which tells the peers) and the interpreter's exit (sys.exit(n) runs no
    excepthook). Once per process, and only under meshcoll-run."""
    global _watching_exit
    if _watching_exit or not os.environ.get(_rendezvous.RUN_NOTES):
        return
    _watching_exit = True
    previous = sys.excepthook

    def excepthook(*exc: object) -> None:
        note_leaving(exiting=True)
        previous(*exc)  # type: ignore[arg-type]
    sys.excepthook = excepthook
    atexit.register(note_leaving, True)


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
        # Note [The first rank to fail]: where ranks note when they began to leave, and
        # when we saw each child exit or stop (time.monotonic_ns(), by index in procs).
        # close() removes the directory; a launcher killed by SIGKILL leaves it (and its few
        # tiny files) in the temporary directory.
        self.notes = tempfile.mkdtemp(prefix="meshcoll-run-")
        self.pidfds: List[Optional[int]] = []
        self.died_at: Dict[int, int] = {}
        self.stopped: Dict[int, Tuple[int, int]] = {}  # index -> (seen at, stop signal)

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
            env.update(_rendezvous.launcher_env(
                rank=rank, world_size=a.nnodes * a.nproc_per_node,
                local_rank=local_rank, local_world_size=a.nproc_per_node,
                node_rank=a.node_rank, master_addr=a.master_addr,
                master_port=self.master_port, token=a.token, timeout=a.timeout))
            env[_rendezvous.RUN_NOTES] = self.notes
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
            try:
                # Readable once the child exits: wait() sleeps on these (Linux >= 5.3).
                self.pidfds.append(os.pidfd_open(proc.pid))
            except (AttributeError, OSError):
                self.pidfds.append(None)
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
        # Children live in their own sessions, so a terminal's Ctrl-C does not
        # reach them: forward it. A second signal means "now": SIGKILL.
        self.signals.append(signum)
        self._signal_all(signum if len(self.signals) == 1 else signal.SIGKILL)

    def _signal_all(self, signum: int) -> None:
        for proc in self.procs:
            self._signal_group(proc.pid, signum)

    @staticmethod
    def _signal_group(pgid: int, signum: int) -> None:
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone (ESRCH); EPERM cannot happen for our own children

    # -- watch -------------------------------------------------------------
    def _watch(self) -> None:
        """Sleep until a child exits (its pidfd wakes us at once) or _POLL_S passes, then
        note when each exit and each stop was seen (Note [The first rank to fail])."""
        poller = select.poll()
        for fd, proc in zip(self.pidfds, self.procs):
            if fd is not None and proc.returncode is None:
                poller.register(fd, select.POLLIN)
        # Without pidfds (Linux < 5.3) a short period stands in for the wake-up.
        poller.poll(_POLL_S * 1000 if None not in self.pidfds else 5)
        now = time.monotonic_ns()
        for i, proc in enumerate(self.procs):
            if proc.returncode is not None:
                continue
            if proc.poll() is not None:
                self.died_at[i] = now
                continue
            try:
                # Only looks (WNOWAIT): reports a stop while the child stays stopped.
                st = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                st = None
            if st is None or st.si_code != os.CLD_STOPPED:
                self.stopped.pop(i, None)  # running, or continued since
            elif i not in self.stopped:
                self.stopped[i] = (now, st.si_status)

    def _noted(self, i: int, kind: str) -> Optional[int]:
        """When child i noted it began to leave (``kind`` "left" or "exiting"), or None."""
        try:
            with open(os.path.join(self.notes, f"{self.procs[i].pid}.{kind}")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def _exiting(self, i: int) -> bool:
        return os.path.exists(os.path.join(self.notes, f"{self.procs[i].pid}.exiting"))

    # -- wait and tear down ------------------------------------------------
    def wait(self) -> int:
        """Wait until all ranks succeed or one fails; return our exit code."""
        while not self.signals:
            self._watch()
            codes = [p.returncode for p in self.procs]
            if any(c not in (None, 0) for c in codes):
                return self._failed()
            if all(c == 0 for c in codes):
                self.stop()
                return 0
        signum = self.signals[0]
        self._log(f"got {_signame(signum)}; forwarded it to the ranks, waiting "
                  f"up to {GRACE_S:g} s for them to exit")
        # The children got the signal already; give them the grace period
        # to act on it (a KeyboardInterrupt handler, a checkpoint) before SIGKILL.
        self.stop(first=None)
        return 128 + signum

    def _failed(self) -> int:
        """A child failed: stop the others, then name the rank that failed first (Note [The
        first rank to fail]) and return its exit code."""
        seen = time.monotonic_ns()
        stopped = dict(self.stopped)  # stopped when the failure was seen
        running = {i for i, p in enumerate(self.procs) if p.returncode is None}
        # Ranks that noted their own exit finish it unsignalled, keeping their exit code.
        spare = {i for i in running if self._exiting(i) and i not in stopped}
        self.stop(spare=spare)
        signalled = running - spare

        # Candidates: every child that failed on its own, from when it began to leave (its
        # note) or else when its exit was seen; and every child stopped when the failure was
        # seen, from when its stop was seen. Ranks we stopped are not candidates.
        first: List[Tuple[int, int]] = []
        for i, p in enumerate(self.procs):
            if i in stopped:
                first.append((stopped[i][0], i))
            elif i not in signalled and p.returncode != 0:
                times = [t for t in (self._noted(i, "left"), self.died_at.get(i)) if t is not None]
                first.append((min(times, default=seen), i))
        first.sort()
        t0, i = first[0]
        what, code = self._what(i, stopped, seen)
        others = len(signalled - {i})
        stopped_others = f"; stopped the other {others} rank{'s' if others != 1 else ''}" \
            if others else ""
        then = ", ".join(f"rank {self.ranks[j]} {self._what(j, stopped, seen)[0]} "
                         f"(+{(t - t0) / 1e6:.0f} ms)" for t, j in first[1:])
        self._log(f"rank {self.ranks[i]} (pid {self.procs[i].pid}) {what}{stopped_others}"
                  + (f"; after it: {then}" if then else ""))
        # Node 0 hosts the store. Once every rank of ours is gone, a port still held is
        # held by someone else: that, not the rank that happened to fail first, is the
        # cause (a job that took the port after the check in main, or a picked port
        # taken before rank 0 bound it).
        addr = self.args.master_addr
        if self.args.node_rank == 0 and port_in_use(addr, self.master_port):
            self._log(port_clash_message(addr, self.master_port, self.port_from))
        return code

    def _what(self, i: int, stopped: Dict[int, Tuple[int, int]], seen: int) -> Tuple[str, int]:
        """What became of child i, for the log, and the exit code that says it."""
        if i in stopped:
            at, sig = stopped[i]
            return (f"was stopped by {_signame(sig)} {(seen - at) / 1e9:.1f} s before the "
                    f"first rank exited, so ranks waiting for it timed out (look for what "
                    f"stopped it: a debugger, kill -STOP, a suspended job)", 128 + sig)
        rc = self.procs[i].returncode
        assert rc is not None
        if rc < 0:
            return f"was killed by {_signame(-rc)}", 128 - rc
        return f"failed with exit code {rc}", rc

    def stop(self, first: Optional[int] = signal.SIGTERM, spare: Collection[int] = ()) -> None:
        """Send `first` to every child's process group, SIGKILL what is left after GRACE_S.
        A child in `spare` gets `first` only once it has exited (for its process group).

        Groups outlive their leader: a grandchild may still hold our pipes, so
        we signal groups, not pids, and also the groups of children that exited.
        """
        signalled: Set[int] = set()
        deadline = time.monotonic() + GRACE_S
        while True:
            # Reap first: a zombie leader still counts as a group member.
            now = time.monotonic_ns()
            for i, p in enumerate(self.procs):
                if p.returncode is None and p.poll() is not None:
                    self.died_at.setdefault(i, now)
            if first is not None:
                for i, p in enumerate(self.procs):
                    if i not in signalled and (i not in spare or p.returncode is not None):
                        signalled.add(i)
                        self._signal_group(p.pid, first)
                        # A stopped rank would act on it only when continued.
                        self._signal_group(p.pid, signal.SIGCONT)
            if not any(self._group_alive(p.pid) for p in self.procs) \
                    or time.monotonic() >= deadline:
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

    def close(self) -> None:
        for fd in self.pidfds:
            if fd is not None:
                os.close(fd)
        shutil.rmtree(self.notes, ignore_errors=True)

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
        job.close()


if __name__ == "__main__":
    sys.exit(main())
