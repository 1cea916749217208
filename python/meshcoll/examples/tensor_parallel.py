"""Megatron-style tensor parallelism for one MLP block, checked against one process:

    meshcoll-run -n 4 -m meshcoll.examples.tensor_parallel [--tp 2] [--dtype float32]

The block is ``O = GeLU(X A) B`` with X (batch, hidden), A (hidden, ffn) and B (ffn,
hidden). A is split by columns and B by rows across the tp group, so rank i holds
``A[:, s_i]`` and ``B[s_i, :]`` for the same range ``s_i`` of the ffn dim, and computes

    forward    Z_i = X A_i    Y_i = GeLU(Z_i)    O = all_reduce(Y_i B_i)
    backward   dB_i = Y_i^T dO    dZ_i = (dO B_i^T) * GeLU'(Z_i)    dA_i = X^T dZ_i
               dX = all_reduce(dZ_i A_i^T)

with no communication between the two matmuls: GeLU is elementwise, so each rank's
columns of Y need only its own columns of A. One all_reduce ends the forward and one
ends the backward (Megatron's f and g operators). The ffn size defaults to a prime (29)
so the split is uneven on any tp group and exercises the balanced split of
``meshcoll.shard``. The sequence-parallel form (reduce-scatter over the batch, then
all-gather) must give the same O, and is checked too.

With ``--tp`` smaller than the world, ranks form a (dp, tp) DeviceMesh; each dp replica
draws its own batch. Every rank compares its results with the unsharded computation
and rank 0 prints the largest relative error over all ranks.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

import meshcoll
from meshcoll.device_mesh import init_device_mesh
from meshcoll.partition import partition_range, reduce_scatter_dim, shard
from meshcoll.process_group import ProcessGroup

# Relative to the largest entry of each reference tensor. float64 lands near 1e-16; the
# float32 bound leaves room for matmul reassociation across the split.
TOLERANCE = {"float64": 1e-10, "float32": 1e-4}

# Python floats, not numpy scalars: under numpy's promotion rules (NEP 50) a np.float64
# scalar would silently turn float32 arithmetic into float64.
_C0 = math.sqrt(2.0 / math.pi)
_C1 = 0.044715


def gelu(z: np.ndarray) -> np.ndarray:
    """GeLU, tanh approximation (as in GPT-2 and Megatron)."""
    out: np.ndarray = 0.5 * z * (1.0 + np.tanh(_C0 * (z + _C1 * z ** 3)))
    return out


def gelu_grad(z: np.ndarray) -> np.ndarray:
    t = np.tanh(_C0 * (z + _C1 * z ** 3))
    out: np.ndarray = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _C0 * (1.0 + 3.0 * _C1 * z * z)
    return out


def make_problem(batch: int, hidden: int, ffn: int, dtype: str, seed: int,
                 replica: int = 0) -> Dict[str, np.ndarray]:
    """Weights from ``seed`` (the same on every rank); X and dO also from ``replica``."""
    w = np.random.default_rng(seed)
    d = np.random.default_rng([seed, replica])
    return {"A": (w.standard_normal((hidden, ffn)) / np.sqrt(hidden)).astype(dtype),
            "B": (w.standard_normal((ffn, hidden)) / np.sqrt(ffn)).astype(dtype),
            "X": d.standard_normal((batch, hidden)).astype(dtype),
            "dO": d.standard_normal((batch, hidden)).astype(dtype)}


def reference(p: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Forward and backward of the whole block in this process."""
    X, A, B, dO = p["X"], p["A"], p["B"], p["dO"]
    Z = X @ A
    Y = gelu(Z)
    dZ = (dO @ B.T) * gelu_grad(Z)
    return {"O": Y @ B, "dX": dZ @ A.T, "dA": X.T @ dZ, "dB": Y.T @ dO}


