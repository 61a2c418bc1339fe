"""How the engine orthogonalizes the works of a step plan, one module per layout family:
:mod:`~dmuon.strategies.rows` (the row exchange: DDP, FSDP2, HSDP, tensor parallel, one
process), :mod:`~dmuon.strategies.pieces` (every other sharding: each rank's piece to the owner
and back),
:mod:`~dmuon.strategies.column_blocks` (distributed Newton–Schulz on 1-D sharded matrices) and
:mod:`~dmuon.strategies.gangs` (one matrix split over a gang of ranks). Each takes its works and
plan when built and has one method, ``run(io, ctx)``; :mod:`~dmuon.strategies.base` holds what
they share."""
