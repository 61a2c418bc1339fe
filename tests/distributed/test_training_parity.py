"""End-to-end training parity (docs/testing.md row 4): a small Llama-style transformer trained with
dmuon.Muon under DDP, FSDP2 and HSDP, the data split across ranks, against one process on the
global batch — losses and parameters agree to the tolerance that reduction order allows (the
run itself: ``tests.helpers.train_llama``, which the owner-sharding tests compare with too)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_on_ranks
from tests.helpers import single_process
from tests.helpers import train_llama as train


@pytest.fixture(scope="module")
def reference() -> dict:
    return single_process(train, None)


@pytest.mark.parametrize("parallel,world,replica_split", [
    ("ddp", 2, None), ("ddp", 3, None),
    ("fsdp", 2, None), ("fsdp", 3, None), ("fsdp", 4, None),
    ("hsdp", 4, True), ("hsdp", 4, False),
])
def test_training_matches_single_process(reference, parallel, world, replica_split):
    results = run_on_ranks(world, train, parallel, replica_split)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
        assert r["params"].keys() == reference["params"].keys()
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert reference["losses"][-1] < reference["losses"][0]
    # replicas stay identical
    for r in results[1:]:
        for name, value in r["params"].items():
            assert torch.equal(value, results[0]["params"][name]), name


def test_same_seed_twice_is_bitwise_equal_distributed():
    first, second = run_on_ranks(3, train, "fsdp"), run_on_ranks(3, train, "fsdp")
    for a, b in zip(first, second):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def test_bf16_parameters_under_fsdp_match_single_process_bf16():
    reference = train(None, dtype=torch.bfloat16)
    for r in run_on_ranks(2, train, "fsdp", None, torch.bfloat16):
        assert all(v.dtype == torch.bfloat16 for v in r["params"].values())
        assert r["state_dtypes"] == {torch.bfloat16}  # state follows the parameter's dtype
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=2e-2, atol=0)


def test_fsdp_mixed_precision_keeps_fp32_params_and_trains(reference):
    results = run_on_ranks(2, train, "fsdp", None, torch.float32, True)
    for r in results:
        assert all(v.dtype == torch.float32 for v in r["params"].values())
        assert r["state_dtypes"] == {torch.float32}
        # bf16 compute moves the losses only slightly off the fp32 reference
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=2e-2, atol=0)
    for name, value in results[1]["params"].items():
        assert torch.equal(value, results[0]["params"][name]), name
