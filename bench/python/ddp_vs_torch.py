"""meshcoll.torch.DistributedDataParallel against torch's DistributedDataParallel, in the
same processes, on the same model, data and optimizer:

    NCCL_NVLS_ENABLE=0 meshcoll-run -n 8 bench/python/ddp_vs_torch.py              # GPUs, NCCL
    NCCL_NVLS_ENABLE=0 meshcoll-run -n 2 bench/python/ddp_vs_torch.py --model convnet \
        --views both --json ddp_vs_torch.jsonl
    meshcoll-run -n 2 bench/python/ddp_vs_torch.py --backend cpu --model mlp     # CPU, Gloo
    meshcoll-run -n 2 bench/python/ddp_vs_torch.py --backend cpu --model both \
        --layers 1 --width 64 --steps 3 --warmup 1 --views both              # tiny, ~1 min

Every rank is started by ``meshcoll-run`` (one process per rank; ``MESHCOLL_RANK``,
``_LOCAL_RANK``, ... in the environment). Each process joins two process groups:
``meshcoll.init(backend=...)`` through meshcoll-run's store, and torch.distributed (NCCL on
GPUs, Gloo with ``--backend cpu``) through ``MASTER_ADDR``/``MASTER_PORT``, a second port that
rank 0 picks and sends the others over meshcoll (or ``--torch-port``). With ``--backend nccl``
(the default when CUDA is available) rank r computes on GPU ``LOCAL_RANK`` under
``torch.autocast("cuda", dtype=torch.bfloat16)``; with ``--backend cpu`` in float32, no
autocast.

Models (``--model``, ``both`` = transformer then convnet):

* ``transformer``: ``--layers`` (12) x ``TransformerEncoderLayer(--width 1024, --heads 16,
  --ffn 4096, dropout=0, batch_first=True)`` then ``Linear(width, --classes 1000)``; a batch is
  8 x 256 random float tokens, the loss cross-entropy against random class indices (8, 256).
* ``convnet``: many small parameters, ``channels_last`` (``--memory-format``): torchvision's
  resnet50 where torchvision imports and the size is the default, else a ResNet of this file
  (bottleneck blocks ``--blocks`` 3,4,6,3, BatchNorm, base width ``--conv-width``: 64, i.e.
  ``--width``/16, about 26M parameters at the defaults); 32 images of 64 x 64.
* ``mlp``: ``--layers`` (8) x ``Linear(width, width)`` + Tanh, batch 16, MSE loss: the
  plain CPU comparison; on 2 ranks in float32 the two wrappers' parameters should be
  bitwise equal (the last column is then 0).

For each model and ``--views`` setting (``gradient_as_bucket_view`` False / True, given to
both wrappers; ``both`` runs the two one after the other with fresh copies), one model is
built from ``--seed`` and deep-copied twice before wrapping (same initial weights); each copy
gets its own optimizer (``--optimizer sgd`` lr 0.01 or ``adamw``) and
``optimizer.zero_grad()`` (set_to_none=True, torch's default). ``--bucket-cap-mb`` goes to
both wrappers, and so does ``--broadcast-buffers on|off`` (torch's default, on: module
buffers such as BatchNorm's running statistics are broadcast from rank 0 before each forward;
torch >= 2.13 spells it ``forward_sync_buffers``). Steps
alternate meshcoll, torch, meshcoll, ...: ``--warmup`` pairs, then ``--steps`` timed pairs,
each step after an untimed barrier (``--align on``) so every wrapper starts with the ranks
together (``--bare`` adds a third, unwrapped copy to each round: the floor).
Each rank draws its own data (seeded by rank), and the two wrappers on one rank get the same
batch at each step. A step (zero_grad, forward, loss, backward, optimizer step) is timed with
``time.perf_counter`` and ended with ``torch.cuda.synchronize()`` on GPUs; its time is the
slowest rank's; the table shows the median over the timed steps. Columns:

* ``meshcoll ms`` / ``torch ms`` and ``ratio`` = meshcoll / torch (< 1: meshcoll faster);
* ``host ms``: CPU time the process spent per step (``time.process_time``, all its threads:
  Python, autograd, the communication threads; median, slowest rank), meshcoll / torch; the
  lines under the table give the calling thread's alone (``time.thread_time``);
* ``overlap``: the share of meshcoll's communication time that ran before backward ended
  (``stats()['overlap_fraction']`` over the timed steps, rank 0); torch reports none ("-");
* ``max param rel diff``: after the steps, max over parameters of ||a - b|| / ||b|| between
  meshcoll's copy (a) and torch's (b), on rank 0.

A configuration meshcoll's adapter refuses (today: a ``channels_last`` convnet, whose conv
weights are not contiguous) gets a row ``meshcoll refused: <message>``, with torch's wrapper
timed alone; the other configurations still run. ``--json FILE`` writes one JSON record per
row. A benchmark, not a test (tests/python/test_ddp_vs_torch_bench.py runs a tiny CPU case).
"""

