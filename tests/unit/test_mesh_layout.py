"""Tier 1: MeshLayout rank math. No processes, no C++ extension."""

import itertools
import re

import numpy as np
import pytest

from meshcoll.device_mesh import DeviceMesh, MeshLayout

SHAPES = [
    ((1,), ("a",)),
    ((4,), ("dp",)),
    ((2, 3), ("dp", "tp")),
    ((3, 1), ("dp", "tp")),
    ((2, 2, 2), ("dp", "pp", "tp")),
    ((2, 3, 1, 2), ("dp", "pp", "cp", "tp")),
]


def _all_dim_sets(names):
    """Every non-empty subset of dims, kept in mesh order."""
    for k in range(1, len(names) + 1):
        yield from itertools.combinations(names, k)


@pytest.mark.parametrize("shape,names", SHAPES)
def test_coordinates_round_trip(shape, names):
    layout = MeshLayout(shape, names)
    assert layout.world_size == int(np.prod(shape))
    coords = [layout.coordinate(r) for r in range(layout.world_size)]
    # Row-major, last dim fastest: coordinates enumerate in np.ndindex order.
    assert coords == list(np.ndindex(*shape))
    for r, c in enumerate(coords):
        assert layout.rank(c) == r
        assert layout.rank(dict(zip(names, c))) == r


@pytest.mark.parametrize("shape,names", SHAPES)
def test_groups_partition_the_world(shape, names):
    layout = MeshLayout(shape, names)
    for dims in _all_dim_sets(names):
        groups = layout.groups(dims)
        assert all(len(g) == layout.size(dims) for g in groups)
        assert len(groups) == layout.world_size // layout.size(dims)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(layout.world_size)), dims  # disjoint and covering
        for g in groups:
            coords = np.array([layout.coordinate(r) for r in g])
            kept = [names.index(d) for d in dims]
            other = [i for i in range(len(names)) if i not in kept]
            # Members agree on every other dim and enumerate the kept dims row-major.
            assert (coords[:, other] == coords[0, other]).all()
            assert [tuple(c) for c in coords[:, kept]] == \
                list(np.ndindex(*[shape[i] for i in kept]))
            for r in g:
                assert layout.group_of(r, dims) == g


def test_groups_are_moveaxis_rows():
    layout = MeshLayout((2, 3, 4), ("a", "b", "c"))
    mesh = np.arange(24).reshape(2, 3, 4)
    assert layout.groups("b") == np.moveaxis(mesh, 1, -1).reshape(-1, 3).tolist()
    assert layout.groups("b") == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11],
                                  [12, 16, 20], [13, 17, 21], [14, 18, 22], [15, 19, 23]]
    assert layout.groups("c") == [list(range(i, i + 4)) for i in range(0, 24, 4)]
    assert layout.groups(("a", "c")) == [
        [0, 1, 2, 3, 12, 13, 14, 15],
        [4, 5, 6, 7, 16, 17, 18, 19],
        [8, 9, 10, 11, 20, 21, 22, 23],
    ]
    assert layout.groups(("a", "b", "c")) == [list(range(24))]
    assert layout.size(("a", "c")) == 8 and layout.size() == 24


# -- Megatron ordering -----------------------------------------------------------------


