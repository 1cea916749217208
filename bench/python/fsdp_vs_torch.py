"""meshcoll.torch.fully_shard against torch's sharded or replicated data parallel, in the
same processes, on the same model, data and optimizer:

    NCCL_NVLS_ENABLE=0 meshcoll-run -n 2 bench/python/fsdp_vs_torch.py        # GPUs: vs fully_shard
    NCCL_NVLS_ENABLE=0 meshcoll-run -n 4 bench/python/fsdp_vs_torch.py --layers 24 --width 2048
    meshcoll-run -n 2 bench/python/fsdp_vs_torch.py --backend cpu             # CPU: vs DDP, Gloo
    meshcoll-run -n 2 bench/python/fsdp_vs_torch.py --backend cpu --model mlp --steps 3

Each process joins meshcoll's world (``meshcoll.init``) and torch.distributed (NCCL on GPUs,
Gloo with ``--backend cpu``, through a second port rank 0 picks and sends over meshcoll).

``--backend nccl`` (the default with CUDA): the transformer of the DDP issue, ``--layers``
(12) x ``TransformerEncoderLayer(--width 1024, --heads 16, 4 x width, dropout=0,
batch_first=True)`` + ``Linear(width, --classes 1000)``, 152M parameters, a batch of 8 x 256
random tokens per rank. Both wrappers shard each layer as a unit, then the root, with the same
mixed-precision policy (bf16 parameters in forward and backward, fp32 shards; ``--reduce``
fp32 or bf16 gradients), ``--stage`` 3 (meshcoll; torch's fully_shard is stage 3).
``--backend cpu``: meshcoll's fully_shard (``--stage``, float32) against torch's
DistributedDataParallel on Gloo; ``--model mlp`` (``--layers`` x Linear(width, width) + Tanh,
width 256) or a small transformer (``--width 64``, 2 layers unless given).

Steps alternate meshcoll, torch, meshcoll, ...: ``--warmup`` pairs, then ``--steps`` timed
pairs, each after an untimed barrier (``--align on``) so both start with the ranks together.
A step (zero_grad, forward, loss, backward, optimizer step, ``--optimizer`` adamw or sgd) is
timed with ``time.perf_counter``, ended by ``torch.cuda.synchronize()`` on GPUs; its time is
the slowest rank's and the table shows the median. Memory (GPUs): before the timed steps each
wrapper is built and stepped 2 times alone, from a model on the CPU, with
``torch.cuda.reset_peak_memory_stats`` before: ``peak MiB`` is ``max_memory_allocated`` over
those steps less what was allocated before it was built (the other wrapper's state stays
constant meanwhile), ``state MiB`` what stays allocated after a step (parameters, gradients,
optimizer state), and ``expect MiB`` 1/N of the unsharded parameters, gradients and AdamW
state (16 bytes a parameter) plus one layer's gathered bf16 parameters. ``max rel diff``:
max over parameters of ||a - b|| / ||b|| after the steps (rank 0): 0 on 2 ranks in float32
(a sum of two adds in one order only); on more ranks the sums round in another order than
torch's, about 1e-7 with SGD, but AdamW turns the rounding noise of gradients that are zero
in exact arithmetic (attention's key bias) into steps of the learning rate (1e-3 on 4 CPU
ranks). ``--json FILE`` writes one record per row.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, List, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import meshcoll  # noqa: E402
import meshcoll.torch as mct  # noqa: E402

MiB = float(1 << 20)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("nccl", "cpu"), default=None)
    p.add_argument("--model", choices=("transformer", "mlp"), default="transformer")
    p.add_argument("--layers", type=int, default=None, help="12 (nccl) / 2 (cpu)")
    p.add_argument("--width", type=int, default=None, help="1024 (nccl) / 64 (cpu transformer) "
                   "/ 256 (mlp)")
    p.add_argument("--heads", type=int, default=None, help="16 (nccl) / 4 (cpu)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sample: 256 (nccl) / 16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--classes", type=int, default=None, help="1000 (nccl) / 10 (cpu)")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    p.add_argument("--reduce", choices=("fp32", "bf16"), default="fp32",
                   help="gradient reduction dtype under bf16 mixed precision (GPUs)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--align", choices=("on", "off"), default="on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    if a.backend is None:
        a.backend = "nccl" if torch.cuda.is_available() else "cpu"
    gpu = a.backend == "nccl"
    a.layers = a.layers or (12 if gpu else 2)
    a.width = a.width or (1024 if gpu else (256 if a.model == "mlp" else 64))
    a.heads = a.heads or (16 if gpu else 4)
    a.seq = a.seq or (256 if gpu else 16)
    a.classes = a.classes or (1000 if gpu else 10)
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return a


class Model(nn.Module):
    """``layers`` blocks then a head; the blocks are the sharded units."""

    def __init__(self, args) -> None:
        super().__init__()
        w = args.width
        if args.model == "transformer":
            self.blocks = nn.ModuleList([
                nn.TransformerEncoderLayer(w, args.heads, 4 * w, dropout=0.0, batch_first=True)
                for _ in range(args.layers)])
        else:
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(w, w), nn.Tanh())
                                         for _ in range(args.layers)])
        self.head = nn.Linear(w, args.classes)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def init(args) -> Tuple[Any, torch.device]:
    """meshcoll's world group and torch.distributed's, as ddp_vs_torch.py joins them."""
    from ddp_vs_torch import init as join_both  # this folder: the script's sys.path[0]
    return join_both(args)


def wrap(name: str, base: nn.Module, args, device: torch.device) -> nn.Module:
    model = copy.deepcopy(base).to(device)
    gpu = device.type == "cuda"
    if name == "torch" and not gpu:
        return nn.parallel.DistributedDataParallel(model)
    if name == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=_reduce(args))
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp)
        return fully_shard(model, mesh=mesh, mp_policy=mp)
    mp = mct.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=_reduce(args)) \
        if gpu else None
    for b in model.blocks:
        mct.fully_shard(b, stage=args.stage, mp_policy=mp)
    return mct.fully_shard(model, stage=args.stage, mp_policy=mp)


def _reduce(args) -> torch.dtype:
    return torch.float32 if args.reduce == "fp32" else torch.bfloat16


class Runner:
    def __init__(self, name: str, model: nn.Module, args) -> None:
        self.name, self.model = name, model
        params = model.parameters()
        self.opt = (torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
                    if args.optimizer == "adamw" else torch.optim.SGD(params, lr=0.01))
        self.times: List[float] = []

    def step(self, x, y, sync: Callable[[], None], record: bool) -> None:
        t0 = time.perf_counter()
        self.opt.zero_grad()
        out = self.model(x)
        loss = nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        self.opt.step()
        sync()
        if record:
            self.times.append(time.perf_counter() - t0)


def full_params(name: str, model: nn.Module) -> Dict[str, torch.Tensor]:
    if name == "meshcoll":
        return {k: v.float().cpu() for k, v in model.full_state_dict().items()
                if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
            for k, v in model.named_parameters()}


def max_rel_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for k, vb in b.items():
        nb = float(torch.linalg.vector_norm(vb))
        d = float(torch.linalg.vector_norm(a[k] - vb))
        worst = max(worst, d / nb if nb > 0 else d)
    return worst


def slowest(values: List[float], device: torch.device) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def main(argv=None) -> int:
    args = parse_args(argv)
    pg, device = init(args)
    gpu = device.type == "cuda"
    torch.manual_seed(args.seed)
    base = Model(args)
    nparams = sum(p.numel() for p in base.parameters())
    unit = max(sum(p.numel() for p in b.parameters()) for b in base.blocks)
    g = torch.Generator().manual_seed(1000 + pg.rank)
    shape = (args.batch, args.seq, args.width) if args.model == "transformer" else \
        (args.batch * args.seq, args.width)
    batches = [(torch.randn(shape, generator=g).to(device),
                torch.randint(0, args.classes, shape[:-1], generator=g).to(device))
               for _ in range(4)]
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    row: Dict[str, Any] = dict(bench="fsdp_vs_torch", backend=args.backend, model=args.model,
                               params=nparams, ranks=pg.size, stage=args.stage,
                               optimizer=args.optimizer, steps=args.steps,
                               torch_wrapper="fully_shard" if gpu else "DDP (gloo)",
                               reduce=args.reduce if gpu else "fp32")
    runners = []
    for name in ("meshcoll", "torch"):
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        r = Runner(name, wrap(name, base, args, device), args)
        for i in range(2):  # optimizer state exists after the first step
            dist.barrier()
            r.step(*batches[i % len(batches)], sync, record=False)
        if gpu:
            row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / MiB
            row[f"{name}_state_mib"] = (torch.cuda.memory_allocated() - before) / MiB
        runners.append(r)
    row["expect_mib"] = (16 * nparams / pg.size + 2 * unit) / MiB
    for i in range(args.warmup + args.steps):
        x, y = batches[i % len(batches)]
        for r in runners:
            if args.align == "on":
                dist.barrier()
                sync()
            r.step(x, y, sync, record=i >= args.warmup)
    for r in runners:
        row[f"{r.name}_ms"] = statistics.median(slowest(r.times, device)) * 1e3
    row["ratio"] = row["meshcoll_ms"] / row["torch_ms"]
    row["max_param_rel_diff"] = max_rel_diff(full_params("meshcoll", runners[0].model),
                                             full_params("torch", runners[1].model))
    if pg.rank == 0:
        dev = torch.cuda.get_device_name(device) if gpu else "cpu"
        print(f"# meshcoll {meshcoll.__version__} vs torch {torch.__version__} "
              f"{row['torch_wrapper']}: backend={args.backend} ranks={pg.size} device={dev}")
        print(f"# {args.model} {args.layers}x{args.width}: {nparams / 1e6:.2f}M params, stage "
              f"{args.stage}, {args.optimizer}, {args.steps} timed steps after {args.warmup}, "
              f"median of the slowest rank")
        mem = (f"  peak MiB {row['meshcoll_peak_mib']:.0f}/{row['torch_peak_mib']:.0f}  state MiB "
               f"{row['meshcoll_state_mib']:.0f}/{row['torch_state_mib']:.0f}  expect MiB "
               f"{row['expect_mib']:.0f}") if gpu else ""
        print(f"  meshcoll ms {row['meshcoll_ms']:.2f}  torch ms {row['torch_ms']:.2f}  ratio "
              f"{row['ratio']:.3f}{mem}  max rel diff {row['max_param_rel_diff']:.2e}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    meshcoll.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