from __future__ import annotations

import os

# NVLink multicast stays off on shared hosts (both libraries' NCCL read it at init).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Tuple  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import meshcoll  # noqa: E402
import meshcoll.torch as mct  # noqa: E402
from meshcoll import _rendezvous  # noqa: E402
from meshcoll.run import pick_free_port  # noqa: E402

MODELS = ("transformer", "convnet", "mlp")
# Per-model defaults: depth, per-rank batch.
_DEPTH = {"transformer": 12, "mlp": 8}
_BATCH = {"transformer": 8, "convnet": 32, "mlp": 16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("nccl", "cpu"), default=None,
                   help="nccl (GPUs; the default when CUDA is available) or cpu (meshcoll's "
                        "CPU backend against torch on Gloo)")
    p.add_argument("--model", choices=MODELS + ("both",), default="both",
                   help="both = transformer then convnet (default)")
    p.add_argument("--layers", type=int, default=None,
                   help="transformer layers (12) / mlp layers (8); for the convnet, when "
                        "--blocks is not given, bottleneck blocks per stage")
    p.add_argument("--width", type=int, default=1024,
                   help="transformer d_model and mlp width (1024); the convnet's base width "
                        "is width/16 unless --conv-width")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=None, help="feed-forward width (4 x width)")
    p.add_argument("--seq", type=int, default=256, help="transformer tokens per sample")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--blocks", default=None,
                   help="convnet bottleneck blocks per stage (default 3,4,6,3)")
    p.add_argument("--conv-width", type=int, default=None,
                   help="convnet base channels (default width/16: 64 = resnet50)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--memory-format", choices=("channels_last", "contiguous"),
                   default="channels_last", help="convnet parameters and inputs")
    p.add_argument("--batch", type=int, default=None,
                   help="per-rank batch (transformer 8, convnet 32, mlp 16)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--views", choices=("off", "on", "both"), default="off",
                   help="gradient_as_bucket_view for both wrappers")
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--broadcast-buffers", choices=("on", "off"), default="on",
                   help="broadcast_buffers for both wrappers (torch's default: on)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per wrapper")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per wrapper first")
    p.add_argument("--seed", type=int, default=0, help="model seed (data: seed + 1000 + rank)")
    p.add_argument("--torch-port", type=int, default=None,
                   help="torch.distributed's MASTER_PORT (default: rank 0 picks a free one)")
    p.add_argument("--json", metavar="FILE", help="write one JSON record per row")
    p.add_argument("--agree-each-step", action="store_true",
                   help="compare the two copies' parameters after every step pair and name the "
                        "first step and parameter where they differ (rank 0)")
    p.add_argument("--torch-avg", action="store_true",
                   help="torch's DDP all-reduces with ReduceOp.AVG (a comm hook) as meshcoll "
                        "does (NCCL only: Gloo has no AVG)")
    p.add_argument("--torch-vs-torch", action="store_true",
                   help="the meshcoll column is torch's DDP with 0.9x the bucket cap: the "
                        "parameter difference that summation order alone makes")
    p.add_argument("--bare", action="store_true",
                   help="also time a third copy with no wrapper and no communication: the "
                        "floor each wrapper adds to (column bare ms)")
    p.add_argument("--align", choices=("on", "off"), default="on",
                   help="a barrier (untimed) before every step, so each starts with the ranks "
                        "together (default on)")
    p.add_argument("--trace", metavar="PREFIX",
                   help="after the timed steps, one more step per wrapper under torch.profiler "
                        "(CPU and CUDA); rank 0 writes PREFIX_<model>_<views>_<wrapper>.json "
                        "(chrome trace)")
    p.add_argument("--trace-steps", type=int, default=1, help="steps per wrapper under --trace")
    p.add_argument("--trace-gpu-only", action="store_true",
                   help="--trace records GPU activity only (the host runs at nearly full speed)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, count the Python calls of one meshcoll step")
    a = p.parse_args(argv)
    if a.backend is None:
        a.backend = "nccl" if torch.cuda.is_available() else "cpu"
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    a.models = ["transformer", "convnet"] if a.model == "both" else [a.model]
    a.view_modes = {"off": [False], "on": [True], "both": [False, True]}[a.views]
    if a.blocks is None:
        a.blocks = [a.layers] * 4 if a.layers is not None else [3, 4, 6, 3]
        a.default_blocks = a.layers is None
    else:
        a.blocks = [int(b) for b in a.blocks.split(",")]
        a.default_blocks = a.blocks == [3, 4, 6, 3]
    if a.conv_width is None:
        a.conv_width = max(4, a.width // 16)
    if "transformer" in a.models and a.width % a.heads:
        p.error(f"--width {a.width} must divide by --heads {a.heads}")
    return a


# ---- models -------------------------------------------------------------------------------

class Bottleneck(nn.Module):
    """torchvision's Bottleneck (v1.5: the stride on the 3x3 conv)."""

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        out = mid * 4
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != out:
            self.downsample = nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + idt)


