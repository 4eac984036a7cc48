"""A packed shard as pieces of its logical tensor: a fused q|k|v projection split per head over tp.

GPT-2's `c_attn` packs q, k and v side by side along one dim (Phi-3's
`qkv_proj` too, with fewer k and v heads than q heads under grouped-query
attention; its `gate_up_proj` packs gate and up) and tensor parallelism splits
each of them by heads (tessel.sharding.mark_packed): tp rank r holds the r-th
chunk of each block, so its shard is one piece of the logical tensor per
block, not one. A DTensor describes
one piece per rank; DCP's ShardedTensor describes any list of pieces, each
with its offsets in the logical tensor, and DCP writes and reads them as it
does a DTensor's chunks (resharding included). So a checkpoint holds the
logical Hugging Face tensor, and any layout reads it back:

    logical (.., sum_b tp * c_b, ..)   rank r's piece of block b: [start_b + r * c_b, + c_b)
    local   (.., sum_b c_b, ..)        the pieces side by side, in block order

where start_b = tp * (c_0 + .. + c_{b-1}) and the c_b are in the ratio of the blocks' relative sizes.
"""

from __future__ import annotations

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from tessel.mesh import Mesh
from tessel.sharding import block_sizes


def _piece(shape: torch.Size, dim: int, blocks: tuple[int, ...], size: int, coord: int, block: int,
           owner: str) -> ShardMetadata:
    """Where the piece of block `block` at coordinate `coord` lies in the logical tensor (offsets, sizes, owner:
    'rank:<global rank>/<device>')."""
    whole = block_sizes(blocks, shape[dim])
    c = whole[block] // size
    offsets = [0] * len(shape)
    offsets[dim] = sum(whole[:block]) + coord * c
    sizes = list(shape)
    sizes[dim] = c
    return ShardMetadata(offsets, sizes, owner)


def logical_size(local: torch.Size, dim: int, size: int) -> torch.Size:
    shape = list(local)
    shape[dim] *= size
    return torch.Size(shape)


def packed_tensor(local: torch.Tensor, mesh: Mesh, axis: str, dim: int, blocks: tuple[int, ...]) -> ShardedTensor:
    """This rank's packed shard -> a ShardedTensor of the logical tensor (no collective: every rank
    describes every piece itself)."""
    size, mine = mesh.size(axis), mesh.coord(axis)
    ranks = mesh.group_ranks((axis,))  # the global ranks along the axis, in coordinate order
    shape = logical_size(local.shape, dim, size)
    owner = [f"rank:{r}/{local.device}" for r in ranks]
    pieces = [Shard(chunk.contiguous(), _piece(shape, dim, blocks, size, mine, b, owner[mine]))
              for b, chunk in enumerate(local.split(block_sizes(blocks, local.size(dim)), dim))]
    everyone = [_piece(shape, dim, blocks, size, k, b, owner[k]) for k in range(size) for b in range(len(blocks))]
    meta = ShardedTensorMetadata(everyone, shape, TensorProperties.create_from_tensor(local))
    return ShardedTensor._init_from_local_shards_and_global_metadata(pieces, meta, process_group=mesh.group(axis))


def packed_local(loaded: ShardedTensor) -> torch.Tensor:
    """The pieces a ShardedTensor read back, side by side in block order: the local packed layout."""
    shards = sorted(loaded.local_shards(), key=lambda s: s.metadata.shard_offsets)
    if len(shards) == 1:
        return shards[0].tensor
    dim = next(d for d, (a, b) in enumerate(zip(shards[0].metadata.shard_offsets, shards[1].metadata.shard_offsets))
               if a != b)
    return torch.cat([s.tensor for s in shards], dim)


def packed_slice(full: torch.Tensor, dim: int, blocks: tuple[int, ...], size: int, rank: int) -> torch.Tensor:
    """This rank's packed shard cut from the logical tensor (rank's chunk of each block, side by side)."""
    whole = full.split(block_sizes(blocks, full.size(dim)), dim)
    return torch.cat([block.chunk(size, dim)[rank] for block in whole], dim)
