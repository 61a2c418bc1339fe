"""Hardware profiles for the cost model: what one rank can compute, copy and send per second.

GPU profiles are datasheet figures (docs/hardware.md) except where a measurement exists; the
``"cpu"`` profile is measured on the spot, on this machine, by :func:`measure_cpu_profile`.

What a profile claims, and what it leaves out:

* ``*_flops``: dense matrix-product FLOP/s of one rank per compute dtype. ``matmul_efficiency``
  is the share of it Newton–Schulz products reach (large GEMMs; no small-matrix roll-off).
* ``memory_bandwidth``: bytes/s of one rank's element-wise kernels (read + write).
* ``check_rate``: elements/s of the optimizer's non-finite check (CPU: measured, since a
  reduction there runs below ``memory_bandwidth``). None: memory-bound like the other
  element-wise kernels (GPUs).
* Links, per rank and per direction: ``intra_*`` between ranks of one node, ``inter_*`` between
  nodes of ``ranks_per_node`` ranks. A collective costs one latency plus its busiest rank's
  bytes over the link (:mod:`dmuon.tools.simulate`).
* ``cores`` (CPU only): the ranks of a node time-share its cores with each other and with
  ``busy_cores`` worth of other jobs, so each rank thread gets ``(cores − busy)/(ranks·threads)``
  of a core (at most one), at ``parallel_efficiency`` of its alone-speed once several run at
  once (shared caches, memory, clocks, the scheduler's unfairness among more processes than
  cores; measured per process count, gated by the slowest process). This scales compute, memory
  and loopback rates alike: gloo's loopback copies run on the same cores.
* ``collective_efficiency``: the share of the link bandwidth a ring all-gather, reduce-scatter
  or all-reduce reaches per ring byte (NCCL: assumed 1; gloo: measured).
* ``comm_overlaps_compute``: GPUs move data with copy engines and NCCL kernels beside the
  compute kernels; on a CPU gloo's loopback copies run on the very cores that compute, so
  communication and computation add up instead of overlapping.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import statistics
import threading
import time
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist

from dmuon.ns_defaults import default_dtype
from dmuon.tools.models import LlamaConfig, VLAConfig
from dmuon.tools.workloads import build_model, local_batch, make_data, training_loss

GB = 1e9
TERA = 1e12


@dataclass(frozen=True)
class HardwareProfile:
    """One rank's compute, memory and link figures (SI units: FLOP/s, bytes/s, seconds)."""

    name: str
    device_type: str  # "cuda" or "cpu": decides the Newton–Schulz method and dtype dmuon picks
    bf16_flops: float
    fp16_flops: float
    fp32_flops: float
    memory_bandwidth: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    ranks_per_node: int | None  # None: every rank on one node (the CPU profile)
    matmul_efficiency: float = 1.0
    mfu: float | None = None  # default forward+backward FLOPs utilization; None: measure it
    train_dtype: torch.dtype = torch.bfloat16  # dtype of the forward/backward products
    cores: int | None = None
    # (processes, efficiency) measured (CPU); between counts, the largest count not above applies
    parallel_efficiency: tuple[tuple[int, float], ...] = ()
    busy_cores: float = 0.0  # other jobs' CPU use to expect (measured: during the profiling or a run)
    threads: int = 1  # threads per rank the rates were measured with (CPU)
    comm_overlaps_compute: bool = True
    # (kind, fraction of the link bandwidth a ring collective of RING_BYTES reaches); 1 if absent
    collective_efficiency: tuple[tuple[str, float], ...] = ()
    check_rate: float | None = None  # elements/s of the non-finite check; None: memory-bound
    # early start's capacity: the share of the backward pass's time in which Newton–Schulz on a
    # stream of its own gets the device (0 on CPU: the hooks run on the backward pass's thread)
    backward_idle_fraction: float = 0.0
    source: str = ""

    def matmul_flops(self, dtype: torch.dtype) -> float:
        """Listed dense matrix-product rate for ``dtype`` (fp64 and others: the fp32 rate)."""
        return {torch.bfloat16: self.bf16_flops, torch.float16: self.fp16_flops}.get(dtype, self.fp32_flops)

    def share(self, ranks_on_node: int) -> float:
        """Fraction of its measured compute and memory rates one rank gets when
        ``ranks_on_node`` ranks run at once (module docstring; 1 on GPUs)."""
        if self.cores is None:
            return 1.0
        threads = ranks_on_node * self.threads
        return min(1.0, max(self.cores - self.busy_cores, 0.1) / threads) * self.efficiency_of(threads)

    def efficiency_of(self, processes: int) -> float:
        """:attr:`parallel_efficiency` with ``processes`` running at once (1 alone)."""
        measured = [e for count, e in self.parallel_efficiency if count <= processes]
        return measured[-1] if measured and processes > 1 else 1.0

    def ring_efficiency(self, kind: str) -> float:
        """Fraction of the link bandwidth a ring ``kind`` (:data:`RING_BYTES`) reaches."""
        return dict(self.collective_efficiency).get(kind, 1.0)

    def ranks_on_node(self, world_size: int) -> int:
        return world_size if self.ranks_per_node is None else min(world_size, self.ranks_per_node)