def tensor_parallel(p: Dict[str, np.ndarray],
                    tp: ProcessGroup) -> Tuple[Dict[str, Any], np.ndarray]:
    """The block across ``tp``: returns sharded and replicated results, and this rank's
    partial O (before the all_reduce) for the sequence-parallel check."""
    X, dO = p["X"], p["dO"]
    A = shard(p["A"], dim=-1, group=tp)   # columns s_i of A
    B = shard(p["B"], dim=0, group=tp)    # rows s_i of B: the same range
    # forward
    Z = X @ A.local
    Y = gelu(Z)
    partial = Y @ B.local
    O = tp.all_reduce(partial.copy())
    # backward
    dB = Y.T @ dO
    dZ = (dO @ B.local.T) * gelu_grad(Z)
    dA = X.T @ dZ
    dX = tp.all_reduce(dZ @ A.local.T)
    # A weight's gradient is sharded exactly as the weight is.
    return {"O": O, "dX": dX, "dA": replace(A, local=dA), "dB": replace(B, local=dB)}, partial


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (0 for empty shards)."""
    if got.shape != want.shape:
        raise ValueError(f"shape {got.shape} != reference shape {want.shape}")
    if want.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(want))), np.finfo(np.float64).tiny)
    return float(np.max(np.abs(got - want))) / scale


def run(world: ProcessGroup, tp_size: Optional[int] = None, batch: int = 5, hidden: int = 8,
        ffn: int = 29,
        dtype: str = "float64", seed: int = 0, verbose: bool = True) -> float:
    """Run the block on ``world`` (tp over all of it, or a (dp, tp) mesh when ``tp_size``
    is smaller); return this rank's largest relative error against the reference."""
    tp_size = world.size if tp_size is None else tp_size
    if tp_size < 1 or world.size % tp_size:
        raise ValueError(f"tp size {tp_size} does not divide the world size {world.size}")
    if tp_size == world.size:
        tp, replica = world, 0
    else:
        mesh = init_device_mesh((world.size // tp_size, tp_size), ("dp", "tp"), group=world)
        tp, replica = mesh.get_group("tp"), mesh.get_local_rank("dp")

    p = make_problem(batch, hidden, ffn, dtype, seed, replica)
    ref = reference(p)
    got, partial = tensor_parallel(p, tp)
    for name in ("O", "dX"):
        if got[name].dtype != np.dtype(dtype):
            raise TypeError(f"{name} came out {got[name].dtype}, not {dtype}")
    start, stop = partition_range(ffn, tp.size, tp.rank)

    errs = {"O": rel_err(got["O"], ref["O"]), "dX": rel_err(got["dX"], ref["dX"]),
            "dA shard": rel_err(got["dA"].local, ref["dA"][:, start:stop]),
            "dB shard": rel_err(got["dB"].local, ref["dB"][start:stop])}
    # Gathering the weight-gradient shards rebuilds the unsharded gradients.
    errs["dA gathered"] = rel_err(got["dA"].all_gather(), ref["dA"])
    errs["dB gathered"] = rel_err(got["dB"].all_gather(), ref["dB"])
    # Sequence parallelism: all_reduce = reduce-scatter over the batch + all-gather.
    errs["O seq-par"] = rel_err(reduce_scatter_dim(partial, dim=0, group=tp).all_gather(),
                                ref["O"])
    worst = max(errs.values())
    if verbose:
        print(f"rank {world.rank} (dp {replica}, tp {tp.rank}/{tp.size}): ffn cols "
              f"[{start}, {stop}) of {ffn}; max rel err {worst:.2e} "
              f"({', '.join(f'{k} {v:.1e}' for k, v in errs.items())})", flush=True)
    return worst


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None, help="tp group size (default: all ranks)")
    parser.add_argument("--batch", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=29, help="split dim; prime by default")
    parser.add_argument("--dtype", default="float64", choices=sorted(TOLERANCE))
    args = parser.parse_args(argv)

    world = meshcoll.init()
    try:
        tp = args.tp or world.size
        if tp < 1 or world.size % tp:
            # Every rank stops here; the barrier first lets them all finish joining.
            world.barrier()
            if world.rank == 0:
                print(f"tensor_parallel: --tp {tp} must divide the world size {world.size}",
                      file=sys.stderr, flush=True)
            return 2
        err = run(world, tp, args.batch, args.hidden, args.ffn, args.dtype)
        worst = float(world.all_reduce(np.array([err]), op="max")[0])
        tol = TOLERANCE[args.dtype]
        if world.rank == 0:
            print(f"{'OK' if worst < tol else 'FAILED'}: GeLU(X A) B with tp={tp} "
                  f"(dp={world.size // tp}), {args.dtype}, X ({args.batch}, {args.hidden}), "
                  f"ffn {args.ffn}: max relative error vs unsharded = {worst:.2e} "
                  f"(tolerance {tol:g})", flush=True)
    finally:
        meshcoll.destroy()
    return 0 if worst < tol else 1


if __name__ == "__main__":
    sys.exit(main())
