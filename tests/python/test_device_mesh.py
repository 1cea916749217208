"""Tier 2: DeviceMesh over real ranks (CPU backend), via the run_ranks fixture."""

import socket

import numpy as np
import pytest

from meshcoll.device_mesh import DeviceMesh, MeshLayout, init_device_mesh

COUNT = 7  # odd on purpose


def _data(global_rank):
    return np.random.default_rng(global_rank).standard_normal(COUNT)


def _check_sum(group, expected_members):
    """all_reduce along `group` must sum exactly the data of `expected_members`."""
    assert group.is_member
    assert list(group.ranks) == list(expected_members)
    x = _data(group.global_rank(group.rank))
    work = group.all_reduce(x, op="sum")
    if hasattr(work, "wait"):
        work.wait()
    expected = np.sum([_data(r) for r in expected_members], axis=0)
    np.testing.assert_allclose(x, expected, rtol=1e-12, atol=1e-12)


def _check_mesh_groups(mesh, layout, me):
    """Every single dim and every flattening agree with the layout math."""
    coord = layout.coordinate(me)
    assert mesh.get_coordinate() == coord
    for i, dim in enumerate(layout.dim_names):
        members = layout.group_of(me, dim)
        group = mesh.get_group(dim)
        assert group is mesh[dim].get_group()
        assert mesh.get_local_rank(dim) == coord[i] == group.rank
        assert mesh[dim].size == group.size == layout.shape[i]
        _check_sum(group, members)


def _check_devices(mesh, world, group_count):
    devs = mesh.devices()
    assert len(devs) == world
    host = socket.gethostname()
    for d in devs:
        assert (d.kind, d.index, d.host) == ("cpu", 0, host)
        assert d.name and (d.memory is None or d.memory > 0)
    st = mesh.stats()
    assert st["world_size"] == mesh.size == world
    assert st["hosts"] == 1
    assert st["devices_by_kind"] == {"cpu": 1}  # one host's CPU, however many ranks
    assert st["ranks_by_kind"] == {"cpu": world}
    assert st["total_memory"] == devs[0].memory
    assert st["group_count"] == group_count
    text = mesh.describe()
    lines = text.splitlines()
    assert lines[1].split()[: 1 + mesh.ndim] == ["rank", *mesh.dim_names]
    assert len(lines) == 2 + world
    for line, coord in zip(lines[2:], np.ndindex(*mesh.shape)):
        fields = line.split()
        r = int(fields[0])
        assert tuple(int(c) for c in fields[1: 1 + mesh.ndim]) == coord
        assert mesh.layout.rank(coord) == r and host in fields


def _mesh_3d(pg):
    layout = MeshLayout((2, 2, 2), ("dp", "pp", "tp"))
    mesh = init_device_mesh(layout.shape, layout.dim_names)
    me = pg.rank
    assert mesh.shape == (2, 2, 2) and mesh.dim_names == ("dp", "pp", "tp")
    np.testing.assert_array_equal(mesh.ranks, np.arange(8).reshape(2, 2, 2))
    _check_mesh_groups(mesh, layout, me)
    _check_devices(mesh, 8, group_count=12)

    # A 2-D slice through this rank shares the parent's group objects.
    sub = mesh["dp", "tp"]
    assert sub.shape == (2, 2) and sub.dim_names == ("dp", "tp") and sub.size == 4
    assert sub.get_group("dp") is mesh.get_group("dp")
    assert sub.get_group("tp") is mesh.get_group("tp")
    c = layout.coordinate(me)
    assert sub.get_coordinate() == (c[0], c[2])
    assert sorted(sub.ranks.flat) == layout.group_of(me, ("dp", "tp"))
    with pytest.raises(ValueError, match="unknown dim 'pp'"):
        sub.get_group("pp")

    # Flattening is collective; the flattened group sums exactly its four ranks.
    flat = mesh.flatten("dp", "tp")
    assert flat.dim_names == ("dp_tp",) and flat.shape == (4,) and mesh["dp_tp"].size == 4
    _check_sum(flat.get_group(), layout.group_of(me, ("dp", "tp")))
    assert flat.get_local_rank("dp_tp") == layout.group_of(me, ("dp", "tp")).index(me)
    assert mesh.get_group("dp_tp") is flat.get_group()
    assert sub.flatten() is flat  # cached: no new groups
    assert mesh.stats()["group_count"] == 14

    whole = mesh.flatten()
    _check_sum(whole.get_group(), list(range(8)))
    assert whole.dim_names == ("dp_pp_tp",)
    assert mesh.stats()["group_count"] == 15