# Links (docs/hardware.md §GPU profiles): NVLink 4 900 GB/s per GPU both ways → 450 GB/s each way; A800's
# NVLink 400 GB/s → 200 each way; InfiniBand NDR 400 Gb/s ≈ 50 GB/s per GPU per direction.
# Latencies are assumptions of typical NCCL small-message collectives, not datasheet figures:
# ≈10 µs inside a node, ≈25 µs across nodes, per collective (not per peer).
_NVLINK_LATENCY, _IB_LATENCY = 10e-6, 25e-6
# The one measurement of achieved against listed matmul rate we have: 790 of 989 TFLOP/s on
# an H200 (docs/hardware.md §GPU profiles). Applied to the datasheet profiles.
_DATASHEET_EFFICIENCY = 790 / 989
# A typical forward+backward utilization of dense LLM training on these GPUs (an assumption;
# override it per run).
DEFAULT_GPU_MFU = 0.4
# Early start's capacity on GPUs, from one measurement (docs/options.md, "Early start"): on an H200,
# one process, a 4-layer Llama-3.2-3B, early start hid 11–23 ms of a 57–70 ms optimizer overhead
# in a backward pass of about 283 ms: 4–8 % of it. An assumption elsewhere; override it per profile.
BACKWARD_IDLE_FRACTION = 0.06

PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        "h100", "cuda", bf16_flops=989 * TERA, fp16_flops=989 * TERA, fp32_flops=67 * TERA,
        memory_bandwidth=3.35e12, intra_bandwidth=450 * GB, intra_latency=_NVLINK_LATENCY,
        inter_bandwidth=50 * GB, inter_latency=_IB_LATENCY, ranks_per_node=8,
        matmul_efficiency=_DATASHEET_EFFICIENCY, mfu=DEFAULT_GPU_MFU, backward_idle_fraction=BACKWARD_IDLE_FRACTION,
        source="H100 SXM datasheet: 989 TFLOP/s bf16/fp16 dense, 67 fp32 (non-tensor), 3.35 TB/s; "
               "NVLink 4, InfiniBand NDR",
    ),
    "h200": HardwareProfile(
        "h200", "cuda", bf16_flops=790 * TERA, fp16_flops=790 * TERA, fp32_flops=67 * TERA,
        memory_bandwidth=4.3e12, intra_bandwidth=450 * GB, intra_latency=_NVLINK_LATENCY,
        inter_bandwidth=50 * GB, inter_latency=_IB_LATENCY, ranks_per_node=8,
        matmul_efficiency=1.0, mfu=DEFAULT_GPU_MFU, backward_idle_fraction=BACKWARD_IDLE_FRACTION,
        source="H200 measured: 790 TFLOP/s bf16 products (fp16 assumed equal: same tensor cores), "
               "4.3 TB/s device copy (datasheet 989 / 4.8); fp32 67 TFLOP/s datasheet; NVLink 4, NDR",
    ),
    "a100": HardwareProfile(
        "a100", "cuda", bf16_flops=312 * TERA, fp16_flops=312 * TERA, fp32_flops=19.5 * TERA,
        memory_bandwidth=2.0e12, intra_bandwidth=300 * GB, intra_latency=_NVLINK_LATENCY,
        inter_bandwidth=25 * GB, inter_latency=_IB_LATENCY, ranks_per_node=8,
        matmul_efficiency=_DATASHEET_EFFICIENCY, mfu=DEFAULT_GPU_MFU, backward_idle_fraction=BACKWARD_IDLE_FRACTION,
        source="A100 SXM datasheet: 312 TFLOP/s bf16/fp16 dense, 19.5 fp32, 2.0 TB/s; NVLink 3 "
               "600 GB/s (300 each way); InfiniBand HDR 200 Gb/s per GPU (assumed)",
    ),
    "a800": HardwareProfile(
        "a800", "cuda", bf16_flops=312 * TERA, fp16_flops=312 * TERA, fp32_flops=19.5 * TERA,
        memory_bandwidth=2.0e12, intra_bandwidth=200 * GB, intra_latency=_NVLINK_LATENCY,
        inter_bandwidth=25 * GB, inter_latency=_IB_LATENCY, ranks_per_node=8,
        matmul_efficiency=_DATASHEET_EFFICIENCY, mfu=DEFAULT_GPU_MFU, backward_idle_fraction=BACKWARD_IDLE_FRACTION,
        source="A800 SXM datasheet: as A100 but NVLink 400 GB/s (200 each way); "
               "InfiniBand HDR 200 Gb/s per GPU (assumed)",
    ),
    "b200": HardwareProfile(
        "b200", "cuda", bf16_flops=2250 * TERA, fp16_flops=2250 * TERA, fp32_flops=80 * TERA,
        memory_bandwidth=8.0e12, intra_bandwidth=900 * GB, intra_latency=_NVLINK_LATENCY,
        inter_bandwidth=50 * GB, inter_latency=_IB_LATENCY, ranks_per_node=8,
        matmul_efficiency=_DATASHEET_EFFICIENCY, mfu=DEFAULT_GPU_MFU, backward_idle_fraction=BACKWARD_IDLE_FRACTION,
        source="B200 (HGX, 1000 W) public datasheet: 2250 TFLOP/s bf16/fp16 "
               "dense, 80 fp32, 8 TB/s HBM3e; NVLink 5 1.8 TB/s (900 each way); 400 Gb/s NIC per GPU",
    ),
}

HARDWARE_NAMES = (*PROFILES, "cpu")


def get_profile(name: str, threads: int = 1) -> HardwareProfile:
    """A named profile; ``"cpu"`` is measured on this machine (once per process and thread count)."""
    if name == "cpu":
        return measure_cpu_profile(threads)
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; valid names: {', '.join(HARDWARE_NAMES)}") from None


# ---------------------------------------------------------------------------- measurement


def _best_seconds(fn, reps: int) -> float:
    """Fastest of ``reps`` timed calls after a warm-up: the machine's capability, as free as
    possible of other jobs' interference (which :attr:`HardwareProfile.cores` accounts for)."""
    fn()  # warm-up: allocations, kernel selection
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_matmul_flops(dtype: torch.dtype, m: int = 1024, k: int = 4096, reps: int = 5,
                         budget_s: float = 5.0) -> float:
    """FLOP/s of an (m×k)·(k×m) product on the CPU (the shape of a Newton–Schulz X·Xᵀ).

    A CPU without native bf16/fp16 products emulates them (measured on an AVX2 AMD EPYC: bf16
    1.9 GFLOP/s against 21 in fp32), and the full product would then take minutes: a product of
    a quarter of each side is timed first, and where the full one's runs would exceed
    ``budget_s`` the rate is the small product's (slow kernels gain nothing from size)."""
    small_m, small_k = max(1, m // 4), max(1, k // 4)
    a, b = torch.randn(small_m, small_k).to(dtype), torch.randn(small_k, small_m).to(dtype)
    small_rate = 2 * small_m * small_k * small_m / _best_seconds(lambda: a @ b, 1)
    if 2 * m * k * m * (reps + 1) / small_rate > budget_s:
        return 2 * small_m * small_k * small_m / _best_seconds(lambda: a @ b, reps)
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, m).to(dtype)
    return 2 * m * k * m / _best_seconds(lambda: a @ b, reps)


