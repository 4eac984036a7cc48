"""The mesh's rank layout (pure arithmetic) and its process groups."""

import pytest
import torch
import torch.distributed as dist

from tessel.mesh import Mesh, make_mesh
from tessel.spawn import spawn


def test_default_order_keeps_tp_contiguous_and_pp_outermost():
    m = Mesh({"pp": 2, "dp": 2, "ep": 1, "tp": 2}, rank=5)
    assert m.coords() == {"pp": 1, "dp": 0, "ep": 0, "cp": 0, "tp": 1}
    assert m.group_ranks(("tp",)) == [4, 5]
    assert m.group_ranks(("dp",)) == [5, 7]
    assert m.group_ranks(("pp",)) == [1, 5]
    assert sorted(sum(m.all_groups(("dp",)), [])) == list(range(8))


def test_custom_rank_order_and_topology_warning():
    m = Mesh({"pp": 1, "dp": 2, "ep": 1, "tp": 2}, order=("tp", "dp", "ep", "pp"), rank=0)
    assert m.group_ranks(("tp",)) == [0, 2]
    with pytest.warns(UserWarning, match="spans nodes"):
        assert m.check_topology(nproc_per_node=2)
    assert Mesh({"pp": 1, "dp": 2, "ep": 1, "tp": 2}).check_topology(nproc_per_node=2) == []


def _group_sums():
    mesh = make_mesh({"dp": 2, "tp": 2})
    out = {}
    for axes in [("dp",), ("tp",), ("dp", "ep")]:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.group(*axes))
        out[axes] = t.item()
    return out, mesh.group("ep")


def test_groups_reduce_over_the_right_ranks():
    results = spawn(_group_sums, 4)
    for rank, (sums, ep_group) in enumerate(results):
        tp_peer, dp_peer = rank ^ 1, rank ^ 2
        assert sums[("tp",)] == rank + tp_peer
        assert sums[("dp",)] == rank + dp_peer
        assert sums[("dp", "ep")] == sums[("dp",)]
        assert ep_group is None  # size-1 axes have no group


def test_cp_sits_between_ep_and_tp_and_an_older_order_gets_it_beside_tp():
    m = Mesh({"dp": 2, "cp": 2, "tp": 2}, rank=5)  # default order pp > dp > ep > cp > tp
    assert m.coords() == {"pp": 0, "dp": 1, "ep": 0, "cp": 0, "tp": 1}
    assert m.group_ranks(("cp",)) == [5, 7]  # stride tp: cp x tp = 4 neighbouring ranks
    assert m.group_ranks(("tp",)) == [4, 5]
    assert m.group_ranks(("dp", "ep", "cp")) == [1, 3, 5, 7]  # the ranks that see different tokens
    old = Mesh({"dp": 2, "cp": 2, "tp": 2}, order=("tp", "dp", "ep", "pp"), rank=0)  # written before cp
    assert old.order == ("cp", "tp", "dp", "ep", "pp")
    assert old.group_ranks(("cp",)) == [0, 4] and old.group_ranks(("tp",)) == [0, 2]  # cp just outside tp
    assert "cp groups: [[0, 2], [1, 3], [4, 6], [5, 7]]" in m.describe()
    with pytest.warns(UserWarning, match="cp group"):
        assert Mesh({"cp": 4}).check_topology(nproc_per_node=2)
