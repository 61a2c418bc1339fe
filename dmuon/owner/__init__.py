"""Owner-sharded data parallel: every Muon weight matrix lives whole on one owner rank.

Under FSDP2 each matrix is split row-wise over all ranks, so Muon must gather it to an owner and
send the update back — two extra transfers per step. Here the matrix is *stored* on its owner
instead (the DMuon paper's "dedicated ownership"), so the optimizer step moves nothing:

* **setup** (:func:`shard_by_owner`): the planner picks an owner per parameter, balancing
  Newton–Schulz FLOPs and bytes kept (:func:`dmuon.planner.plan_ownership`); the weights are
  broadcast from rank 0 once (as DDP does), then every other rank frees its copy (the tensor
  keeps its shape; its storage is resized to zero bytes).
* **forward**: before a layer runs, its matrices are broadcast from their owners (one call per
  owner and dtype per layer), and the next layer's broadcast is started so that it overlaps
  this layer's compute (the order is learnt from the first forward).
* **after forward**: ``reshard_after_forward=False`` ("Z2") keeps the broadcast weights until the
  layer's backward is done; ``True`` ("Z3") frees them at once and broadcasts them again when the
  backward reaches the layer — less memory, 3(N−1)/N·P bytes per step instead of 2(N−1)/N·P.
* **backward**: as soon as all gradients of a layer are ready, they are summed onto their owners
  (one ``reduce`` per owner and dtype, asynchronous) and the copies elsewhere are dropped; the
  owner's gradient becomes the average. Inside :meth:`OwnerSharding.no_sync` gradients only
  accumulate locally (gradient accumulation), and the reduce happens on the last micro-batch.
  Without ``no_sync`` every backward reduces, and gradients add up as under DDP: an owner sets
  its averaged gradient aside when the next backward reaches the parameter (a tensor hook runs
  before autograd accumulates), and adds the next average to it. The reduces are waited for
  when the backward pass ends; while early start listens
  (:meth:`OwnerSharding.notify_final_gradients`, within one replica), each layer's when the next
  layer's starts, so that its owner can begin Newton–Schulz on it during the backward pass.
* **step**: :class:`dmuon.Muon` sees that a parameter is owner-sharded and, on its owner only,
  runs momentum, Newton–Schulz and the update locally; other ranks hold no state for it.

**HSDP** (a 2-D (replicate, shard) mesh): each replica holds every matrix once among its shard
ranks, as above; after the reduce within the replica, the holders' sums go on to the holder in
replica 0, which alone steps (each matrix is still orthogonalized once in the whole job), and its
updated weight reaches the other replicas' holders at the start of the next forward, every
layer's at once, so that it overlaps that forward.

Parameters Muon does not update stay with DDP/FSDP2 (``fully_shard(...,
ignored_params=sharding.params)``), or, with ``replicate_rest=True`` (the default), are kept
replicated here: broadcast from rank 0 at setup, gradients all-reduced (averaged) in backward.

Checkpoints: ``model.state_dict()`` holds, on each rank, the matrices it owns (whole, as plain
tensors), and the optimizer holds their state; ``torch.distributed.checkpoint`` therefore saves
each matrix once, from its owner, and loads it at any world size or into any other layout.

Only public torch APIs are used: module forward hooks, tensor gradient hooks,
``Tensor.register_post_accumulate_grad_hook``, ``UntypedStorage.resize_``, state-dict hooks and
``torch.distributed`` collectives.

The modules, along the seams of FSDP2's own: :mod:`~dmuon.owner.setup` (the groups, the layers
and the owners, agreed by every rank), :mod:`~dmuon.owner.layer` (one layer's weights and their
collectives, with an explicit :class:`~dmuon.owner.layer.LayerState`),
:mod:`~dmuon.owner.sharding` (the hooks, ``no_sync`` and gradient waiting) and
:mod:`~dmuon.owner.checkpoint` (the state-dict hooks).
"""

from dmuon.owner.setup import shard_by_owner
from dmuon.owner.sharding import OwnerSharding

__all__ = ["OwnerSharding", "shard_by_owner"]