def measure_memory_bandwidth(numel: int = 1 << 23, reps: int = 9) -> float:
    """Bytes/s of an element-wise kernel (``lerp_``: reads two fp32 tensors, writes one)."""
    x, y = torch.rand(numel), torch.rand(numel)
    return 12 * numel / _best_seconds(lambda: y.lerp_(x, 0.1), reps)


def measure_check_rate(numel: int = 1 << 20, reps: int = 9) -> float:
    """Elements/s of the optimizer's non-finite check (:func:`dmuon.tensors.finite_flags`) on
    fp32: measured rather than priced by its bytes, since reductions on CPUs run well below
    the memory bandwidth of the streaming element-wise kernels."""
    from dmuon.tensors import finite_flags  # the tools import the product only where they need it

    x = torch.rand(numel)
    return numel / _best_seconds(lambda: finite_flags([x]), reps)


def _products(m: int, k: int, reps: int) -> None:
    """``reps`` (m×k)·(k×m) products in the dtype dmuon's Newton–Schulz takes on this CPU: bf16
    where its products are native, fp32 where they are emulated (at about a tenth of fp32's
    rate there, the measurement would take minutes and time a kernel the ranks do not run)."""
    dtype = default_dtype("cpu", "standard")
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, m).to(dtype)
    for _ in range(reps):
        a @ b


def _products_worker(barrier, results, m: int, k: int, reps: int, trials: int) -> None:
    """One stand-in rank: after each barrier, the same products as the parent timed alone."""
    torch.set_num_threads(1)
    _products(m, k, 1)  # warm-up
    for _ in range(trials):
        barrier.wait()
        start = time.perf_counter()
        _products(m, k, reps)
        results.put(time.perf_counter() - start)


def measure_parallel_efficiency(cores: int, processes: int, m: int = 512, k: int = 2048, reps: int = 8,
                                trials: int = 5) -> tuple[float, float]:
    """(efficiency, other jobs' cores): ``processes`` single-threaded *processes* — as the ranks
    are — run the same products (:func:`_products`) at once on ``cores`` cores; the efficiency is the rate at
    which the slowest of them finishes (a synchronous step waits for its slowest rank) over
    what a fair share of the free cores would give, ``min(1, free cores / processes)`` of one
    process alone. The median of ``trials`` (``dmuon bench`` reports medians), corrected for the
    CPU other jobs took in each (:class:`OtherJobsCpu`); with the load of the last. (Threads of
    one process are no stand-in: on this machine two threads' bf16 products reached 0.53 of two
    processes' rate, which reach 0.92.)
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _best_seconds(lambda: _products(m, k, reps), 3)
    finally:
        torch.set_num_threads(previous)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes + 1), ctx.Queue()
    workers = [ctx.Process(target=_products_worker, args=(barrier, results, m, k, reps, trials), daemon=True)
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    efficiencies = []
    try:
        for _ in range(trials):
            barrier.wait(timeout=120)  # every worker started and warmed up
            with OtherJobsCpu() as others:
                slowest = max(results.get(timeout=120) for _ in range(processes))
            fair_share = min(1.0, max(cores - others.cores_used, 0.1) / processes)
            efficiencies.append(alone / fair_share / slowest)
    finally:
        for worker in workers:
            worker.join(timeout=30)
    return min(1.0, statistics.median(efficiencies)), others.cores_used


class OtherJobsCpu:
    """Cores' worth of CPU that other jobs used while the ``with`` block ran: the machine's busy
    time (``/proc/stat``, steal included) minus ours (this process and its children, read from
    ``/proc/<pid>/stat``), sampled every ``interval`` seconds. A measurement of the environment,
    independent of how fast our own work went. Linux only (elsewhere: 0).

    ``cores_used_in_last(s)`` covers the block's last ``s`` seconds — e.g. the measured steps at
    the end of a benchmark run, after its ranks have started.
    """

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self._children: dict[int, float] = {}  # pid → CPU seconds last seen (kept after exit)
        self._samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> OtherJobsCpu:
        self._samples.append(self._sample())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._samples.append(self._sample())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._samples.append(self._sample())

    def _sample(self) -> tuple[float, float, float]:
        """(time, machine busy CPU seconds, our CPU seconds)."""
        me = os.getpid()
        for pid, parent, cpu in _processes():
            if parent == me:
                self._children[pid] = cpu
        return time.perf_counter(), _machine_busy_seconds(), time.process_time() + sum(self._children.values())

    def cores_used_in_last(self, seconds: float | None = None) -> float:
        end = self._samples[-1]
        first = self._samples[0]
        if seconds is not None:
            first = next((s for s in self._samples if s[0] >= end[0] - seconds), first)
        wall, busy, ours = (e - f for e, f in zip(end, first))
        if wall <= 0 or busy != busy:  # no interval, or no /proc/stat
            return 0.0
        return max(0.0, (busy - ours) / wall)

    @property
    def cores_used(self) -> float:
        return self.cores_used_in_last(None)


def _processes() -> list[tuple[int, int, float]]:
    """(pid, parent pid, CPU seconds) of every process ``/proc`` shows."""
    if not os.path.isdir("/proc"):
        return []
    tick = os.sysconf("SC_CLK_TCK")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        found.append((int(entry), int(fields[1]), (int(fields[11]) + int(fields[12])) / tick))
    return found


def available_memory() -> int | None:
    """Bytes of memory new processes can have here (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gpu_memory(index: int = 0) -> int | None:
    """Bytes of memory of CUDA device ``index``, or None where it cannot be read."""
    try:
        return torch.cuda.get_device_properties(index).total_memory
    except (AssertionError, RuntimeError):
        return None


def machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (NaN where /proc/stat is missing)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# Ring collectives, as bytes each rank moves per byte of the full tensor on N ranks (the
# standard ring costs); what a measured collective achieves is compared with the all-to-all.
RING_BYTES = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
}


