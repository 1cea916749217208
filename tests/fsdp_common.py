"""What the sharded data-parallel tests share (CPU: tests/python/test_fsdp.py, GPU:
tests/gpu/test_fsdp_gpu.py): an MLP and a small transformer whose ``blocks`` are the sharded
units, per-rank random batches, torch's DDP and fully_shard (FSDP2) as references in the same
processes, and the same training through ``meshcoll.torch.fully_shard``. Parameters come back
as numpy, name -> array."""

from __future__ import annotations

import numpy as np
import torch

STEPS = 20

class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 16), torch.nn.Linear(16, 16)])
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


class Tiny(torch.nn.Module):
    """A transformer-ish model: input projection, 2 encoder layers, head."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList([
            torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            for _ in range(2)])
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=1))


MODELS = {"mlp": Mlp, "transformer": Tiny}


def base(kind, device="cpu"):
    torch.manual_seed(0)
    return MODELS[kind]().to(device)


def batch(kind, step, rank, micro=0, device="cpu"):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn((4, 6) if kind == "mlp" else (4, 5, 6), generator=g)
    return x.to(device), torch.randint(0, 3, (4,), generator=g).to(device)


def optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def torch_group(pg, device="cpu"):
    """torch.distributed beside meshcoll: Gloo, or NCCL for a CUDA ``device``."""
    import torch.distributed as dist
    from meshcoll.run import pick_free_port
    port = np.array([pick_free_port("127.0.0.1") if pg.rank == 0 else 0], np.int64)
    port = np.asarray(pg.all_gather(port)).reshape(-1)[:1]  # host array: NCCL groups too
    gpu = torch.device(device).type == "cuda"
    dist.init_process_group("nccl" if gpu else "gloo",
                            init_method=f"tcp://127.0.0.1:{int(port[0])}", rank=pg.rank,
                            world_size=pg.size, **({"device_id": torch.device(device)}
                                                   if gpu else {}))


def ddp_reference(pg, kind, opt_name, accum=1, device="cpu"):
    """torch's DDP: the parameters after STEPS steps, name -> numpy."""
    net = torch.nn.parallel.DistributedDataParallel(base(kind, device))
    opt = optimizer(opt_name, net.parameters())
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(accum):
            x, y = batch(kind, s, pg.rank, m, device)
            ctx = net.no_sync() if m < accum - 1 else nothing()
            with ctx:
                (torch.nn.functional.cross_entropy(net(x), y) / accum).backward()
        opt.step()
    return {n: p.detach().cpu().numpy().copy() for n, p in net.module.named_parameters()}


class nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def sharded(kind, mesh=None, group=None, device="cpu", **kw):
    import meshcoll.torch as mt
    net = base(kind, device)
    for b in net.blocks:
        mt.fully_shard(b, mesh=mesh, group=group, **kw)
    return mt.fully_shard(net, mesh=mesh, group=group, **kw)


def train(net, kind, opt_name, rank, accum=1, dtype=None, device="cpu"):
    opt = optimizer(opt_name, net.parameters())
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(accum):
            x, y = batch(kind, s, rank, m, device)
            ctx = net.no_sync() if m < accum - 1 else nothing()
            with ctx:
                out = net(x)
                if dtype is not None:
                    assert out.dtype == dtype, out.dtype  # forward ran in param_dtype
                loss = torch.nn.functional.cross_entropy(out.float(), y) / accum
                loss.backward()
        opt.step()
    return {n: v.cpu().numpy() for n, v in net.full_state_dict().items()}


def max_rel(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float(np.abs(a[n] - b[n]).max() / np.abs(b[n]).max()) for n in b)


def fsdp2_reference(pg, kind, opt_name, policy, device="cpu"):
    """torch's fully_shard (FSDP2), each block then the root, ``policy`` as a torch
    MixedPrecisionPolicy: the parameters after STEPS steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(torch.device(device).type, (pg.size,))
    mp = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
    net = base(kind, device)
    for b in net.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    opt = optimizer(opt_name, net.parameters())
    for s in range(STEPS):
        opt.zero_grad()
        x, y = batch(kind, s, pg.rank, 0, device)
        torch.nn.functional.cross_entropy(net(x).float(), y).backward()
        opt.step()
    return {n: p.full_tensor().detach().cpu().numpy().copy() for n, p in net.named_parameters()}
