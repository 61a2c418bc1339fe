"""Early start: Newton–Schulz during the backward pass, the decision at ``step()``.

Without it, every Newton–Schulz call waits for ``step()``, after the whole backward pass, and
sits on the critical path in full. With it, a bucket of the step plan starts as soon as the
gradients of its matrices are final — from a post-accumulate-grad hook, which autograd calls
for plain tensors and FSDP2 calls after the reduce-scatter (and HSDP's all-reduce) of the
module's gradients — while the backward pass goes on with earlier layers:

    backward of layer L … 1       hook: bucket k's gradients final → its exchange and NS start
    step()                        finish the run → the ranks agree → apply the updates (or not)

The plan's buckets are cut in the order the backward pass finishes gradients (the model's order
reversed), and the run is the engine's staged run of the step plan (:meth:`Engine.stages`; with
several exchange groups, such as expert stacks beside matrices, one group's after the other's),
driven by the hooks instead of by ``step()``, so the same calls run on the same values as in a
step without early start: the same bits.

What runs early changes nothing the user can see: the momentum the Newton–Schulz input needs is
computed out of place, and the updates are held until ``step()``. There the run is finished
(every rank issues the rest of its collectives, so none is left waiting), the ranks agree, and
the held updates are applied only if every rank can use them: no rank skipped the step
(non-finite gradients), the step stepped the same parameters with the same plan, and on every
rank every gradient and momentum buffer is the tensor, at the version and with the values, that
the run read. A gradient changed after it was read — a second backward (gradient accumulation
outside ``Muon.accumulating()``, the layouts' ``no_sync()`` or FSDP2's
``set_requires_gradient_sync(False)``, which keep earlier micro-batches from starting anything),
clipping or unscaling between ``backward()`` and ``step()`` — makes the step run as without
early start, and early start turns itself off with a warning, since it would only repeat work.
A change is found by the gradient's version counter where the gradient has its memory to itself
(views of one buffer share a counter, so FSDP2's gradients, views of one reduce-scatter output,
count each other's accumulation), and always by its :func:`~dmuon.tensors.digest` (the sums of
its bits and of its values), which sees what the counter does not (GradScaler's unscaling,
foreach ops on DTensors such as ``clip_grad_norm_``'s, writes through ``.data``): a change of one
element or a scaling moves it; a change that keeps both sums (a permutation of a gradient's
elements, in place in a shared buffer or through ``.data``) would escape it.

Memory: the held updates are one tensor per Muon parameter (this rank's piece), as large as the
momentum; with the momentum, the state is then AdamW's two tensors per parameter.

Where it pays: ``early_start=None`` (the default) turns it on for CUDA parameters, where the
run's own stream fills the backward pass's idle time, and off on CPU, where the hooks run on the
backward pass's own thread and there is no idle time to fill (no gain beyond the noise was
measured, and the held updates cost memory). It does not pay on small models whose step is bound
by kernel launches: pass ``early_start=False`` there. ``True`` forces it. The measurements behind
these defaults are in docs/options.md ("Early start").

DDP (:mod:`.ddp`): ``Muon.register_ddp_comm_hook(model)`` registers dmuon's comm hook. DDP's
gradients are then in its bucket, copied into ``param.grad`` only at the end of the backward pass
(unless ``gradient_as_bucket_view``), so ``step()`` checks that ``param.grad`` has the bits the
run read. Under ``no_sync`` DDP calls no hook, so gradient accumulation starts nothing before the
last micro-batch. Without the comm hook, DDP's parameters run as without early start.

Owner sharding (:mod:`dmuon.owner`): a matrix's gradient is final on its owner once the reduce
of its layer is done. The sharding tells early start (``notify_final_gradients``): while it
listens, it waits for a layer's reduce when the next layer's starts, instead of all at the end of
the backward pass. Each owner's plan holds only its own matrices and exchanges nothing, so each
rank's run goes at its own pace. Across replicas (HSDP) the sums meet only at the end of the
backward pass, and the step runs as without early start.

Where the step plan has strategies that do not run in stages (gangs, distributed Newton–Schulz),
or with ``compile`` or ``cuda_graphs``, or with 1-D row-wise tensor parallel (``Shard(1)``
alone), the step runs as without early start (:mod:`.eligibility`); :attr:`EarlyStart.status`
says why. The row and piece exchanges run in stages (FSDP + tensor parallel and 2-D blocks
too). On CUDA the early work runs on a stream of its own, so that it can overlap the backward
pass.

The modules: :mod:`.eligibility` (whether it can run a plan: pure, an input of the plan's key),
:mod:`.run` (one backward pass's run and its verdict), :mod:`.ddp` (DDP's comm hook),
:mod:`.start` (the optimizer's early start: hooks, arming, and the calls the stepper makes).
"""
