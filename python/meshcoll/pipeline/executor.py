"""Run a pipeline schedule over a ProcessGroup with real sends and receives.

Every rank builds the same `Schedule` and a `PipelineExecutor` for its own
stages, then calls `step()` once per training step. The executor walks the
rank's action list (`schedule.actions(group.rank)`) and, per action:

* ``F s i``: x = inputs[i] on stage 0, else stage s's received (or, when stage
  s-1 is on this rank, handed-over) input; y = stage.forward(i, x). On the last
  stage ``loss_fn(y, targets[i])`` returns (loss, dloss/dy).
* ``B s i``: grad_x = stage.backward(i, grad_y). ``I`` / ``W`` (zero-bubble):
  grad_x = stage.backward_input(i, grad_y), later stage.backward_weight(i).
* ``SEND_F`` / ``SEND_B``: ``isend`` of the activation / input gradient.
* ``RECV_F`` / ``RECV_B``: ``irecv`` into a fresh buffer (``empty``); the
  compute that consumes it waits on it. The builders place each RECV one
  compute ahead of its consumer (Note [Receive lookahead] in schedule.py),
  so the transfer progresses while that compute runs.

Note [Why sends are waited at the end]: a blocking send (or waiting on an
isend right away) to a rank that is itself busy sending can stall on large
arrays, and in a pipeline every rank sends both ways. Here nothing blocks but
a compute waiting for its input, and posted transfers progress in flight
(Note [Serial p2p] in simulate.py), so the executor makes progress exactly
when `simulate` says the schedule does; the constructor plays the schedule
once to make sure. Finished sends are
dropped as the step goes (when the Work can say so); the rest are waited when
the step ends.

Messages carry no header: every rank knows the shape and dtype of the array
crossing each stage boundary from `specs`, one `ArraySpec` per boundary
(boundary s is stage s's output = stage s+1's input; its gradient has the same
spec). On the CPU backend the tag names the boundary, the microbatch and the
direction, so a message that arrives out of the expected order fails loudly in
the transport instead of landing in the wrong buffer.

Note [Channels on NCCL]: NCCL has no tags (messages between two ranks match in
posting order) and runs a communicator's sends and receives one after another
on its stream, so a rank sending an activation while its peer sends a gradient
the other way would block both streams. On the NCCL backend every ordered pair
of neighbouring ranks therefore gets its own two-rank communicator
(``new_group`` in the constructor, collective over the group): data flows one
way on each, so its stream can only wait for the schedule's own dependencies.
Posting order stands in for the tag: a valid schedule posts each channel's
receives in the order of its sends (Note [Channel order] in schedule.py,
checked by `validate` when the executor is built). Arrays stay the caller's GPU arrays:
pass ``empty(shape, dtype)`` to allocate receive buffers (e.g. torch.empty on
the rank's device); stage outputs are sent as they are (contiguous, the
boundary's shape and dtype). Waits order the current stream after a transfer
(no host block); a step's sends are waited, that way, when it ends.

Activation checkpointing (``checkpoint=``): a checkpointed stage keeps nothing of a
microbatch between its forward and its backward but the input: the executor calls
``stage.drop(mb)`` right after ``forward`` (the stage frees what it kept for mb) and, at the
microbatch's ``B`` or ``I``, ``stage.forward(mb, x)`` again (its output unused) before the
backward. Memory per in-flight microbatch becomes its input alone, for a second forward.

Gradients: stages own their parameters and accumulate parameter gradients in
`backward` (or `backward_weight`), summed over the microbatches of a step and
across steps until the caller zeroes them. Scale the loss in `loss_fn` (e.g.
divide by the number of microbatches) to get a mean. If a send or receive
fails the step raises; as with every collective, the group is then dead and
must be rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple,
                    Union, cast)

import numpy as np

from ..arrays import dtype_name
from .schedule import Action, Kind, Schedule, from_compute_orders
from .simulate import timeline

__all__ = ["ArraySpec", "Stage", "SplitStage", "PipelineExecutor"]


@dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype of the array crossing one stage boundary."""

    shape: Tuple[int, ...]
    dtype: Any = np.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        try:
            object.__setattr__(self, "dtype", np.dtype(self.dtype))
        except TypeError:
            pass  # a framework's dtype (torch.float32), for GPU arrays: kept as given