def measure_loopback_collectives(sizes: tuple[int, ...] = (1 << 12, 1 << 20, 1 << 24), reps: int = 15
                                 ) -> tuple[float, float, dict[str, float]]:
    """2-rank gloo collectives over loopback TCP: (all-to-all bandwidth bytes/s, latency s,
    efficiency of each ring collective in :data:`RING_BYTES`).

    The two ranks are threads of this process with their own gloo process groups (gloo runs
    its collectives without the GIL), which saves spawning processes. In the all-to-all each
    rank sends ``n`` bytes and receives ``n``; a least-squares line through (n, fastest time of
    the slower rank) gives the latency (intercept) and the bandwidth (inverse slope). A ring
    collective's efficiency is its ring bytes per second on the largest size over that
    bandwidth (gloo's reduce-scatter, for one, is slower per byte than its all-to-all). Fifteen
    repetitions: with five, the ring rates of consecutive measurements on this machine spread
    2× (all-gather 0.5–1.1 GB/s), with fifteen 1.4× (0.9–1.2).
    """
    store = dist.HashStore()
    times: dict[int, dict[tuple[str, int], float]] = {}
    errors: list[BaseException] = []
    largest = max(sizes)

    def rank_main(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("dmuon-loopback", store), rank, 2)
            mine = {}
            for nbytes in sizes:
                n = nbytes // 4
                send, recv = torch.ones(2 * n), torch.empty(2 * n)
                mine["all_to_all", nbytes] = _best_seconds(
                    lambda: group.alltoall_base(recv, send, [n, n], [n, n]).wait(), reps)
            full, shard = torch.ones(largest // 4), torch.ones(largest // 8)
            mine["all_gather", largest] = _best_seconds(lambda: group._allgather_base(full, shard).wait(), reps)
            mine["reduce_scatter", largest] = _best_seconds(
                lambda: group._reduce_scatter_base(shard, full).wait(), reps)
            mine["all_reduce", largest] = _best_seconds(lambda: group.allreduce([full]).wait(), reps)
            times[rank] = mine
        except BaseException as err:  # surfaced in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    slower = {key: max(times[r][key] for r in times) for key in times[0]}
    seconds = [slower["all_to_all", n] for n in sizes]
    mean_n, mean_t = statistics.fmean(sizes), statistics.fmean(seconds)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes, seconds)) / sum((n - mean_n) ** 2 for n in sizes)
    bandwidth = 1 / max(slope, 1e-15)
    latency = max(0.0, mean_t - mean_n / bandwidth)
    efficiency = {kind: min(1.0, ring(2) * largest / slower[kind, largest] / bandwidth)
                  for kind, ring in RING_BYTES.items()}
    return bandwidth, latency, efficiency


