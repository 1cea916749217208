"""monitored_barrier: a barrier that says who is missing.

It goes through the rendezvous store, not through the group's connections, so it still works
when those are broken or a peer is stuck inside another collective: a hung job can call it
to learn which ranks never got there (PyTorch's ``monitored_barrier``, without its rank-0
bottleneck: every rank reads every key itself).
"""

from __future__ import annotations

import math
from typing import List, Optional, Union

from . import _C
from .process_group import NonMemberGroup, ProcessGroup


def monitored_barrier(group: Optional[Union[ProcessGroup, NonMemberGroup]] = None,
                      timeout: float = 30.0) -> None:
    """Block until every member of ``group`` (default: the world) has called this, or raise
    ``meshcoll.TimeoutError`` after ``timeout`` seconds naming the global ranks that did not
    arrive. Every member calls it the same number of times; it sends nothing over the
    group's transport, so the group may even be aborted.

    Each call n sets the store key ``monitored/<group name>/<n>/<global rank>`` and waits for
    the keys of all members. If every key turns out to be present once the wait has timed
    out (the last rank arrived just late), the barrier is complete and the call returns, as
    it does on the ranks whose wait succeeded, so that all ranks take the same branch."""
    if group is None:
        from .world import get_world_group
        group = get_world_group()
    if not getattr(group, "is_member", False):
        raise RuntimeError(f"monitored_barrier: this rank is not a member of group "
                           f"{group.name} (members: global ranks {list(group.ranks)})")
    assert not isinstance(group, NonMemberGroup)  # its is_member is False: raised above
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"monitored_barrier: timeout must be a finite number of seconds > 0, "
                         f"got {timeout!r}")
    store = group._store
    n = getattr(group, "_monitored_calls", 0)
    group._monitored_calls = n + 1
    ranks: List[int] = list(group.ranks)
    me = ranks[group.rank]

    def key(call: int, r: int) -> str:
        return f"monitored/{group.name}/{call}/{r}"

    store.set(key(n, me), b"1", timeout)  # bounded even if the store's host is stopped
    keys = [key(n, r) for r in ranks]
    try:
        store.wait(keys, timeout)
    except _C.TimeoutError:
        missing = [r for r, k in zip(ranks, keys) if not store.check([k], timeout)]
        if missing:
            who = ", ".join(str(r) for r in missing)
            raise _C.TimeoutError(
                f"monitored_barrier #{n} on group {group.name!r}, seen from global rank {me}: "
                f"global rank{'s' if len(missing) > 1 else ''} {who} did not reach it within "
                f"{timeout:g} s (members: global ranks {ranks}); they are slow, stuck in "
                f"other code (a collective?), or dead") from None
    # Note [Monitored-barrier keys]
    # Once call n passed here, every member has set its key of call n, so every member has
    # left call n-1 (passed or raised): nobody can still be waiting for our key of call n-1,
    # and we may delete it. The store thus holds at most two keys per member and group.
    if n > 0:
        store.delete_key(key(n - 1, me))


__all__ = ["monitored_barrier"]