class ResNet(nn.Module):
    """ResNet with bottleneck blocks (``blocks`` per stage), as torchvision's resnet50 at
    blocks 3,4,6,3 and base 64."""

    def __init__(self, blocks: List[int], base: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], base
        for i, n in enumerate(blocks):
            mid = base * 2 ** i
            for j in range(n):
                stages.append(Bottleneck(cin, mid, 2 if (j == 0 and i > 0) else 1))
                cin = mid * 4
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def build(kind: str, args) -> Tuple[nn.Module, str]:
    """The model (on CPU, float32, seeded) and its name for the table."""
    torch.manual_seed(args.seed)
    if kind == "transformer":
        layers = args.layers or _DEPTH[kind]
        ffn = args.ffn or 4 * args.width
        net = nn.Sequential(*[nn.TransformerEncoderLayer(args.width, args.heads, ffn, dropout=0.0,
                                                         batch_first=True)
                              for _ in range(layers)], nn.Linear(args.width, args.classes))
        return net, f"transformer {layers}x{args.width}"
    if kind == "mlp":
        layers = args.layers or _DEPTH[kind]
        mods: List[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Linear(args.width, args.width), nn.Tanh()]
        return nn.Sequential(*mods), f"mlp {layers}x{args.width}"
    tv = None
    if args.default_blocks and args.conv_width == 64:
        try:
            import torchvision
            tv = torchvision.models.resnet50(weights=None, num_classes=args.classes)
        except ImportError:
            tv = None
    if tv is not None:
        net, name = tv, "resnet50(tv)"
    else:
        net = ResNet(args.blocks, args.conv_width, args.classes)
        name = f"resnet{'-'.join(map(str, args.blocks))}/{args.conv_width}"
    if args.memory_format == "channels_last":
        net = net.to(memory_format=torch.channels_last)
        name += " cl"
    return net, name


class Data:
    """This rank's batches: its own generator (seed + 1000 + rank), a fresh batch per step
    pair, made outside the timed steps."""

    def __init__(self, kind: str, args, rank: int, device: torch.device) -> None:
        self.kind, self.args, self.device = kind, args, device
        self.gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
        self.batch = args.batch or _BATCH[kind]

    def next(self) -> Tuple[torch.Tensor, torch.Tensor]:
        a, g, b = self.args, self.gen, self.batch
        if self.kind == "transformer":
            x = torch.randn(b, a.seq, a.width, generator=g)
            y = torch.randint(0, a.classes, (b, a.seq), generator=g)
        elif self.kind == "mlp":
            x = torch.randn(b, a.width, generator=g)
            y = torch.randn(b, a.width, generator=g)
        else:
            x = torch.randn(b, 3, a.image_size, a.image_size, generator=g)
            y = torch.randint(0, a.classes, (b,), generator=g)
            if a.memory_format == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
        return x.to(self.device), y.to(self.device)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "mlp":
            return nn.functional.mse_loss(out, y)
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


# ---- one configuration ----------------------------------------------------------------------