def _mesh_2d(pg):
    layout = MeshLayout((2, 2), ("dp", "tp"))
    mesh = init_device_mesh((2, 2), ("dp", "tp"))
    _check_mesh_groups(mesh, layout, pg.rank)
    _check_devices(mesh, 4, group_count=4)
    _check_sum(mesh.flatten().get_group(), [0, 1, 2, 3])


def _mesh_1d(pg):
    with pytest.raises(ValueError, match=r"mesh \(dp=2, tp=3\) needs 6 ranks, got 4"):
        init_device_mesh((2, 3), ("dp", "tp"))
    mesh = DeviceMesh(MeshLayout((4,), ("dp",)))
    assert mesh.get_group() is mesh.get_group("dp")
    assert mesh["dp"] is mesh
    _check_mesh_groups(mesh, MeshLayout((4,), ("dp",)), pg.rank)
    _check_devices(mesh, 4, group_count=1)


def _mesh_from_order(pg):
    # Megatron order: tp fastest, so tp groups are consecutive ranks.
    mesh = DeviceMesh(MeshLayout.from_order(8, tp=2, pp=2, order="tp-dp-pp"))
    assert mesh.dim_names == ("pp", "dp", "tp")
    expected = {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    for dim, groups in expected.items():
        mine = next(g for g in groups if pg.rank in g)
        _check_sum(mesh.get_group(dim), mine)


def _mesh_default_grid_and_reshape(pg):
    # No shape: the most nearly square grid, tp (the longer dim) over consecutive ranks.
    mesh = init_device_mesh()
    layout = MeshLayout((2, 3), ("dp", "tp"))
    assert mesh.shape == (2, 3) and mesh.dim_names == ("dp", "tp")
    _check_mesh_groups(mesh, layout, pg.rank)
    assert len(mesh.devices(kind="cpu")) == 6 and mesh.devices(kind="cuda") == []
    # The same ranks in another shape, with groups of its own.
    again = mesh.reshape((3, 2), ("pp", "dp"))
    _check_mesh_groups(again, MeshLayout((3, 2), ("pp", "dp")), pg.rank)
    assert mesh.stats()["group_count"] == 5 and again.stats()["group_count"] == 5
    with pytest.raises(ValueError, match="slice or flattening"):
        mesh["tp"].reshape((3,), ("x",))
    with pytest.raises(ValueError, match="needs 4 ranks, got 6"):
        mesh.reshape((2, 2), ("a", "b"))


@pytest.mark.timeout(120)
def test_mesh_default_grid_and_reshape(run_ranks):
    run_ranks(6, _mesh_default_grid_and_reshape)


@pytest.mark.timeout(120)
def test_mesh_3d(run_ranks):
    run_ranks(8, _mesh_3d)


@pytest.mark.timeout(120)
def test_mesh_2d(run_ranks):
    run_ranks(4, _mesh_2d)


@pytest.mark.timeout(120)
def test_mesh_1d(run_ranks):
    run_ranks(4, _mesh_1d)


@pytest.mark.timeout(120)
def test_mesh_from_order(run_ranks):
    run_ranks(8, _mesh_from_order)


def _compute_units(pg):
    """Rank 1 may run on one core only: its device says so, and the mesh's total counts the
    host's CPU once, with the most cores any rank there may use."""
    import os
    if pg.rank == 1:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    mine = len(os.sched_getaffinity(0))
    mesh = init_device_mesh((2, 2), ("dp", "tp"))
    units = [d.compute_units for d in mesh.devices()]
    st = mesh.stats()
    first_line = mesh.describe().splitlines()[0]
    return mine, units, st["compute_units"], st["compute_units_unknown"], first_line


@pytest.mark.timeout(120)
def test_mesh_compute_units(run_ranks):
    results = run_ranks(4, _compute_units)
    reported = [mine for mine, *_ in results]
    assert reported[1] == 1
    for mine, units, total, unknown, first_line in results:
        assert units == reported  # every rank's record, in mesh order
        assert total == max(reported) and unknown == 0
        assert f"{total} compute units" in first_line


def _named_groups(pg):
    from meshcoll import MismatchError, NonMemberGroup

    me = pg.rank
    pair = pg.new_group([0, 1], name="pair")
    assert pair.name == "pair" and isinstance(pair, NonMemberGroup) == (me > 1)
    if pair.is_member:
        _check_sum(pair, [0, 1])
        assert "name='pair'" in repr(pair)
    again = pg.new_group([0, 1], name="pair")  # the same ranks: the same name is fine
    assert again.name == "pair"
    with pytest.raises(ValueError, match=rf"global rank {me}: the name 'pair' already names "
                                         r"the group\(s\) of global ranks \[\[0, 1\]\]"):
        pg.new_group([2, 3], name="pair")
    for bad in ("", 5):
        with pytest.raises(ValueError, match="name must be a non-empty string"):
            pg.new_group([0, 1], name=bad)
    parity = pg.split(me % 2, name="parity")  # every group of the split has the name
    assert parity.name == "parity"
    _check_sum(parity, [me % 2, me % 2 + 2])
    with pytest.raises(ValueError, match=r"'parity' already names the group\(s\) of global "
                                         r"ranks \[\[0, 2\], \[1, 3\]\]"):
        pg.split(me // 2, name="parity")
    with pytest.raises(ValueError, match="'parity' already names"):
        pg.new_group([0, 2], name="parity")
    assert pg.split(me // 2).name.startswith("world.s")  # unnamed: meshcoll's own name
    mesh = init_device_mesh((2, 2), ("dp", "tp"))
    assert mesh.group_names() == ["dp", "tp", "pair", "parity"]
    mesh.flatten("dp", "tp")
    assert mesh.group_names() == ["dp", "tp", "dp_tp", "pair", "parity"]
    assert mesh["tp"].group_names() == ["tp", "dp_tp", "pair", "parity"]
    # Every name group_names() lists finds this rank's group of that name.
    assert mesh.get_group("parity") is parity and mesh["tp"].get_group("parity") is parity
    if pair.is_member:
        assert mesh.get_group("pair") is pair  # the first group made under the name
    else:
        with pytest.raises(ValueError, match=rf"get_group\('pair'\) on global rank {me}: this "
                                             r"rank is in none of the groups named 'pair' "
                                             r"\(global ranks \[\[0, 1\]\]\)"):
            mesh.get_group("pair")
    with pytest.raises(ValueError, match=r"unknown dim 'nope'.*nor does a group go by that "
                                         r"name \(group_names\(\): \['dp', 'tp', 'dp_tp', "
                                         r"'pair', 'parity'\]\)"):
        mesh.get_group("nope")
    # Ranks that name one group differently are told so at its setup, on every member.
    with pytest.raises(MismatchError, match="name="):
        pg.new_group([0, 1, 2, 3], name=f"odd{me % 2}")
    return me


@pytest.mark.timeout(120)
def test_named_groups(run_ranks):
    assert run_ranks(4, _named_groups) == [0, 1, 2, 3]