def _megatron_groups(world, sizes, order, token):
    """Megatron-LM's generate_masked_orthogonal_rank_groups, re-derived: dims in
    `order` with the first fastest; `token` ("tp" or "dp-tp") names the masked dims,
    whose ranks vary first-token-fastest within a group."""
    tokens = order.split("-")
    par = [sizes[t] for t in tokens]
    stride = list(np.cumprod([1] + par[:-1]))
    masked = token.split("-")
    m_idx = [i for i, t in enumerate(tokens) if t in masked]
    u_idx = [i for i, t in enumerate(tokens) if t not in masked]

    def decompose(index, dims):
        out = []
        for i in dims:
            out.append(index % par[i])
            index //= par[i]
        return out

    group_size = int(np.prod([par[i] for i in m_idx]))
    groups = []
    for gi in range(world // group_size):
        base = sum(c * stride[i] for c, i in zip(decompose(gi, u_idx), u_idx))
        groups.append([int(base + sum(c * stride[i] for c, i in
                                      zip(decompose(ri, m_idx), m_idx)))
                       for ri in range(group_size)])
    return groups


MEGATRON_CASES = {
    # Megatron-LM's own docstring example: 16 GPUs, tp=2, pp=4, dp=2.
    (16, "tp-dp-pp", 2, 4): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
        "pp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    },
    (8, "tp-dp-pp", 2, 2): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (8, "tp-pp-dp", 2, 2): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    },
    (16, "tp-dp-pp", 2, 2): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    },
    (16, "tp-pp-dp", 2, 2): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "pp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
        "dp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    },
}


@pytest.mark.parametrize("case", sorted(MEGATRON_CASES))
def test_from_order_matches_megatron(case):
    world, order, tp, pp = case
    layout = MeshLayout.from_order(world, tp=tp, pp=pp, order=order)
    dp = world // (tp * pp)
    assert layout.dim_names == tuple(reversed(order.split("-")))
    assert dict(zip(layout.dim_names, layout.shape)) == {"tp": tp, "pp": pp, "dp": dp}
    sizes = {"tp": tp, "pp": pp, "dp": dp}
    for dim, expected in MEGATRON_CASES[case].items():
        assert layout.groups(dim) == expected, dim
        assert _megatron_groups(world, sizes, order, dim) == expected, dim


@pytest.mark.parametrize("world,order", [(8, "tp-dp-pp"), (16, "tp-pp-dp"),
                                         (16, "tp-dp-pp")])
def test_from_order_flattened_matches_megatron(world, order):
    layout = MeshLayout.from_order(world, tp=2, pp=2, order=order)
    sizes = dict(zip(layout.dim_names, layout.shape))
    tokens = order.split("-")
    for a, b in itertools.combinations(tokens, 2):
        # Megatron names multi-dim groups first-token-fastest ("tp-dp"); the mesh
        # takes them in mesh order, which is the reverse.
        assert layout.groups((b, a)) == _megatron_groups(world, sizes, order, f"{a}-{b}")


