"""One process: which parameter goes to Muon or AdamW, and why — module types and names, tied and
vocabulary-sized heads, explicit groups, fused weights' row blocks, Keller's ``use_muon`` groups
(docs/testing.md row 14)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dmuon
from dmuon.hyperparameters import adamw_hyperparameters
from tests.unit.nets import make_net


def test_routing_from_module():
    opt = dmuon.Muon(make_net())
    routes = {n: route.algorithm for n, route in opt.routes().items()}
    assert routes == {
        "embed.weight": "adamw", "hidden.weight": "muon", "hidden.bias": "adamw",
        "norm.weight": "adamw", "norm.bias": "adamw", "conv.weight": "muon", "conv.bias": "adamw",
        "experts": "muon", "lm_head.weight": "adamw",
    }
    summary = opt.routing_summary()
    assert "3 x 16x8" in summary  # the expert stack: 3 matrices
    assert "1 x 3x6" in summary  # the Conv1d kernel (3, 2, 3) flattened
    assert "routing" not in repr(opt) and "hidden.weight" in repr(opt)
    # why each parameter went where
    reasons = {n: route.reason for n, route in opt.routes().items()}
    assert reasons["embed.weight"] == "embedding" and reasons["lm_head.weight"] == "output head"
    assert reasons["conv.weight"] == "convolution kernel, flattened" and reasons["hidden.bias"].startswith("1-D")
    assert all(reason in summary for reason in reasons.values())


def test_tied_head_and_vocab_sized_head_go_to_adamw():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 4)
            self.out = nn.Linear(4, 10)  # not named like a head, but vocab-sized
            self.tied = nn.Linear(4, 10, bias=False)
            self.tied.weight = self.tok.weight

    opt = dmuon.Muon(Tied())
    routes = {n: route.algorithm for n, route in opt.routes().items()}
    assert routes["tok.weight"] == "adamw" and routes["out.weight"] == "adamw"
    assert routes["proj.weight"] == "muon"
    assert "tied.weight" not in routes  # the same tensor as tok.weight


def test_routing_from_named_parameters_and_plain_tensors():
    net = make_net()
    named = dmuon.Muon(net.named_parameters())
    named_routes = {n: route.algorithm for n, route in named.routes().items()}
    assert named_routes["embed.weight"] == "adamw" and named_routes["lm_head.weight"] == "adamw"
    matrices = [p for p in net.parameters() if p.ndim >= 2]
    with pytest.warns(UserWarning, match="routed 5 matrices to Muon by shape alone.*Pass the model"):
        plain = dmuon.Muon(matrices)
    # without names or modules only the shape rule applies: every matrix goes to Muon
    assert sum(route.algorithm == "muon" for route in plain.routes().values()) == 5
    # a whole model's bare tensors (nanoGPT's decay / no-decay groups): its embedding would go to Muon
    vectors = [p for p in net.parameters() if p.ndim < 2]
    with pytest.raises(ValueError, match=r"bare tensors of a whole model \(5 matrices, \d+ vectors.*Pass the model"):
        dmuon.Muon([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}])
    with pytest.raises(ValueError, match="bare tensors of a whole model"):
        dmuon.Muon(net.parameters())
    named = [{"params": [(n, p) for n, p in net.named_parameters() if p.ndim >= 2], "weight_decay": 0.1},
             {"params": [(n, p) for n, p in net.named_parameters() if p.ndim < 2], "weight_decay": 0.0}]
    routes = {n: r.algorithm for n, r in dmuon.Muon(named).routes().items()}
    assert routes["embed.weight"] == "adamw" and routes["lm_head.weight"] == "adamw"


def test_explicit_groups_override_and_split():
    net = make_net()
    with pytest.warns(UserWarning, match="by shape alone"):  # the first group's hidden.weight
        opt = dmuon.Muon([
            {"params": [net.hidden.weight, net.hidden.bias], "lr": 0.5},
            {"params": [net.lm_head.weight], "algorithm": "muon"},
            {"params": [net.experts], "algorithm": "adamw", "betas": (0.8, 0.9), "eps": 1e-6},
        ], lr=0.1, adamw_eps=1e-7)
    # one group per group given, routed per parameter inside
    assert [g["algorithms"] for g in opt.param_groups] == [["muon", "adamw"], ["muon"], ["adamw"]]
    assert [g["algorithm"] for g in opt.param_groups] == [None, "muon", "adamw"]
    adamw = [adamw_hyperparameters(g) for g in opt.param_groups]
    assert opt.param_groups[0]["lr"] == adamw[0]["lr"] == 0.5
    assert adamw[0]["eps"] == 1e-7  # a plain eps of a mixed group is Muon's
    assert adamw[2]["betas"] == (0.8, 0.9) and adamw[2]["eps"] == 1e-6 and adamw[2]["lr"] == 0.1
    assert opt.param_groups[1]["lr"] == 0.1


def test_ns_dtype_is_kept_by_name():
    """Param groups hold plain values only (DCP's full state dicts reject a torch.dtype)."""
    for given in (torch.float32, "float32", "torch.float32"):
        opt = dmuon.Muon(make_net(), ns_dtype=given)
        assert opt.param_groups[0]["ns_dtype"] == "float32"


def test_adamw_options():
    net = make_net()
    opt = dmuon.Muon(net, lr=0.1, weight_decay=0.2, adamw_lr=0.003, adamw_weight_decay=0.0, adamw_betas=(0.5, 0.6))
    adamw = adamw_hyperparameters(opt.param_groups[0])
    assert (adamw["lr"], adamw["weight_decay"], adamw["betas"], adamw["eps"]) == (0.003, 0.0, (0.5, 0.6), 1e-8)


def test_fused_weight_blocks_are_orthogonalized_separately():
    torch.manual_seed(0)
    qkv = nn.Parameter(torch.randn(48, 32))
    grad = torch.randn(48, 32)
    rows = [32, 8, 8]  # grouped-query attention: q, k, v
    results = {}
    for blocks in (None, rows):
        p = nn.Parameter(qkv.detach().clone())
        opt = dmuon.Muon([{"params": [p], "algorithm": "muon", "ns_blocks": blocks}], lr=0.1, weight_decay=0.0,
                         ns_dtype=torch.float32, ns_method="standard")
        p.grad = grad.clone()
        opt.step()
        results[str(blocks)] = (qkv.detach() - p.detach()) / 0.1  # the applied update, lr removed
        assert opt.param_groups[0]["ns_blocks"] == blocks
    split = results[str(rows)].split(rows)
    # each block is an orthogonalized matrix scaled for its own shape: its rows are orthogonal,
    # with the squared norm its scale gives them (0.2·√max(rows, 32))²
    for block, r in zip(split, rows):
        scale = 0.2 * math.sqrt(max(r, 32))
        gram = block @ block.T / scale**2
        torch.testing.assert_close(gram, torch.eye(r), atol=0.3, rtol=0)
    assert not torch.allclose(results["None"], results[str(rows)], atol=1e-3)


@pytest.mark.parametrize("blocks,message", [
    (5, "blocks of 5 rows do not tile 48 rows"), ([32, 8], "adding up to 48"), ([48, 0], "positive ints"),
])
def test_bad_ns_blocks_are_named(blocks, message):
    with pytest.raises(ValueError, match=message) as info:
        dmuon.Muon([{"params": [nn.Parameter(torch.zeros(48, 32))], "algorithm": "muon", "ns_blocks": blocks}])
    assert "parameter 0 in param group 0" in str(info.value)


def test_named_groups_that_route_to_one_algorithm():
    """A group of (name, tensor) pairs all routed to one algorithm leaves the other half empty;
    it must still count as named, or torch refuses to mix named and unnamed groups."""
    w, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    opt = dmuon.Muon([{"params": [("w", w)]}, {"params": [("b", b)]}])
    assert [g["param_names"] for g in opt.param_groups] == [["w"], ["b"]]
    w.grad, b.grad = torch.randn(4, 4), torch.randn(4)
    opt.step()
    opt.load_state_dict(opt.state_dict())


def test_keller_use_muon_groups_are_accepted():
    """MuonWithAuxAdam's groups: use_muon chooses the algorithm; an AdamW group's eps is AdamW's."""
    net = make_net()
    hidden = [net.hidden.weight]
    rest = [p for p in net.parameters() if p is not net.hidden.weight]
    opt = dmuon.Muon([dict(params=hidden, use_muon=True, lr=0.02, weight_decay=0.01),
                      dict(params=rest, use_muon=False, lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)])
    assert opt.param_groups[0]["algorithms"] == ["muon"]
    assert set(opt.param_groups[1]["algorithms"]) == {"adamw"}
    assert opt.param_groups[1]["adamw_eps"] == 1e-10 and opt.param_groups[1]["adamw_betas"] == (0.9, 0.95)
    assert opt.param_groups[1]["eps"] == opt.defaults["eps"]  # Newton–Schulz's eps untouched
    with pytest.raises(ValueError, match="use_muon=True and algorithm='adamw' disagree in param group 0"):
        dmuon.Muon([dict(params=hidden, use_muon=True, algorithm="adamw")])
    with pytest.raises(ValueError, match="Invalid use_muon=1 in param group 0"):
        dmuon.Muon([dict(params=hidden, use_muon=1)])


def test_routing_summary_points_fused_projections_to_ns_blocks():
    fused = nn.ModuleDict({"qkv": nn.Linear(8, 24, bias=False), "out": nn.Linear(8, 8, bias=False)})
    summary = dmuon.Muon(fused).routing_summary()
    assert "note: qkv.weight (24x8) looks like fused projections" in summary and "ns_blocks" in summary
    assert "out.weight" in summary and "note: out.weight" not in summary
    blocked = dmuon.Muon([{"params": list(fused.qkv.named_parameters("qkv")), "ns_blocks": [8, 8, 8]},
                          {"params": list(fused.out.named_parameters("out"))}]).routing_summary()
    assert "note:" not in blocked.split("ns_dtype=None")[0]


def test_mixed_named_and_bare_parameters_are_rejected():
    net = make_net()
    with pytest.raises(ValueError, match="mix \\(name, tensor\\) pairs and bare tensors"):
        dmuon.Muon([("hidden.weight", net.hidden.weight), net.experts])


def test_add_param_group_with_bare_tensors_finds_their_names_in_the_model():
    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)
    net.extra = nn.Linear(8, 8)  # a module added to the model later
    opt.add_param_group({"params": list(net.extra.parameters())})
    assert opt.param_groups[1]["param_names"] == ["extra.weight", "extra.bias"]
    assert opt.param_groups[1]["algorithms"] == ["muon", "adamw"]
    other = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="not in the model it was built from: pass \\(name, tensor\\) pairs"):
        opt.add_param_group({"params": list(other.parameters())})
    assert len(opt.param_groups) == 2


