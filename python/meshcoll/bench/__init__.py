"""meshcoll-bench: time collectives and print nccl-tests-style tables.

    meshcoll-bench -N 4 --op all_reduce -b 8 -e 16M -f 2 -c 1
    meshcoll-bench -N 2 --op all_reduce --algo all -b 1K -e 1M --json ar.jsonl --plot ar.png
    meshcoll-run -n 4 -m meshcoll.bench --op all --repeats 5

Run from a shell (no launcher variables set), it starts itself under ``meshcoll-run`` with
``-N/--nproc`` ranks (default 4). Under a launcher (meshcoll-run, torchrun, mpirun, srun)
it joins that job instead. Options follow nccl-tests: ``-b/-e`` the smallest and largest
size (K, M, G suffixes are powers of 1024), ``-f`` the step factor (or ``-i`` a fixed
step when ``-f 1``), ``-n`` timed iterations, ``-w/--warmup-iters`` warm-up iterations,
``-c`` check. ``-n`` is the iteration count as in nccl-tests, so the rank count is ``-N``.

What the columns mean (the nccl-tests definitions):

* ``size``: bytes per rank of the larger of the input and output buffer. all_reduce,
  broadcast, reduce: the buffer. all_gather: the *output* (``size / ranks`` bytes go in
  from each rank). reduce_scatter: the *input* (each rank keeps ``size / ranks``).
  all_to_all: the send buffer (``size / ranks`` to each peer). Element counts that must
  split evenly across ranks are rounded down to a multiple of the rank count (at least
  one element per rank); a size that rounds to the row before it is skipped.
* ``count``: elements in that buffer. ``time``: microseconds per call, the median over
  ``--repeats`` of the largest per-rank mean over ``-n`` back-to-back calls (each repeat
  starts after a barrier). ``algbw`` = size / time in GB/s (1e9 B/s). ``busbw`` =
  algbw x the factor in ``BUS_FACTORS`` (2(n-1)/n all-reduce; (n-1)/n all-gather,
  reduce-scatter, all-to-all; 1 broadcast, reduce), comparable with the link or memory
  bandwidth whatever the collective. ``#wrong``: elements that differ from the expected
  result, summed over ranks (``N/A`` without ``-c``); a non-zero total makes the exit
  status 1.

The header names the transport the group uses (``shm`` when every rank is on one host,
else ``tcp``; ``--transport`` forces one) and, for all_reduce, the algorithm (``auto``
picks ``shm`` on shared memory, else by size as ``CollectiveConfig.select_all_reduce``).

With several series (``--op a,b`` or ``--algo ring,tree``), every size runs each series in
turn within each repeat, so that the machine's slow moments fall on all series alike; the
tables print at the end. ``--algo`` names the algorithms of all_reduce, reduce and broadcast
(each op runs those it takes; ``tree:K`` is a K-ary tree, ``tree`` the binomial one);
``--algo all`` is every algorithm each op has on the group's transport (all_reduce's ``shm``
only on shared memory, broadcast's ``ring`` only over TCP), trees of arity 2, 4 and 8 too.
An op run with several algorithms ends with a comparison: one row per size, one column per
algorithm (time in us), the fastest marked ``*`` and what auto picks ``a`` (the selection
table, ``CollectiveConfig.selection_table()``): the measurement that moves a threshold.
Each row has nccl-tests' two column groups, out-of-place and in-place
(``PLACEMENTS``): all_reduce, broadcast and reduce work in place in meshcoll's API (no
``out=``), so their out-of-place group is N/A; all_gather and reduce_scatter run both ways (in
place, as nccl-tests aliases them: the input is this rank's block of the output, or the
output of the input); all_to_all only out of place. ``--json FILE`` writes one ``json.dumps``
record per measured form (``in_place`` says which), ``--csv FILE`` the same records as CSV;
``--plot FILE.png`` draws busbw against size per series (needs the ``[plot]`` extra,
``pip install ".[plot]"`` in a clone; checked before anything runs).

``--backend nccl`` runs the same tables on GPUs (``-N`` defaults to the visible GPUs; rank r
uses GPU LOCAL_RANK, as ``meshcoll.init(backend="nccl")`` picks it). Buffers are PyTorch
tensors, else CuPy arrays (``--array``; neither is a dependency). Inputs are random: rank
r's element i comes from ``numpy.random.default_rng([seed, r, chunk])``, so every rank can
recompute every other rank's input and ``-c 1`` compares the result, copied to the host,
with a numpy reference (small non-negative integers: exact for sum, prod, min, max in every
dtype; avg of floats within a few ulps, since NCCL scales each input by 1/n first). Time is
nccl-tests': a barrier, ``-n`` back-to-back calls, a device synchronize, on the host clock,
per call; the slowest rank's mean, median over ``--repeats``. ``--algo`` and
``--transport`` are CPU-backend choices (NCCL_ALGO / NCCL_PROTO steer NCCL).
"""

# The package, one idea a file: buffers (dtypes, device arrays), verify (input patterns and
# expected results), cases (ops, sizes, one Case per series and size, timing), report
# (tables, JSON, plot), cli (options, main). These names are what bench/python/*.py and the
# tests import.

from .buffers import (ARRAY_LIBS, TYPE_NAMES, CupyArrays, DeviceDType, TorchArrays,
                      array_library, device_dtype, make_arrays, numpy_dtype)
from .cases import (ALGORITHMS, BUS_FACTORS, CHOOSING, OPS, P2P_ALGORITHMS, PLACEMENTS, REDOPS,
                    REDUCING, SPLIT, TREE_ARITIES, Case, DeviceCase, DeviceRunner, HostRunner,
                    Series, algorithms_for, device_time_loop, element_counts, format_size,
                    make_record, measure, parse_size, size_steps, split_algo, time_loop,
                    transport_name)
from .cli import BACKENDS, main, nccl_preflight, parse_args, resolve_algorithms
from .report import (check_plot_dependencies, comparison, footer, format_row, header,
                     plot_records, print_tables, table_rows, write_csv, write_json)
from .verify import (BITWISE, CHUNK, count_wrong, move_input, rank_values, reduce_expected,
                     reduce_input, reference_reduce)