def test_from_order_explicit_flattened_groups():
    layout = MeshLayout.from_order(8, tp=2, pp=2, order="tp-dp-pp")
    assert layout.dim_names == ("pp", "dp", "tp")
    assert layout.groups(("dp", "tp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups(("pp", "tp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.groups(("pp", "dp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_from_order_infers_any_single_dim_and_accepts_all_given():
    assert MeshLayout.from_order(12, tp=2, dp=3, order="tp-dp-pp").shape == (2, 3, 2)
    full = MeshLayout.from_order(8, tp=2, dp=2, pp=2, order="tp-dp-pp")
    assert full == MeshLayout((2, 2, 2), ("pp", "dp", "tp"))
    assert MeshLayout.from_order(4, order="dp").shape == (4,)


# -- validation ----------------------------------------------------------------------


@pytest.mark.parametrize("make,message", [
    (lambda: MeshLayout((2, 2, 2), ("dp", "pp", "tp")).check_world_size(6),
     "mesh (dp=2, pp=2, tp=2) needs 8 ranks, got 6"),
    (lambda: MeshLayout.from_order(6, tp=2, dp=2, pp=2, order="pp-dp-tp"),
     "mesh (tp=2, dp=2, pp=2) needs 8 ranks, got 6"),
    (lambda: MeshLayout.from_order(6, tp=4, order="tp-dp-pp"),
     "cannot infer more than one dim size; give sizes for all but one of ['dp', 'pp']"),
    (lambda: MeshLayout.from_order(6, tp=4, pp=1, order="tp-dp-pp"),
     "tp*pp = 4 does not divide world size 6"),
    (lambda: MeshLayout.from_order(8, tp=2, ep=2, order="tp-dp-pp"),
     "unknown dim names ['ep']: not in order 'tp-dp-pp'"),
    (lambda: MeshLayout.from_order(8, tp=2, order="tp-dp-tp"),
     "duplicate dim names ['tp'] in order 'tp-dp-tp'"),
    (lambda: MeshLayout.from_order(8, tp=2, order="tp--dp"),
     "order 'tp--dp' has an empty dim name"),
    (lambda: MeshLayout.from_order(8, tp=0, order="tp-dp"),
     "dim 'tp' has size 0; every dim needs size >= 1"),
    (lambda: MeshLayout((2, 2), ("dp", "dp")),
     "duplicate dim names ['dp'] in ('dp', 'dp')"),
    (lambda: MeshLayout((2, 0), ("dp", "tp")),
     "dim 'tp' has size 0; every dim needs size >= 1"),
    (lambda: MeshLayout((2, 2), ("dp",)),
     "shape (2, 2) has 2 dims but dim_names ('dp',) has 1"),
    (lambda: MeshLayout((), ()), "mesh needs at least one dim"),
    (lambda: MeshLayout((2,), ("",)), "dim names must be non-empty strings, got ''"),
    (lambda: MeshLayout((2.5,), ("dp",)), "'float' object cannot be interpreted"),
    (lambda: MeshLayout((2, 2), ("dp", "tp")).groups("pp"),
     "unknown dim 'pp'; mesh dims are ('dp', 'tp')"),
    (lambda: MeshLayout((2, 2), ("dp", "tp")).size(("tp", "dp")),
     "dims ('tp', 'dp') must appear in mesh order ('dp', 'tp')"),
    (lambda: MeshLayout((2, 2), ("dp", "tp")).groups(("tp", "tp")),
     "duplicate dim names ['tp'] in ('tp', 'tp')"),
    (lambda: MeshLayout((2, 2), ("dp", "tp")).groups(()), "need at least one dim name"),
    (lambda: MeshLayout((2, 2), ("dp", "tp")).coordinate(4),
     "rank 4 is outside mesh (dp=2, tp=2) of 4 ranks"),
    (lambda: MeshLayout((2, 2), ("dp", "tp")).rank((0, 2)),
     "coordinate 2 for dim 'tp' is outside [0, 2)"),
    (lambda: MeshLayout((2, 2), ("dp", "tp")).rank((0,)),
     "coordinate (0,) has 1 entries; mesh (dp=2, tp=2) has 2 dims"),
    (lambda: MeshLayout((2, 2), ("dp", "tp")).rank({"dp": 0, "pp": 1}),
     "coordinate {'dp': 0, 'pp': 1} must name exactly the dims ('dp', 'tp')"),
])
def test_validation_messages(make, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        make()


def test_sub_layout_keeps_mesh_order():
    layout = MeshLayout((2, 3, 4), ("dp", "pp", "tp"))
    assert layout.sub_layout(("dp", "tp")) == MeshLayout((2, 4), ("dp", "tp"))
    assert repr(layout.sub_layout("pp")) == "(pp=3)"


def test_device_mesh_is_documented_and_sized_like_a_process_group():
    # mesh.size is a property, as ProcessGroup.size (print(mesh.size) printed a bound method);
    # a dim's size is mesh[dim].size (tests/python/test_device_mesh.py).
    assert isinstance(vars(DeviceMesh)["size"], property)
    undocumented = [n for n, v in vars(DeviceMesh).items()
                    if not n.startswith("_") and not (getattr(v, "__doc__", None) or "").strip()]
    assert not undocumented, undocumented


def test_grid_shape_is_the_most_nearly_square_grid():
    from meshcoll.device_mesh import grid_shape
    assert [grid_shape(n) for n in (1, 2, 4, 6, 7, 8, 12, 16, 64)] == [
        (1, 1), (1, 2), (2, 2), (2, 3), (1, 7), (2, 4), (3, 4), (4, 4), (8, 8)]
    with pytest.raises(ValueError, match="at least one rank"):
        grid_shape(0)
