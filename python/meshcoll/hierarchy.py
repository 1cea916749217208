"""Collectives for groups that span hosts: shared memory inside each host, TCP (or, for an MPI
group, MPI) between hosts.

Note [Hierarchy]
The transport is chosen per group: a group whose members sit on several hosts talks TCP
between all of them, so a flat all_reduce sends every byte over TCP even between ranks that
share a host. When such a group has a host with two or more members, it builds two children
at creation (collective, through ``split``): ``local``, the members on this host (shared
memory), and ``leaders``, the lowest group rank of each host (TCP). all_reduce then runs as

    local all_reduce (shm)  ->  leaders all_reduce (TCP)  ->  local broadcast from the leader

so TCP carries one copy per host instead of one per rank, and the ranks of a host finish
with the leader's bytes: every rank ends with bitwise the same result. ``avg`` reduces with
``sum`` and divides at the end with the same kernel as a flat avg (ints truncate). In the
same way:

    broadcast:   on the root's host, local broadcast from the root; leaders broadcast from
                 that host's leader; on the other hosts, local broadcast from the leader
    all_gather:  local gather to the leader; leaders all_gather_v of the host blocks (hosts
                 may differ in size), put in group-rank order; local broadcast of the result

Order. The steps run on other communicators than the group's, so their order must be the
same on every rank. Each hierarchical call is therefore ONE operation on the group's own
communicator (``CpuBackend.set_hierarchy``, csrc/cpu/hierarchy.cc), issued like any other
collective: the group's one issue order places it among the group's flat collectives, and
async calls run on the group's worker thread. The operation's body runs the steps as
synchronous calls on ``local`` and ``leaders``. Nothing else calls those two groups, so they
are idle and each step runs inline on the thread of the group's operation. One scheduler
(the group's) instead of a second FIFO and thread here, which had to be kept in step with
the first.

Failures. Each step gets what is left of the operation's deadline; an error in any step is
the operation's error. The failed step's group tells its own ranks (as any collective does),
and before the error leaves the operation the rank fails both children (``Backend.fail``),
so the ranks waiting in the other child raise PeerError at once instead of at their
timeout. The group itself fails as after any failed operation. A step's timeout takes no
census of its own: the group's census, over every host, names the rank that never came, and
the step's message leaves blame to it (Note [Blame in a composed call's timeout] in
hierarchy.cc). While the steps wait they also read the group's own links, where a rank that
made a flat call instead sends its frames (Note [Steps watch their call's group] in
csrc/common/interrupt.h): a MismatchError at once, not a timeout on every rank.

An MPI group spanning hosts uses this hierarchy whole: ``local`` is a CPU group, ``leaders``
the MPI group of the leaders, and the operation above runs on a CPU group of the MPI group's
ranks, to which the MPI group hands each such call (Note [Hierarchy on MPI] in
csrc/mpi/mpi_backend.h).
"""

from __future__ import annotations

import hashlib
from typing import Callable, List, Optional, Union

import numpy as np

from . import _C
from .process_group import NonMemberGroup, ProcessGroup


def host_of_each_rank(group: ProcessGroup) -> List[int]:
    """Collective over ``group``: for each group rank, the index of its host (hosts numbered
    in order of their first rank). A host is what ``_C.host_identity()`` names."""
    me = hashlib.blake2b(_C.host_identity().encode(), digest_size=8).digest()
    ids = [int(i) for i in group.all_gather(np.frombuffer(me, np.int64).copy()).ravel()]
    order = list(dict.fromkeys(ids))
    return [order.index(i) for i in ids]


class Hierarchy:
    """The ``local`` and ``leaders`` children of a multi-host group (Note [Hierarchy])."""

    def __init__(self, local: ProcessGroup, leaders: Union[ProcessGroup, NonMemberGroup],
                 hosts: List[int]) -> None:
        self.local, self.leaders = local, leaders
        self.hosts = hosts  # host index of each group rank; leader i is host i's

    @classmethod
    def build(cls, group: ProcessGroup, hosts: List[int],
              composer: Optional[Callable[[], _C.CpuBackend]] = None) -> Optional["Hierarchy"]:
        """Collective over ``group`` (``hosts`` from host_of_each_rank): splits the children
        and hands them to the group's backend, which runs the steps from then on. None when
        no host holds two members. ``local`` is always a CPU group (shared memory);
        ``leaders`` is of the group's backend. A CPU group runs the steps itself; an MPI
        group hands them to a CPU group of its ranks that ``composer`` makes (Note [Hierarchy
        on MPI] in csrc/mpi/mpi_backend.h)."""
        if max(hosts.count(h) for h in set(hosts)) < 2:
            return None
        local = group._split(hosts[group.rank], group.rank, None, None, kind="cpu")
        # Every rank's color is its host's index (>= 0): it is a member of its local group.
        assert isinstance(local, ProcessGroup)
        leaders = group.split(0 if local.rank == 0 else None, key=group.rank)
        runner = group._cpu_backend() if composer is None else composer()
        runner.set_hierarchy(local._cpu_backend(),
                             leaders._backend if isinstance(leaders, ProcessGroup) else None,
                             hosts)
        if composer is not None:
            group._mpi_backend().set_hierarchy(runner)
        return cls(local, leaders, hosts)