class Runner:
    """One wrapped copy: its optimizer and its per-step times."""

    def __init__(self, name: str, model: nn.Module, args) -> None:
        self.name, self.model = name, model
        params = model.parameters()
        self.opt = (torch.optim.SGD(params, lr=args.lr) if args.optimizer == "sgd"
                    else torch.optim.AdamW(params, lr=args.lr))
        self.wall: List[float] = []
        self.issue: List[float] = []  # until the host had issued the whole step
        self.host_bw: List[float] = []  # until backward returned, on the host
        self.gpu_bw: List[float] = []   # until the device got there (GPU events)
        self.cpu: List[float] = []   # the process: every thread
        self.main: List[float] = []  # the thread running the step

    def step(self, x, y, data: Data, amp: Callable[[], Any], sync: Callable[[], None],
             record: bool) -> None:
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        gpu = x.is_cuda
        if gpu:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            marks[0].record()
        self.opt.zero_grad()  # set_to_none=True
        with amp():
            loss = data.loss(self.model(x), y)
        loss.backward()
        tb = time.perf_counter()
        if gpu:
            marks[1].record()
        self.opt.step()
        t1 = time.perf_counter()
        sync()
        if record:
            self.issue.append(t1 - t0)
            self.host_bw.append(tb - t0)
            if gpu:
                self.gpu_bw.append(marks[0].elapsed_time(marks[1]) / 1e3)
            self.wall.append(time.perf_counter() - t0)
            self.cpu.append(time.process_time() - c0)
            self.main.append(time.thread_time() - m0)


