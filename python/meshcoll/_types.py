"""The names the API's string arguments take, as ``Literal`` types, so that a type checker
rejects a misspelt one (``all_reduce(x, op="summ")``) before anything runs. Pure Python,
no compiled module; tests/python/test_typing.py checks them against the core's own lists.
Public as ``meshcoll.ReduceOpName``, ``meshcoll.AlgorithmName`` and ``meshcoll.BackendName``,
for annotating a variable that is passed on (``op: meshcoll.ReduceOpName = "max"``)."""

from typing import Literal

# Reductions: band, bor and bxor take integer and bool arrays only.
ReduceOpName = Literal["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]
# all_reduce algorithms of the CPU backend ("shm": shared-memory groups only).
AlgorithmName = Literal["auto", "ring", "tree", "halving_doubling", "direct", "shm",
                        "centralized"]
# What a group runs on; meshcoll.init also takes "auto" (nccl where every rank can).
BackendName = Literal["cpu", "nccl", "mpi"]
