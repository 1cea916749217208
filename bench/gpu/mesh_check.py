"""Issue 10's mesh check on NCCL, for any GPU count: build a (dp, pp, tp) DeviceMesh, then
check an all_reduce along each dim, an all_gather along tp, send/recv between pp stages and
the DataParallel helper (CUDA tensors, 3 buckets) along dp against CPU (numpy) references.

    NCCL_NVLS_ENABLE=0 meshcoll-run -n 8 bench/gpu/mesh_check.py --shape 2 2 2
    NCCL_NVLS_ENABLE=0 meshcoll-run -n 4 bench/gpu/mesh_check.py --shape 2 2 1
"""

import argparse

import numpy as np
import torch

import meshcoll


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, default=[2, 2, 2], metavar=("DP", "PP", "TP"))
    ap.add_argument("--count", type=int, default=4097)
    args = ap.parse_args()
    world = meshcoll.init(backend="nccl")
    mesh = meshcoll.init_device_mesh(tuple(args.shape), ("dp", "pp", "tp"))
    rank, dev = world.rank, torch.device("cuda", torch.cuda.current_device())
    data = {r: np.random.default_rng(r).standard_normal(args.count).astype(np.float32)
            for r in range(world.size)}
    checks = []
    for dim in ("dp", "pp", "tp"):
        g = mesh.get_group(dim)
        x = torch.from_numpy(data[rank]).to(dev)
        g.all_reduce(x)
        ref = np.sum([data[r] for r in g.ranks], axis=0)
        err = float(np.max(np.abs(x.cpu().numpy() - ref)))
        checks.append((f"all_reduce along {dim} (ranks {g.ranks})", err < 1e-4, err))
    tp = mesh.get_group("tp")
    out = tp.all_gather(torch.from_numpy(data[rank]).to(dev))
    ok = np.array_equal(out.cpu().numpy(), np.stack([data[r] for r in tp.ranks]))
    checks.append((f"all_gather along tp (ranks {tp.ranks})", ok, 0.0))
    pp = mesh.get_group("pp")
    if pp.size > 1:
        nxt, prv = (pp.rank + 1) % pp.size, (pp.rank - 1) % pp.size
        buf = torch.empty(args.count, device=dev)
        if pp.rank % 2 == 0:
            pp.send(torch.from_numpy(data[rank]).to(dev), nxt)
            pp.recv(buf, prv)
        else:
            pp.recv(buf, prv)
            pp.send(torch.from_numpy(data[rank]).to(dev), nxt)
        torch.cuda.synchronize()
        ok = np.array_equal(buf.cpu().numpy(), data[pp.ranks[prv]])
        checks.append((f"send/recv between pp stages (ranks {pp.ranks})", ok, 0.0))
    # DataParallel along dp: gradients averaged over the dp replicas, parameters broadcast
    # from dp rank 0 at construction.
    dp = mesh.get_group("dp")
    shapes = {"w1": (64, 33), "b1": (33,), "w2": (33, 7)}
    params = {n: torch.from_numpy(np.random.default_rng([rank, i]).standard_normal(s)
                                  .astype(np.float32)).to(dev) for i, (n, s) in enumerate(shapes.items())}
    ddp = meshcoll.DataParallel(params, group=dp, bucket_cap_mb=33 * 7 * 4 / 2**20)
    grads = {n: torch.from_numpy(np.random.default_rng([rank, 9, i]).standard_normal(s)
                                 .astype(np.float32)).to(dev) for i, (n, s) in enumerate(shapes.items())}
    ddp.sync_gradients(grads)
    err = 0.0
    for i, (n, s) in enumerate(shapes.items()):
        want_p = np.random.default_rng([dp.ranks[0], i]).standard_normal(s).astype(np.float32)
        want_g = np.mean([np.random.default_rng([r, 9, i]).standard_normal(s).astype(np.float32)
                          for r in dp.ranks], axis=0)
        err = max(err, float(np.abs(params[n].cpu().numpy() - want_p).max()),
                  float(np.abs(grads[n].cpu().numpy() - want_g).max()))
    checks.append((f"DataParallel along dp (ranks {dp.ranks}, {len(ddp.bucket_names)} buckets)",
                   err < 1e-5, err))
    ddp.close()
    bad = [c for c in checks if not c[1]]
    for name, ok, err in checks:
        print(f"rank {rank} coord {mesh.get_coordinate()}: {'ok  ' if ok else 'FAIL'} {name}"
              + (f" max err {err:.2e}" if err else ""))
    world.barrier()
    if rank == 0:
        print(mesh.describe())
    meshcoll.destroy()
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
