"""``dmuon/row_blocks.py``: what each ``ns_blocks`` pattern means (an interleaved ``w13`` steps as
separate w1 and w3 matrices, a per-head ``wkv_b`` as its 2·heads K and V matrices), the errors
that name the parameter, and the pattern's round trip through state dicts and torch.distributed.checkpoint.
Every distributed layout against the reference: tests/distributed/test_row_blocks.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon
from dmuon.reference import ReferenceMuon
from dmuon.row_blocks import RowBlocks, from_blocks, pattern_rows, plain_pattern, row_blocks, to_blocks
from tests.helpers import dcp_load, dcp_save

HPARAMS = dict(lr=0.05, weight_decay=0.01, ns_dtype=torch.float32, ns_method="standard")


@pytest.mark.parametrize("pattern,expected", [
    (None, RowBlocks((6,))),
    (2, RowBlocks((2, 2, 2))),
    ([4, 2], RowBlocks((4, 2))),
    (dmuon.interleaved(2), RowBlocks((3, 3), (0, 2, 4, 1, 3, 5))),
    (dmuon.interleaved(3), RowBlocks((2, 2, 2), (0, 3, 1, 4, 2, 5))),
    (dmuon.per_head(2, [1, 2]), RowBlocks((1, 2, 1, 2))),
    ([[5, 0], [1, 2, 3, 4]], RowBlocks((2, 4), (5, 0, 1, 2, 3, 4))),
    ([[0, 1], [2, 3, 4, 5]], RowBlocks((2, 4))),  # consecutive rows: no reordering
    ([[3, 1, 0, 2, 4, 5]], RowBlocks((6,))),  # one block is the whole matrix, in its own order
])
def test_patterns_are_a_row_order_and_block_sizes(pattern, expected):
    blocks = row_blocks(pattern, 6)
    assert blocks == expected
    assert sorted(row for block in blocks.indices() for row in block) == list(range(6))


def test_the_rows_a_pattern_was_written_for():
    """What the hint for a pattern written over a rank's shard compares with the shard's rows."""
    assert pattern_rows([4, 2]) == 6 and pattern_rows([[0, 2], [1]]) == 3
    assert pattern_rows(dmuon.per_head(2, [1, 3])) == 8
    assert pattern_rows(None) is pattern_rows(4) is pattern_rows(dmuon.interleaved(2)) is pattern_rows(True) is None


def test_moving_rows_to_blocks_and_back_is_the_identity():
    x = torch.randn(2, 6, 3)
    order = torch.tensor(row_blocks(dmuon.interleaved(2), 6).order)
    moved = to_blocks(x, order, dim=1)
    assert torch.equal(moved[:, :3], x[:, 0::2]) and torch.equal(from_blocks(moved, order, dim=1), x)


@pytest.mark.parametrize("pattern,message", [
    ([[0, 1, 2], [2, 3, 4, 5]], "row 2 is in more than one block"),
    ([[0, 1, 2], [3, 4]], "row 5 of 6 is in no block"),
    ([[0, 1, 2], [3, 4, 6]], "row 6 is outside the matrix's 6 rows"),
    ([[0, 1, 2], []], "non-empty lists of ints"),
    (dmuon.interleaved(4), "every 4-th row does not make 4 blocks"),
    (dmuon.per_head(2, [2, 2]), "2 heads of 4 rows are 8 rows, not 6"),
    ({"every": 2}, "dmuon.interleaved"),
    (True, "Must be None, an int"),
    ([4, 1], "adding up to 6"),
])
def test_a_pattern_that_misses_or_repeats_rows_names_the_parameter(pattern, message):
    with pytest.raises(ValueError, match=message) as info:
        dmuon.Muon([{"params": [("layers.0.w13", nn.Parameter(torch.zeros(6, 4)))], "algorithm": "muon",
                     "ns_blocks": pattern}])
    assert "layers.0.w13" in str(info.value)


def test_an_interleaved_w13_steps_as_separate_w1_and_w3():
    """Block j of ``interleaved(2)`` is rows j, j+2, …: stepped as the separate matrices, up to where
    the lr factor is rounded in (into the block's update, or into the step's alpha)."""
    torch.manual_seed(0)
    w13 = nn.Parameter(torch.randn(16, 12))
    w1, w3 = nn.Parameter(w13.detach()[0::2].clone()), nn.Parameter(w13.detach()[1::2].clone())
    fused = dmuon.Muon([{"params": [w13], "algorithm": "muon", "ns_blocks": dmuon.interleaved(2)}], **HPARAMS)
    apart = dmuon.Muon([{"params": [w1, w3], "algorithm": "muon"}], **HPARAMS)
    for _ in range(3):
        g = torch.randn(16, 12)
        w13.grad, w1.grad, w3.grad = g, g[0::2].clone(), g[1::2].clone()
        fused.step()
        apart.step()
    torch.testing.assert_close(w13.detach()[0::2], w1.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(w13.detach()[1::2], w3.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("optimizer", [dmuon.Muon, ReferenceMuon])
def test_a_per_head_wkv_b_steps_as_its_k_and_v_matrices(optimizer):
    """``per_head(3, [4, 6])``: per head a 4-row K and a 6-row V matrix, each orthogonalized and
    scaled for its own shape — the fast path and the reference alike."""
    torch.manual_seed(1)
    sizes = [4, 6] * 3
    kv = nn.Parameter(torch.randn(30, 16))
    parts = [nn.Parameter(b.clone()) for b in kv.detach().split(sizes)]
    group = {"algorithm": "muon"} if optimizer is dmuon.Muon else {}
    fused = optimizer([{"params": [kv], "ns_blocks": dmuon.per_head(3, [4, 6]), **group}], **HPARAMS)
    apart = optimizer([{"params": parts, **group}], **HPARAMS)
    for _ in range(3):
        g = torch.randn(30, 16)
        kv.grad = g
        for p, block in zip(parts, g.split(sizes)):
            p.grad = block.clone()
        fused.step()
        apart.step()
    torch.testing.assert_close(kv.detach(), torch.cat([p.detach() for p in parts]), rtol=0, atol=1e-6)


def test_the_fast_path_and_the_reference_give_the_same_bits_for_every_pattern():
    torch.manual_seed(2)
    patterns = [dmuon.interleaved(2), dmuon.per_head(2, [3, 5]), [[0, 15, 3], list(range(4, 15)) + [1, 2]]]
    params = [nn.Parameter(torch.randn(16, 10, dtype=torch.bfloat16)) for _ in patterns]
    refs = [nn.Parameter(p.detach().clone()) for p in params]
    opt = dmuon.Muon([{"params": [p], "algorithm": "muon", "ns_blocks": b} for p, b in zip(params, patterns)],
                     update_rule="normuon")
    ref = ReferenceMuon([{"params": [r], "ns_blocks": b} for r, b in zip(refs, patterns)], update_rule="normuon")
    for _ in range(2):
        for p, r in zip(params, refs):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, r in zip(params, refs):
        assert torch.equal(p, r)
        assert torch.equal(opt.state[p]["row_second_moment"], ref.state[r]["row_second_moment"])


def test_patterns_are_kept_as_plain_values_and_survive_a_checkpoint(tmp_path):
    """The group holds plain lists and dicts: state_dict and torch.distributed.checkpoint take them."""
    assert plain_pattern(((0, 2), (1, 3))) == [[0, 2], [1, 3]]
    assert plain_pattern(dmuon.per_head(2, (1, 3))) == {"heads": 2, "per_head": [1, 3]}
    model = nn.Module()
    model.w13 = nn.Parameter(torch.randn(8, 4))
    patterns = {"w13": dmuon.interleaved(2)}

    def build():
        return dmuon.Muon([{"params": [("w13", model.w13)], "algorithm": "muon", "ns_blocks": patterns["w13"]}],
                          **HPARAMS)

    opt = build()
    model.w13.grad = torch.randn(8, 4)
    opt.step()
    assert opt.state_dict()["param_groups"][0]["ns_blocks"] == {"interleaved": 2}
    dcp_save(model, opt, str(tmp_path / "ckpt"))
    model.w13.grad = None  # DCP creates a fresh optimizer's state with a step on zero gradients
    loaded = build()
    dcp_load(model, loaded, str(tmp_path / "ckpt"))
    assert loaded.param_groups[0]["ns_blocks"] == {"interleaved": 2}
    assert torch.equal(loaded.state[model.w13]["momentum_buffer"], opt.state[model.w13]["momentum_buffer"])