def python_calls(fn: Callable[[], None]) -> Dict[Tuple[str, str], int]:
    """Runs ``fn`` and counts the calls of meshcoll's Python functions and of the reducer's
    ``ready``, in every thread (the autograd engine runs a GPU backward's hooks in a thread
    of its own): sys.monitoring on Python 3.12+, else sys.setprofile on this thread (enough
    on the CPU backend, whose backward runs on the calling thread)."""
    counts: Dict[Tuple[str, str], int] = {}

    def note(code: Any) -> None:
        if "meshcoll" in code.co_filename:
            key = (os.path.basename(code.co_filename), code.co_qualname
                   if hasattr(code, "co_qualname") else code.co_name)
            counts[key] = counts.get(key, 0) + 1

    def note_c(fn_obj: Any) -> None:
        if getattr(fn_obj, "__name__", "") in ("ready", "finish") and \
                type(getattr(fn_obj, "__self__", None)).__name__ == "Reducer":
            key = ("C++", f"Reducer.{fn_obj.__name__}")
            counts[key] = counts.get(key, 0) + 1

    mon = getattr(sys, "monitoring", None)
    if mon is not None:
        tool = mon.PROFILER_ID
        mon.use_tool_id(tool, "ddp_vs_torch")
        mon.register_callback(tool, mon.events.PY_START, lambda code, off: note(code))
        mon.register_callback(tool, mon.events.CALL,
                              lambda code, off, fn_obj, arg0: note_c(fn_obj))
        mon.set_events(tool, mon.events.PY_START | mon.events.CALL)
        try:
            fn()
        finally:
            mon.set_events(tool, 0)
            mon.free_tool_id(tool)
        return counts

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            note(frame.f_code)
        elif event == "c_call":
            note_c(arg)
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def slowest(values: List[float], device: torch.device) -> List[float]:
    """Per step, the largest value over the ranks (torch.distributed, MAX)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def max_rel_diff(a: nn.Module, b: nn.Module) -> Tuple[float, bool]:
    """max over parameters of ||a - b|| / ||b||, and whether all are bitwise equal."""
    worst, equal = 0.0, True
    for pa, pb in zip(a.parameters(), b.parameters()):
        pa, pb = pa.detach().float(), pb.detach().float()
        equal = equal and torch.equal(pa, pb)
        nb = float(torch.linalg.vector_norm(pb))
        d = float(torch.linalg.vector_norm(pa - pb))
        worst = max(worst, d / nb if nb > 0 else d)
    return worst, equal


def run_config(kind: str, views: bool, args, pg, device: torch.device) -> Dict[str, Any]:
    gpu = device.type == "cuda"
    base, name = build(kind, args)
    nparams = sum(p.numel() for p in base.parameters())
    mc_copy, torch_copy = copy.deepcopy(base), copy.deepcopy(base)
    bare = copy.deepcopy(base).to(device) if args.bare else None
    del base
    mc_copy.to(device)
    torch_copy.to(device)
    row: Dict[str, Any] = dict(bench="ddp_vs_torch", model=kind, model_name=name, params=nparams,
                               views="on" if views else "off", ranks=pg.size,
                               backend=args.backend, bucket_cap_mb=args.bucket_cap_mb,
                               optimizer=args.optimizer, steps=args.steps, warmup=args.warmup,
                               batch=args.batch or _BATCH[kind])
    refused: Optional[str] = None
    try:
        mc_model = mct.DistributedDataParallel(mc_copy, bucket_cap_mb=args.bucket_cap_mb,
                                               gradient_as_bucket_view=views,
                                               broadcast_buffers=args.broadcast_buffers == "on")
    except (ValueError, TypeError, NotImplementedError) as e:
        refused, mc_model = str(e), None
    kw: Dict[str, Any] = dict(device_ids=[device.index]) if gpu else {}
    # torch >= 2.13 spells broadcast_buffers forward_sync_buffers (and warns at the old name)
    buffers = ("forward_sync_buffers" if "forward_sync_buffers" in
               inspect.signature(nn.parallel.DistributedDataParallel).parameters
               else "broadcast_buffers")
    kw[buffers] = args.broadcast_buffers == "on"
    torch_model = nn.parallel.DistributedDataParallel(
        torch_copy, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=views, **kw)
    if args.torch_avg:
        # torch's DDP with NCCL's average in place of its own pre-division and sum: the op
        # meshcoll's buckets use (ncclAvg), to tell the two apart in the parameters.
        def avg_hook(state, bucket):  # unannotated: torch checks a hook's annotations
            work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG, async_op=True)
            return work.get_future().then(lambda f: f.value()[0])
        torch_model.register_comm_hook(None, avg_hook)
    if args.torch_vs_torch:
        # The floor of "parameters agree": torch's DDP against itself with other buckets,
        # whose sums round in another order (in place of meshcoll's wrapper).
        mc_model = nn.parallel.DistributedDataParallel(
            mc_copy, bucket_cap_mb=args.bucket_cap_mb * 0.9, gradient_as_bucket_view=views, **kw)
    runners = ([Runner("meshcoll", mc_model, args)] if mc_model is not None else []) + \
        [Runner("torch", torch_model, args)] + \
        ([Runner("bare", bare, args)] if bare is not None else [])

    data = Data(kind, args, pg.rank, device)
    amp = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if gpu
           else contextlib.nullcontext)
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def align() -> None:
        """Every rank starts the next step together (untimed). Without it a wrapper whose
        step ties the ranks together pays for the drift the step before it left (ranks
        leave a step when their own device is done, and a step without communication, such
        as --bare's, lets them drift by milliseconds)."""
        dist.barrier(**({"device_ids": [device.index]} if gpu else {}))
        sync()
    for i in range(args.warmup + args.steps):
        if i == args.warmup and mc_model is not None and not args.torch_vs_torch:
            mc_model.ddp.reset_stats()  # overlap of the timed steps only
        x, y = data.next()
        for r in runners:
            if args.align == "on":
                align()
            r.step(x, y, data, amp, sync, record=i >= args.warmup)
        if args.agree_each_step and mc_model is not None and "first_differing_step" not in row:
            for (n, pa), pb in zip(mc_copy.named_parameters(), torch_copy.parameters()):
                if not torch.equal(pa, pb):
                    d = float((pa.detach().float() - pb.detach().float()).abs().max())
                    row["first_differing_step"] = f"{i} ({n}: max abs diff {d:.3g})"
                    break
    if args.trace:
        from torch.profiler import ProfilerActivity, profile
        acts = ([] if args.trace_gpu_only and gpu else [ProfilerActivity.CPU]) + \
            ([ProfilerActivity.CUDA] if gpu else [])
        batches = [data.next() for _ in range(args.trace_steps)]
        for r in runners:
            with profile(activities=acts) if pg.rank == 0 else contextlib.nullcontext() as prof:
                for x, y in batches:
                    r.step(x, y, data, amp, sync, record=False)
            if pg.rank != 0:
                continue
            prof.export_chrome_trace(
                f"{args.trace}_{kind}_{'views' if views else 'copies'}_{r.name}.json")
    if args.profile and mc_model is not None and not args.torch_vs_torch:  # rank 0 reports
        x, y = data.next()
        counts = python_calls(lambda: runners[0].step(x, y, data, amp, sync, record=False))
        for r in runners[1:]:  # the same step, so the parameters still compare
            r.step(x, y, data, amp, sync, record=False)
    if args.profile and mc_model is not None and not args.torch_vs_torch and pg.rank == 0:
        n_buckets = len(mc_model.ddp.bucket_names)
        n_params = sum(1 for p in mc_model.parameters() if p.requires_grad)
        print(f"# profile of one meshcoll step ({n_params} parameters, {n_buckets} buckets): "
              "calls into meshcoll's Python and the reducer")
        for (where, name), n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"#   {n:6d}  {name}  ({where})")

    for r in runners:
        wall = slowest(r.wall, device)
        cpu = slowest(r.cpu, device)
        main = slowest(r.main, device)
        row[f"{r.name}_ms"] = statistics.median(wall) * 1e3
        row[f"{r.name}_host_ms"] = statistics.median(cpu) * 1e3
        row[f"{r.name}_main_thread_ms"] = statistics.median(main) * 1e3
        row[f"{r.name}_issue_ms"] = statistics.median(slowest(r.issue, device)) * 1e3
        row[f"{r.name}_host_backward_ms"] = statistics.median(slowest(r.host_bw, device)) * 1e3
        if r.gpu_bw:
            row[f"{r.name}_gpu_backward_ms"] = statistics.median(slowest(r.gpu_bw, device)) * 1e3
        row[f"{r.name}_times_ms"] = [t * 1e3 for t in wall]
    if mc_model is not None:
        if args.torch_vs_torch:
            row.update(overlap_fraction=0.0, meshcoll_comm_ms_per_step=0.0, buckets=0,
                       torch_vs_torch=True)
        else:
            s = mc_model.stats()
            row["overlap_fraction"] = s["overlap_fraction"]
            row["meshcoll_comm_ms_per_step"] = s["comm_seconds"] / args.steps * 1e3
            row["buckets"] = len(mc_model.ddp.bucket_names)
            mc_model.close()
        row["ratio"] = row["meshcoll_ms"] / row["torch_ms"]
        row["max_param_rel_diff"], row["bitwise_equal"] = max_rel_diff(mc_copy, torch_copy)
    else:
        row["refused"] = refused
    del runners, mc_model, torch_model, mc_copy, torch_copy, bare
    if gpu:
        torch.cuda.empty_cache()
    dist.barrier()
    return row


