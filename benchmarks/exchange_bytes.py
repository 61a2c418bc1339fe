"""Bytes dmuon's step sends per rank in each layout of 2-D and 1-D meshes, beside FSDP2's bound.

    python benchmarks/exchange_bytes.py [--json PATH]

On 4 gloo ranks, one Muon step of a few matrices per layout — FSDP2 on a 1-D mesh, and on a
(2, 2) mesh FSDP x column-wise TP, FSDP x row-wise TP, 2-D blocks, HSDP replicas beside
row-wise TP, expert stacks sharded on dim 1 or 2 over the expert-FSDP axis — counted by
``last_step_stats.bytes_sent`` at the second step (the first also exchanges the pieces' index
lists, once), less the agreement header. The bound is FSDP2's exchange: 2(N-1)/N of the Muon
weights spread over the N ranks, per rank on average. Gathering each matrix whole on every rank
and broadcasting its update from the owner, as dmuon did before the piece exchange, moves
2(N-1)/N of the weights per rank: N times the bound.
"""

from __future__ import annotations

import argparse
import json

import torch
from gloo_ranks import on_gloo_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import dmuon
from dmuon.agreement import HEADER_LEN

WORLD = 4
SHAPES = [(512, 256), (256, 512), (384, 384)]
STACKS = [(8, 128, 256), (8, 256, 128)]
LAYOUTS = {  # name: (mesh shape, placements, shapes)
    "FSDP2 (1-D)": ((WORLD,), [Shard(0)], SHAPES),
    "FSDP x column-wise TP": ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)], SHAPES),
    "FSDP x row-wise TP": ((2, 2), [Shard(0), Shard(1)], SHAPES),
    "2-D blocks, columns first": ((2, 2), [Shard(1), Shard(0)], SHAPES),
    "HSDP replicas x row-wise TP": ((2, 2), [Replicate(), Shard(1)], SHAPES),
    "expert stacks, EFSDP on dim 1": ((2, 2), [Shard(0), Shard(1)], STACKS),
    "expert stacks, EFSDP on dim 2": ((2, 2), [Shard(0), Shard(2)], STACKS),
}


def step_bytes(mesh_shape: tuple[int, ...], placements: list, shapes: list) -> tuple[int, int]:
    """(bytes this rank sent in dmuon's second step, less the header; bytes of the Muon weights)."""
    mesh = init_device_mesh("cpu", mesh_shape)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g) for s in shapes]
    params = [nn.Parameter(distribute_tensor(t, mesh, placements, src_data_rank=None)) for t in full]
    opt = dmuon.Muon([{"params": params, "algorithm": "muon", "param_names": [f"w{i}" for i in range(len(params))]}],
                     lr=0.02, ns_dtype=torch.float32)
    for _ in range(2):
        for p, t in zip(params, full):
            p.grad = distribute_tensor(t.flip(0), mesh, placements, src_data_rank=None)
        opt.step()
    return opt.last_step_stats.bytes_sent - 4 * HEADER_LEN, sum(t.numel() * t.element_size() for t in full)


def every_layout(rank: int, world: int, results: dict) -> None:
    for name, (mesh_shape, placements, shapes) in LAYOUTS.items():
        results[(name, rank)] = step_bytes(mesh_shape, placements, shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    results = on_gloo_ranks(WORLD, every_layout)
    rows = {}
    print(f"{WORLD} gloo ranks, one dmuon step (fp32): kB sent per rank, against FSDP2's bound 2(N-1)/N x W / N")
    print(f"{'layout':<32} {'mean':>8} {'max':>8} {'bound':>8} {'mean/bound':>11} {'gathered':>9}")
    for name in LAYOUTS:
        sent = [results[(name, r)][0] for r in range(WORLD)]
        weights = results[(name, 0)][1]
        bound = 2 * (WORLD - 1) / WORLD * weights / WORLD
        mean = sum(sent) / WORLD
        rows[name] = dict(mean_bytes=mean, max_bytes=max(sent), bound_bytes=bound, weights_bytes=weights)
        print(f"{name:<32} {mean / 1e3:>8.1f} {max(sent) / 1e3:>8.1f} {bound / 1e3:>8.1f} {mean / bound:>11.2f} "
              f"{WORLD * bound / 1e3:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
