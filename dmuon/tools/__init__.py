"""dmuon's tools: what measures, compares and predicts the optimizer, apart from the optimizer.

* :mod:`~dmuon.tools.cli` — the ``dmuon`` command line (``dmuon bench``, ``dmuon demo``,
  ``dmuon plan``; also ``python -m dmuon``);
* :mod:`~dmuon.tools.bench` — AdamW, vanilla Muon and ``dmuon.Muon`` side by side under DDP
  and FSDP2 on gloo ranks it spawns; :mod:`~dmuon.tools.throughput` — its GPU tables
  (Newton–Schulz throughput, one rank's share, symmetric products);
* :mod:`~dmuon.tools.demo` — the one-process comparison;
* :mod:`~dmuon.tools.peers` — other distributed Muon packages, wrapped for the bench;
* :mod:`~dmuon.tools.plan_cli` — ``dmuon plan``: the plan and predicted step times at N ranks;
* :mod:`~dmuon.tools.costmodel` and :mod:`~dmuon.tools.simulate` — the cost model and the
  step simulator behind it; :mod:`~dmuon.tools.hardware` — hardware profiles (measured on this
  machine, or from datasheets);
* :mod:`~dmuon.tools.models` — the workloads: a small Llama-style model, its presets and
  synthetic data.

Nothing in the product (``dmuon/*.py``: the optimizer, plan, strategies, exchange,
Newton–Schulz core and kernels, owner sharding, integrations) imports these modules:
``import dmuon`` and an optimizer step never load them (``tests/unit/test_package_layout.py``).
Timing the product needs itself (``symmetric_products="auto"``) lives in :mod:`dmuon.timing`.
"""