class Stage(Protocol):
    """What a schedule with plain ``B`` actions calls on a stage."""

    def forward(self, mb: int, x: np.ndarray) -> np.ndarray:
        """Return the stage output; keep whatever backward needs, keyed by mb."""

    def backward(self, mb: int, grad_y: np.ndarray) -> Optional[np.ndarray]:
        """Accumulate parameter gradients; return the gradient w.r.t. x (ignored on stage 0)."""


class SplitStage(Stage, Protocol):
    """A zero-bubble schedule (``I`` and ``W`` actions) calls these instead of backward."""

    def backward_input(self, mb: int, grad_y: np.ndarray) -> Optional[np.ndarray]:
        """Return the gradient w.r.t. x; keep what backward_weight needs."""

    def backward_weight(self, mb: int) -> None:
        """Accumulate parameter gradients for mb and drop what was kept for it."""


LossFn = Callable[[np.ndarray, Any], Tuple[float, np.ndarray]]


class PipelineExecutor:
    """Runs `schedule` on this rank's stages over `group` (see the module docstring).

    stage_fns: {stage: Stage} for exactly the stages this rank owns
        (``schedule.stages_of(group.rank)``).
    specs: one ArraySpec for every boundary, or a list of num_stages - 1 of
        them (boundary s = output of stage s). Not needed with one rank.
    loss_fn: ``loss_fn(y, target) -> (loss, grad_y)``; required on the rank
        that owns the last stage.
    timeout: seconds passed to every ``Work.wait`` (None: the group's default).
    empty: ``empty(shape, dtype) -> array`` allocating receive buffers (default:
        numpy; required on the NCCL backend, see Note [Channels on NCCL]).
    checkpoint: True (every stage of this rank) or the stages whose forward is recomputed
        in backward (activation checkpointing, see the module docstring); each needs
        ``drop(mb)``.
    """

    def __init__(self, schedule: Schedule, stage_fns: Mapping[int, Stage], group: Any,
                 specs: Union[ArraySpec, Sequence[ArraySpec], None] = None,
                 loss_fn: Optional[LossFn] = None, timeout: Optional[float] = None,
                 empty: Optional[Callable[[Tuple[int, ...], Any], Any]] = None,
                 checkpoint: Union[bool, Sequence[int]] = False) -> None:
        if getattr(group, "backend_name", "cpu") == "nccl":
            # NCCL runs each point-to-point transfer as a kernel on the group's stream, in
            # posting order: a receive posted ahead of a send the peer waits for blocks that
            # send (a hang, found on 2 H100s). Receives go right before their consumer there
            # (Note [Receive lookahead]: lookahead 0).
            orders = [schedule.compute_actions(r) for r in range(schedule.num_ranks)]
            schedule = from_compute_orders(schedule.name, orders, schedule.num_microbatches,
                                           schedule.virtual_stages, schedule.placement,
                                           recv_lookahead=0)
        # Validate and play the schedule once (unit costs) so that a malformed or
        # deadlocking custom schedule fails here, by name, instead of hanging.
        timeline(schedule, lambda a: 1.0)
        if group.size != schedule.num_ranks:
            raise ValueError(f"{schedule.name} schedule has {schedule.num_ranks} ranks but the group "
                             f"has {group.size}")
        self.schedule, self.group, self.timeout = schedule, group, timeout
        self.rank = group.rank
        self.num_stages = schedule.num_stages
        mine = schedule.stages_of(self.rank)
        if sorted(stage_fns) != mine:
            raise ValueError(f"rank {self.rank} owns stages {mine} ({schedule.describe_placement()}); "
                             f"stage_fns has {sorted(stage_fns)}")
        self.stages = dict(stage_fns)
        if schedule.uses_split_backward:
            for s, fn in self.stages.items():
                missing = [n for n in ("backward_input", "backward_weight")
                           if not callable(getattr(fn, n, None))]
                if missing:
                    raise TypeError(f"{schedule.name} splits the backward: stage {s} needs "
                                    f"{' and '.join(missing)}")
        self.checkpointed = set(mine) if checkpoint is True else \
            set() if checkpoint is False else {int(c) for c in checkpoint}
        if not self.checkpointed <= set(mine):
            raise ValueError(f"checkpoint names stages {sorted(self.checkpointed - set(mine))} "
                             f"that rank {self.rank} does not own (it owns {mine})")
        for s in sorted(self.checkpointed):
            if not callable(getattr(self.stages[s], "drop", None)):
                raise TypeError(f"checkpoint: stage {s} needs drop(mb), which frees what its "
                                "forward kept for mb (its backward recomputes the forward)")
        self.specs = self._normalize_specs(specs)
        self.last_stage = self.num_stages - 1
        if self.last_stage in self.stages and loss_fn is None:
            raise ValueError(f"rank {self.rank} owns the last stage ({self.last_stage}) and needs loss_fn")
        self.loss_fn = loss_fn
        self._actions = schedule.actions(self.rank)
        self._host = getattr(group, "backend_name", "cpu") != "nccl"
        if not self._host and self.specs and empty is None:
            raise ValueError("PipelineExecutor on the NCCL backend needs empty=, e.g. "
                             "lambda shape, dtype: torch.empty(shape, dtype=dtype, device='cuda')")
        self._empty = empty or (lambda shape, dtype: np.empty(shape, dtype))
        # (sending rank, receiving rank) -> two-rank group: Note [Channels on NCCL].
        self._channels: Dict[Tuple[int, int], Any] = {}
        if not self._host and self.specs:
            # A V's turn (stages p-1, p on one rank) hands over locally: no channel.
            links = {(self._peer(b), self._peer(b + 1)) for b in range(self.num_stages - 1)
                     if self._peer(b) != self._peer(b + 1)}
            for src, dst in sorted(links | {(d, s) for s, d in links}):
                # Collective over the group; src is the child's rank 0, dst its rank 1.
                g = group.new_group([group.ranks[src], group.ranks[dst]], timeout=timeout)
                if self.rank in (src, dst):
                    self._channels[(src, dst)] = g

    def _normalize_specs(self, specs: Union[ArraySpec, Sequence[ArraySpec], None]) -> List[ArraySpec]:
        n = self.num_stages - 1
        if self.schedule.num_ranks == 1:
            return []  # every hand-over is local; nothing crosses the wire
        if specs is None:
            raise ValueError("specs (the ArraySpec of each stage boundary) is required with "
                             "more than one rank")
        if isinstance(specs, ArraySpec):
            return [specs] * n
        specs = list(specs)
        if len(specs) != n or not all(isinstance(s, ArraySpec) for s in specs):
            raise ValueError(f"specs must be one ArraySpec or a list of {n} (one per stage boundary), "
                             f"got {specs!r}")
        return specs

    # ------------------------------------------------------------------

    def _peer(self, stage: int) -> int:
        return self.schedule.stage_rank(stage)

    def _tag(self, boundary: int, mb: int, backward: bool) -> int:
        return 2 * (boundary * self.schedule.num_microbatches + mb) + int(backward)

    def _wire_array(self, y: Any, boundary: int, what: str, stage: int, mb: int) -> Any:
        spec = self.specs[boundary]
        arr = np.ascontiguousarray(y) if self._host else y
        if tuple(arr.shape) != spec.shape or dtype_name(arr.dtype) != dtype_name(spec.dtype):
            raise ValueError(f"stage {stage} microbatch {mb} produced {what} of shape "
                             f"{tuple(arr.shape)} {dtype_name(arr.dtype)}; boundary {boundary} is "
                             f"declared {spec.shape} {dtype_name(spec.dtype)}")
        return arr

    def _route(self, peer_stage: int, sending: bool, tag: int) -> Tuple[Any, int, int]:
        """(group, peer's rank in it, tag) of one message to or from ``peer_stage``."""
        peer = self._peer(peer_stage)
        if self._host:
            return self.group, peer, tag
        if sending:
            return self._channels[(self.rank, peer)], 1, 0
        return self._channels[(peer, self.rank)], 0, 0

    def step(self, inputs: Optional[Sequence[np.ndarray]] = None,
             targets: Optional[Sequence[Any]] = None) -> Optional[List[float]]:
        """Run one step. inputs[i] feeds stage 0 (needed on its rank), targets[i]
        goes to loss_fn (on the last stage's rank). Returns the m losses on the
        last stage's rank, None elsewhere."""
        m = self.schedule.num_microbatches
        if 0 in self.stages and (inputs is None or len(inputs) != m):
            raise ValueError(f"rank {self.rank} owns stage 0 and needs {m} inputs, got "
                             f"{None if inputs is None else len(inputs)}")
        owns_last = self.last_stage in self.stages
        if owns_last and targets is not None and len(targets) != m:
            raise ValueError(f"targets has {len(targets)} entries for {m} microbatches")

        timeout = self.timeout
        outputs: Dict[Tuple[int, int], np.ndarray] = {}  # (stage, mb) -> output not yet sent/consumed
        grads: Dict[Tuple[int, int], np.ndarray] = {}    # (stage, mb) -> input grad not yet sent/consumed
        loss_grads: Dict[int, np.ndarray] = {}
        recvs: Dict[Action, Tuple[np.ndarray, Any]] = {}
        sends: List[Tuple[Any, np.ndarray]] = []         # Note [Why sends are waited at the end]
        losses: List[float] = [float("nan")] * m
        kept: Dict[Tuple[int, int], Any] = {}            # checkpointed (stage, mb) -> its input

        def take(recv: Action) -> np.ndarray:
            buf, work = recvs.pop(recv)
            work.wait(timeout)
            return buf

        def send(arr: Any, route: Tuple[Any, int, int]) -> None:
            # Drop sends the transport has finished, so a long step does not pin
            # every activation it ever sent.
            sends[:] = [(w, a) for w, a in sends
                        if not (callable(getattr(w, "is_completed", None)) and w.is_completed())]
            g, peer, tag = route
            sends.append((g.isend(arr, peer, tag=tag), arr))

        def recv(spec: ArraySpec, route: Tuple[Any, int, int]) -> Tuple[Any, Any]:
            buf = self._empty(spec.shape, spec.dtype)
            g, peer, tag = route
            return buf, g.irecv(buf, peer, tag=tag)

        for a in self._actions:
            s, i, kind = a.stage, a.microbatch, a.kind
            if kind is Kind.RECV_F:
                recvs[a] = recv(self.specs[s - 1], self._route(s - 1, False, self._tag(s - 1, i, False)))
            elif kind is Kind.RECV_B:
                recvs[a] = recv(self.specs[s], self._route(s + 1, False, self._tag(s, i, True)))
            elif kind is Kind.F:
                if s == 0:
                    assert inputs is not None  # this rank owns stage 0: checked above
                    x = inputs[i]
                elif self._peer(s - 1) == self.rank:
                    x = outputs.pop((s - 1, i))
                else:
                    x = take(Action(s, Kind.RECV_F, i))
                y = self.stages[s].forward(i, x)
                if s in self.checkpointed:
                    self.stages[s].drop(i)  # type: ignore[attr-defined]  # checked when built
                    kept[(s, i)] = x
                if s == self.last_stage:
                    # The constructor requires loss_fn on the last stage's rank.
                    assert self.loss_fn is not None
                    loss, loss_grads[i] = self.loss_fn(y, None if targets is None else targets[i])
                    losses[i] = float(loss)
                else:
                    outputs[(s, i)] = y
            elif kind in (Kind.B, Kind.I):
                if s == self.last_stage:
                    g = loss_grads.pop(i)
                elif self._peer(s + 1) == self.rank:
                    g = grads.pop((s + 1, i))
                else:
                    g = take(Action(s, Kind.RECV_B, i))
                fn = self.stages[s]
                if (s, i) in kept:  # checkpointed: the forward again, for what backward needs
                    fn.forward(i, kept.pop((s, i)))
                # I and W come only from split-backward schedules, whose stages the
                # constructor checked for backward_input and backward_weight.
                gx = (fn.backward(i, g) if kind is Kind.B
                      else cast(SplitStage, fn).backward_input(i, g))
                if s > 0:
                    if gx is None:
                        raise ValueError(f"stage {s} returned no input gradient for microbatch {i}")
                    grads[(s, i)] = gx
            elif kind is Kind.W:
                cast(SplitStage, self.stages[s]).backward_weight(i)
            elif kind is Kind.SEND_F:
                arr = self._wire_array(outputs.pop((s, i)), s, "an activation", s, i)
                send(arr, self._route(s + 1, True, self._tag(s, i, False)))
            elif kind is Kind.SEND_B:
                arr = self._wire_array(grads.pop((s, i)), s - 1, "an input gradient", s, i)
                send(arr, self._route(s - 1, True, self._tag(s - 1, i, True)))
            else:  # pragma: no cover - validate() admits no other kind
                raise AssertionError(f"unhandled action {a}")

        for work, _ in sends:
            work.wait(timeout)
        # A validated schedule consumes everything it produces; leftovers mean a bug here.
        leftover = list(outputs) + list(grads) + list(loss_grads) + list(recvs) + list(kept)
        if leftover:
            raise AssertionError(f"rank {self.rank}: step ended with unconsumed {leftover}")
        return losses if owns_last else None