def test_a_convolution_named_as_an_embedding_is_an_embedding_and_frozen_ones_are_in_no_plan():
    """Rule 2 before rule 4: a ViT's patch convolution is its input embedding (AdamW), another
    convolution a kernel Muon flattens; a frozen matrix stays routed but in no plan until it trains."""
    vit = nn.ModuleDict({"patch_embed": nn.Conv2d(3, 8, 4, stride=4), "conv": nn.Conv2d(8, 8, 3),
                         "hidden": nn.Linear(8, 8), "frozen": nn.Linear(8, 8)})
    vit["frozen"].requires_grad_(False)
    opt = dmuon.Muon(vit)
    routes = opt.routes()
    assert (routes["patch_embed.weight"].algorithm, routes["patch_embed.weight"].reason) == ("adamw", "embedding")
    assert routes["conv.weight"].algorithm == "muon" and "flattened" in routes["conv.weight"].reason
    assert routes["frozen.weight"].algorithm == "muon"
    assert [u.name for u in opt.plan.units] == ["conv.weight", "hidden.weight"]
    vit["frozen"].requires_grad_(True)
    assert [u.name for u in opt.plan.units] == ["conv.weight", "hidden.weight", "frozen.weight"]


@pytest.mark.parametrize("style", ["openpi", "lerobot"])
def test_a_policy_s_action_and_state_projections_go_to_adamw_by_name(style):
    """openpi's PyTorch π0 keeps its projections on the model, LeRobot's π0 / SmolVLA under
    ``model.``: both name them action_in_proj, action_out_proj, state_proj. They are the policy's
    input and output layers (an action or state vector to the width and back), not hidden matrices;
    the time MLP between them is hidden. Other names with "state" or "proj" stay on Muon."""
    policy = nn.ModuleDict({"action_in_proj": nn.Linear(32, 64), "action_out_proj": nn.Linear(64, 32),
                            "state_proj": nn.Linear(32, 64), "action_time_mlp_in": nn.Linear(128, 64),
                            "hidden_state_proj_up": nn.Linear(64, 64), "in_proj": nn.Linear(64, 192)})
    model = policy if style == "openpi" else nn.ModuleDict({"model": policy})
    prefix = "" if style == "openpi" else "model."
    opt = dmuon.Muon(model)
    routes = opt.routes()
    for name in ("action_in_proj", "action_out_proj", "state_proj"):
        route = routes[f"{prefix}{name}.weight"]
        assert (route.algorithm, route.reason) == ("adamw", "action/state input or output projection"), name
    for name in ("action_time_mlp_in", "hidden_state_proj_up", "in_proj"):
        assert routes[f"{prefix}{name}.weight"].algorithm == "muon", name
    # the fused-projection note names nn.MultiheadAttention-style in_proj, not action_in_proj
    notes = [line for line in opt.routing_summary().splitlines() if line.startswith("note:")]
    assert [note.split()[1] for note in notes] == [f"{prefix}in_proj.weight"]


def test_routing_summary_marks_frozen_parameters():
    """A frozen tower's matrices stay routed to Muon (they join the step once they train) but the
    summary says they are frozen, and notes no fused projection among them."""
    model = nn.ModuleDict({"tower": nn.ModuleDict({"qkv": nn.Linear(8, 24)}), "hidden": nn.Linear(8, 8)})
    model["tower"].requires_grad_(False)
    summary = dmuon.Muon(model).routing_summary()
    rows = {line.split()[1]: line for line in summary.splitlines()[1:] if not line.startswith(("note", "ns_dtype"))}
    assert "muon, frozen" in rows["tower.qkv.weight"] and "adamw, frozen" in rows["tower.qkv.bias"]
    assert "frozen" not in rows["hidden.weight"]
    assert "note:" not in summary
