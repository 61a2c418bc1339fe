"""``dmuon/step/early/eligibility.py``: whether early start can run a plan, and so whether the plan's
buckets follow the backward pass — pure functions of the plan's works and its eligibility."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dmuon.step.early.eligibility import Eligibility, follows_backward, unsupported_because, wanted


def work(name: str = "w", *, group: object | None = None, gang: tuple = (), column_blocks: bool = False,
         pieces: bool = False) -> SimpleNamespace:
    """The fields of a MatrixWork the decision reads: a plain tensor (a replica where it has a
    process group), its layout's kind, and whether it is split."""
    return SimpleNamespace(name=name, param=torch.zeros(2, 2), process_group=group, gang=gang,
                           column_blocks=column_blocks, layout=SimpleNamespace(pieces=pieces, transposed=False))


def test_wanted_where_it_pays_unless_the_setting_says():
    assert wanted(None, "cuda") and not wanted(None, "cpu")
    assert wanted(True, "cpu") and not wanted(False, "cuda")


@pytest.mark.parametrize("case", [dict(gang=(0, 1)), dict(column_blocks=True)])
def test_strategies_that_do_not_run_in_stages_are_refused(case):
    assert unsupported_because([work(), work()], compiled=False) is None
    assert "which do not run in stages" in unsupported_because([work(), work("split", **case)], compiled=False)


def test_piece_exchanges_run_in_stages():
    """FSDP + TP, 2-D blocks, expert stacks on dim 1/2: the piece exchange runs in stages."""
    assert unsupported_because([work(), work("fsdp_tp", pieces=True)], compiled=False) is None


def test_a_compiled_step_runs_as_a_whole():
    assert "compile" in unsupported_because([work()], compiled=True)


def test_a_replica_needs_ddps_comm_hook():
    replica = work("blocks.0.weight", group=object())
    assert "'blocks.0.weight' is replicated (DDP)" in unsupported_because([replica], compiled=False)
    assert unsupported_because([replica], compiled=False, ddp_params={id(replica.param)}) is None
    assert unsupported_because([replica], compiled=False, ddp_may_follow=True) is None
    assert unsupported_because([work()], compiled=False) is None  # one process: nothing to wait for


def test_the_bucket_order_follows_the_backward_pass_only_where_early_start_runs():
    replica = [work(group=object())]
    on_cuda = Eligibility(None, "cuda", False, None)
    assert follows_backward(on_cuda, [work()])
    assert not follows_backward(on_cuda, replica)  # it could not run: the cost order
    assert follows_backward(on_cuda._replace(ddp_params=frozenset({id(replica[0].param)})), replica)
    assert follows_backward(on_cuda._replace(setting=True), replica)  # forced (and refused at the step)
    assert not follows_backward(on_cuda._replace(setting=False), [work()])
    assert not follows_backward(on_cuda._replace(device_type="cpu"), [work()])
    assert not follows_backward(on_cuda._replace(compiled=True), [work()])