# ---- report ---------------------------------------------------------------------------------

def machine(device: torch.device, world: int) -> str:
    if device.type == "cuda":
        return f"{world} x {torch.cuda.get_device_name(device)}"
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} CPUs ({model}), {world} ranks"


_HEAD = (f"# {'model':<22} {'views':>5} {'ranks':>5} {'meshcoll':>9} {'torch':>9} {'ratio':>6} "
         f"{'host ms':>15} {'overlap':>7} {'max param':>10}")
_UNITS = (f"# {'':<22} {'':>5} {'':>5} {'(ms)':>9} {'(ms)':>9} {'mc/t':>6} "
          f"{'(mc/torch)':>15} {'':>7} {'rel diff':>10}")


def format_row(r: Dict[str, Any]) -> str:
    lead = f"  {r['model_name']:<22} {r['views']:>5} {r['ranks']:>5}"
    if "refused" in r:
        return (f"{lead} meshcoll refused: {r['refused']} (torch alone: {r['torch_ms']:.2f} ms, "
                f"host {r['torch_host_ms']:.2f} ms)")
    host = f"{r['meshcoll_host_ms']:.1f}/{r['torch_host_ms']:.1f}"
    return (f"{lead} {r['meshcoll_ms']:9.2f} {r['torch_ms']:9.2f} {r['ratio']:6.3f} "
            f"{host:>15} {r['overlap_fraction']:7.2f} {r['max_param_rel_diff']:10.2e}")


