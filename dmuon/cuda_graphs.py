"""Newton–Schulz replayed from CUDA graphs: one graph per stack shape, dtype and recipe.

A Newton–Schulz call is a few dozen small kernels (normalize, cast, 2–3 batched products per
step); for the modest matrices of most layers the launches, not the products, can dominate.
:class:`GraphedOrthogonalize` captures each distinct call once into a CUDA graph over a static
input buffer and replays it afterwards: copy the input in, replay, clone the output out (the
clone, because the next replay of the same graph — the next bucket with a matrix of that shape —
rewrites the static output while this one's result may still be in flight to other ranks).
All graphs share one memory pool: replays run one after the other on one stream, and a graph's
static output stays allocated, so no two graphs hand out the same memory.

The capture itself is the only part that needs a GPU. The bookkeeping around it — one entry
per key, the copy in and the clone out — is the same for :class:`EagerReplay`, the CPU twin that
the tests drive (``dmuon.Muon(cuda_graphs=True)`` on CPU parameters runs Newton–Schulz eagerly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dmuon.orthogonalization import NSConfig

Orthogonalize = Callable[[Tensor, NSConfig], Tensor]
WARMUP_CALLS = 3  # on a side stream before capture, as torch's CUDA-graph notes ask


@dataclass
class Replay:
    """One captured call: its static input and output, and how to run it again."""

    static_input: Tensor
    static_output: Tensor
    replay: Callable[[], None]


def capture_cuda_graph(fn: Orthogonalize, G: Tensor, config: NSConfig, pool: tuple | None) -> Replay:
    """Capture ``fn(·, config)`` on a static copy of ``G`` into a CUDA graph in ``pool``."""
    static_input = G.clone()
    side = torch.cuda.Stream(G.device)
    side.wait_stream(torch.cuda.current_stream(G.device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_CALLS):
            fn(static_input, config)
    torch.cuda.current_stream(G.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        static_output = fn(static_input, config)
    return Replay(static_input, static_output, graph.replay)


def eager_replay(fn: Orthogonalize, G: Tensor, config: NSConfig, pool: tuple | None) -> Replay:
    """The CPU twin of :func:`capture_cuda_graph`: "replaying" runs ``fn`` on the static input
    and writes the static output in place."""
    static_input = G.clone()
    static_output = fn(static_input, config)

    def replay() -> None:
        static_output.copy_(fn(static_input, config))

    return Replay(static_input, static_output, replay)


class GraphedOrthogonalize:
    """``fn(G, config)`` with each distinct (shape, dtype, device, config) captured once and
    replayed afterwards. ``capture`` makes a :class:`Replay`: CUDA graphs on CUDA tensors by
    default; tensors elsewhere run ``fn`` directly unless a twin is given for them."""

    def __init__(self, fn: Orthogonalize, cpu_twin: Callable[..., Replay] | None = None) -> None:
        self.fn = fn
        self.cpu_twin = cpu_twin
        self.replays: dict[tuple, Replay] = {}
        self._pool: tuple | None = None

    def __call__(self, G: Tensor, config: NSConfig) -> Tensor:
        capture = capture_cuda_graph if G.device.type == "cuda" else self.cpu_twin
        if capture is None:
            return self.fn(G, config)
        key = (tuple(G.shape), G.dtype, G.device, config)
        entry = self.replays.get(key)
        if entry is None:
            if G.device.type == "cuda" and self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            entry = self.replays[key] = capture(self.fn, G, config, self._pool)
        entry.static_input.copy_(G)
        entry.replay()  # capturing records the kernels without running them: replay even the first time
        return entry.static_output.clone()
