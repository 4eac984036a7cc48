"""The planner's per-layer model of 1D, 2D, 2.5D and 3D tensor parallelism (tessel.planner.tp_grid).

Its byte counts are the ones tests/parallel/tensor_nd records on the runtime's collectives; here: which grids
exist, and when a mode wins (SUMMA's 6q collectives per layer lose to 1D's one all-reduce on a small layer,
its q-fold smaller messages win on a large one).
"""

import pytest

from tessel.planner.tp_grid import grid_side, layer_costs, layer_seconds, linear_bytes, seconds_table


def test_grids():
    assert grid_side("2d", 64) == (8, 1) and grid_side("2d", 8) is None
    assert grid_side("3d", 512) == (8, 1) and grid_side("3d", 64) == (4, 1) and grid_side("3d", 32) is None
    assert grid_side("2.5d", 8) == (2, 2)
    assert layer_costs("2d", 512, 1024, 1024) is None


def test_bytes_shrink_with_the_grid():
    # 1D sends the same activation all-reduce whatever the group; 3D's per-rank bytes fall as 1/c^2
    one = [layer_costs("1d", d, 16384, 12288)["sent"] for d in (8, 64, 512)]
    cube = [layer_costs("3d", d, 16384, 12288)["sent"] for d in (8, 64, 512)]
    assert one[0] < one[1] < one[2] < 2 * 16384 * 12288 * 2
    assert cube[0] > cube[1] > cube[2]
    assert linear_bytes("2d", 32, 16, 32, 2) == pytest.approx(3 * 1 / 4 * (32 * 16 + 16 * 32) * 4)


def test_latency_decides_small_layers():
    # 64 devices, 2 us per ring step: a small layer pays SUMMA's 336 ring steps, a large one its bytes
    small, large = (256, 512), (16384, 12288)
    assert layer_seconds("1d", 64, *small, 450, 2) < layer_seconds("2d", 64, *small, 450, 2)
    assert layer_seconds("2d", 64, *large, 450, 2) < layer_seconds("1d", 64, *large, 450, 2)
    assert "*" in seconds_table()