def header(args, pg, device) -> List[str]:
    gpu = device.type == "cuda"
    lines = [f"# meshcoll {meshcoll.__version__} DistributedDataParallel vs torch "
             f"{torch.__version__}  backend={args.backend} (torch: {'nccl' if gpu else 'gloo'})"
             f"  ranks={pg.size}  transport={pg.transport}"]
    extra = ""
    if gpu:
        extra = (f"  torch's NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}  "
                 f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    lines.append(f"# machine: {machine(device, pg.size)}{extra}")
    lines.append(f"# {'bf16 autocast' if gpu else 'float32'}  optimizer={args.optimizer} "
                 f"lr={args.lr:g}  bucket_cap_mb={args.bucket_cap_mb:g}  "
                 f"torch broadcast_buffers={args.broadcast_buffers}  steps={args.steps} "
                 f"warmup={args.warmup}  alternating meshcoll/torch; median step of the slowest "
                 f"rank; host = process CPU time per step")
    return lines


# ---- main -----------------------------------------------------------------------------------

def init(args):
    """Both process groups; returns (meshcoll's world group, torch device)."""
    rv = _rendezvous.rendezvous_from_env()
    if args.backend == "nccl":
        local = rv.local_rank if rv.local_rank is not None else rv.rank % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        pg = meshcoll.init(backend="nccl", device=local)
    else:
        device = torch.device("cpu")
        pg = meshcoll.init(backend="cpu")
    addr = rv.master_addr or "127.0.0.1"
    port = getattr(args, "torch_port", None)
    if port is None:
        # Rank 0 runs where meshcoll's store is: a second free port there, sent over meshcoll
        # (a host array; on NCCL groups it goes through the communicator).
        mine = np.array([pick_free_port(addr) if pg.rank == 0 else 0], np.int64)
        port = int(np.asarray(pg.all_gather(mine)).reshape(-1)[0])
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    kw: Dict[str, Any] = dict(device_id=device) if device.type == "cuda" else {}
    dist.init_process_group("nccl" if args.backend == "nccl" else "gloo", init_method="env://",
                            rank=pg.rank, world_size=pg.size, **kw)
    return pg, device


def main(argv=None) -> int:
    args = parse_args(argv)
    pg, device = init(args)
    rows = []
    if pg.rank == 0:
        for line in header(args, pg, device):
            print(line)
        print(_HEAD)
        print(_UNITS)
    for kind in args.models:
        for views in args.view_modes:
            row = run_config(kind, views, args, pg, device)
            rows.append(row)
            if pg.rank == 0:
                print(format_row(row), flush=True)
    if pg.rank == 0:
        for r in rows:
            if r["model"] == "mlp" and "bitwise_equal" in r:
                print(f"# {r['model_name']} views={r['views']}: parameters bitwise equal: "
                      f"{'yes' if r['bitwise_equal'] else 'no'}")
            if args.agree_each_step and "refused" not in r:
                print(f"# {r['model_name']} views={r['views']}: first step whose parameters "
                      f"differ: {r.get('first_differing_step', 'none')}")
            if "refused" not in r:
                print(f"# {r['model_name']} views={r['views']}: {r['params'] / 1e6:.2f}M params, "
                      f"{r['buckets']} meshcoll buckets, meshcoll comm "
                      f"{r['meshcoll_comm_ms_per_step']:.2f} ms/step (rank 0); main thread "
                      f"CPU ms/step {r['meshcoll_main_thread_ms']:.1f}/"
                      f"{r['torch_main_thread_ms']:.1f} (mc/torch); issued in "
                      f"{r['meshcoll_issue_ms']:.1f}/{r['torch_issue_ms']:.1f} ms")
                if "meshcoll_gpu_backward_ms" in r:
                    print(f"# {r['model_name']} views={r['views']}: backward ended on the host / "
                          "on the device (ms), " + ", ".join(
                              f"{w} {r[w + '_host_backward_ms']:.1f}/{r[w + '_gpu_backward_ms']:.1f}"
                              for w in ("meshcoll", "torch", "bare") if w + "_gpu_backward_ms" in r))
                if "bare_ms" in r:
                    print(f"# {r['model_name']} views={r['views']}: no wrapper (bare) "
                          f"{r['bare_ms']:.2f} ms, issued in {r['bare_issue_ms']:.1f} ms: "
                          f"meshcoll adds {r['meshcoll_ms'] - r['bare_ms']:+.2f} ms, torch "
                          f"{r['torch_ms'] - r['bare_ms']:+.2f} ms")
        if args.json:
            with open(args.json, "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    meshcoll.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
