"""Tensor-parallel KV pools on ``torch.distributed``: one plan, one scheduler, many shards.

- :func:`agree_plan`: every rank of a TP group sizes the same pool (from the group's minimum
  memory) and checks it made the same plan; errors are raised on every rank, never on one.
- :class:`StepBroadcaster`: rank 0 (the allocator and radix cache) sends each step's batch
  metadata (page table, seq_lens, slots, ...) to every rank in one broadcast of a packed int32
  buffer.
- :func:`kv_heads_of_rank` / :func:`shard_kv_heads`: which global KV heads a rank's pool holds.
- :func:`on_every_rank`: run a step (allocating the shard) and raise on every rank if one failed.
- DP attention for MLA (``agree_plan(..., dp_attention=True)``): each attention-DP rank holds
  different requests' latents; :class:`GroupPlan` states the capacity per rank and in total.

Runs on gloo (CPU, what CI tests) and NCCL. Importing this module does not import torch.
"""

from kvpool.distributed._collective import CollectiveError, RankMismatchError, on_every_rank
from kvpool.distributed.heads import kv_heads_of_rank, shard_kv_heads
from kvpool.distributed.plan import GroupPlan, agree_plan, tp_plan

__all__ = [
    "CollectiveError",
    "GroupPlan",
    "RankMismatchError",
    "StepBroadcaster",
    "agree_plan",
    "kv_heads_of_rank",
    "on_every_rank",
    "shard_kv_heads",
    "tp_plan",
]


def __getattr__(name: str):
    # StepBroadcaster holds torch tensors; import torch only when it is asked for.
    if name == "StepBroadcaster":
        from kvpool.distributed.broadcast import StepBroadcaster

        return StepBroadcaster
    raise AttributeError(f"module 'kvpool.distributed' has no attribute {name!r}")
