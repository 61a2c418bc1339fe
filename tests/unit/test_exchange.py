"""The exchange's send buffer: pieces that already lie end to end in memory go out as one view,
anything else as a copy (the distributed tests check what arrives)."""

from __future__ import annotations

import torch

from dmuon.exchange import laid_end_to_end, pack


def test_adjacent_pieces_of_one_tensor_are_one_view_of_it():
    batch = torch.randn(3, 4, 5)  # one batched Newton-Schulz result, split per matrix
    pieces = [p.reshape(-1) for p in batch.split([1, 2])]
    view = laid_end_to_end(pieces)
    assert view is not None and view.data_ptr() == batch.data_ptr()
    assert torch.equal(view, batch.reshape(-1))


def test_pieces_out_of_order_apart_or_strided_need_a_copy():
    batch = torch.randn(3, 4, 5)
    assert laid_end_to_end([batch[1].reshape(-1), batch[0].reshape(-1)]) is None  # out of order
    assert laid_end_to_end([batch[0].reshape(-1), batch[2].reshape(-1)]) is None  # a gap
    assert laid_end_to_end([torch.randn(3), torch.randn(3)]) is None  # two storages
    rows = torch.randn(4, 6)
    assert laid_end_to_end([rows.mT[0], rows.mT[1]]) is None  # strided


def test_pack_copies_strided_and_cast_pieces_once_with_the_values_of_flatten_and_cast():
    tall = torch.randn(1, 6, 4).mT.contiguous().mT  # column-major, as a transposed view is
    pieces = [tall[0, :3], tall[0, 3:], torch.randn(2, 5)]
    assert not pieces[0].is_contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        send = pack(pieces, dtype)
        assert send.dtype == dtype
        assert torch.equal(send, torch.cat([p.reshape(-1).to(dtype) for p in pieces]))
    batch = torch.randn(3, 4, 5)
    assert pack(list(batch.split([1, 2])), torch.float32).data_ptr() == batch.data_ptr()  # no copy
    assert pack(list(batch.split([1, 2])), torch.bfloat16).data_ptr() != batch.data_ptr()
    assert pack([], torch.bfloat16).numel() == 0