@cache
def measure_cpu_profile(threads: int = 1) -> HardwareProfile:
    """This machine as one rank with ``threads`` torch threads sees it (a few seconds; cached).

    Rates are the fastest of a few runs of one rank alone (products and ``lerp_`` in one thread
    of this process; the loopback between two such ranks); the parallel efficiency comes from
    :func:`measure_parallel_efficiency`; ``busy_cores`` is what other jobs used meanwhile (a
    busy machine depresses even the fastest runs). To predict a run on a shared machine, set
    ``busy_cores`` to what other jobs used during that run (:class:`OtherJobsCpu`).
    """
    cores = machine_cores()
    previous = torch.get_num_threads()
    try:
        with OtherJobsCpu() as others:
            torch.set_num_threads(1)
            efficiency = tuple((count, measure_parallel_efficiency(cores, count)[0])
                               for count in sorted({cores, 2 * cores}))
            torch.set_num_threads(threads)
            bf16, fp32 = measure_matmul_flops(torch.bfloat16), measure_matmul_flops(torch.float32)
            fp16 = measure_matmul_flops(torch.float16, m=256, k=1024)  # often emulated on CPUs: slow
            memory = measure_memory_bandwidth()
            check = measure_check_rate()
            bandwidth, latency, collective_efficiency = measure_loopback_collectives()
    finally:
        torch.set_num_threads(previous)
    busy = others.cores_used
    efficiencies = ", ".join(f"{e:.2f} at {count} processes" for count, e in efficiency)
    profile = HardwareProfile(
        "cpu", "cpu", bf16_flops=bf16, fp16_flops=fp16, fp32_flops=fp32, memory_bandwidth=memory,
        intra_bandwidth=bandwidth, intra_latency=latency, inter_bandwidth=bandwidth, inter_latency=latency,
        ranks_per_node=None, matmul_efficiency=1.0, mfu=None, train_dtype=torch.float32, cores=cores,
        parallel_efficiency=efficiency, busy_cores=busy, threads=threads, comm_overlaps_compute=False,
        collective_efficiency=tuple(sorted(collective_efficiency.items())), check_rate=check,
        source=f"measured on this machine ({cores} cores, parallel efficiency {efficiencies}; "
               f"{busy:.2f} busy with other jobs; {threads} thread(s) per rank; gloo loopback)",
    )
    # the two loopback ranks shared the cores: per rank, with a core of its own
    per_rank = bandwidth / profile.share(2)
    return dataclasses.replace(profile, intra_bandwidth=per_rank, inter_bandwidth=per_rank)


@dataclass(frozen=True)
class OneRankSeconds:
    """One rank alone training the model of ``config`` as ``dmuon bench`` does (fastest of a few steps)."""

    forward_backward: float
    optimizer_step: float  # dmuon.Muon with its defaults (AdamW on what is not a matrix)
    newton_schulz: float  # of which the Newton–Schulz calls (normalization and casts included)


def measure_one_rank_seconds(config: LlamaConfig | VLAConfig, batch: int, seq_len: int, threads: int = 1,
                             reps: int = 5) -> OneRankSeconds:
    """Time forward+backward and ``dmuon.Muon``'s step of the model of ``config`` on
    ``batch``×``seq_len`` tokens (a VLA: ``batch`` samples) in one process on the CPU, fp32 — what
    every rank of ``dmuon bench`` runs. Each step follows a backward, as in training, so the
    optimizer meets the caches a backward leaves."""
    from dmuon.optimizer import Muon  # the cost model's layer sits above the optimizer

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(config)
        optimizer = Muon(model, lr=1e-3)
        data = local_batch(make_data(config), 0, batch, seq_len, 0, 1, torch.device("cpu"))
        forward_backward, optimizer_step = float("inf"), (float("inf"), 0.0)
        for rep in range(reps + 1):  # the first is a warm-up
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            training_loss(model, data).backward()
            middle = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            if rep:
                forward_backward = min(forward_backward, middle - start)
                optimizer_step = min(optimizer_step, (end - middle, optimizer.last_step_stats.ns_seconds))
        return OneRankSeconds(forward_backward, *optimizer_step)
    finally:
        torch.set_num_threads(previous)
