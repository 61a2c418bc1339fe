"""QK-clip in one process: the max-logit helper against a brute-force softmax input, the clip's
scales against the formula, the logits it leaves, recording for dmuon's and Hugging Face's
attention, a training run that needs it, and every bad input refused before a weight changes."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dmuon
from dmuon import attention, qk_clip
from dmuon.qk_clip import AttentionLayer, QKClip, max_logits
from dmuon.tools.models import Llama, SyntheticTokens, get_config

THRESHOLD = 3.0


def brute_force_max_logits(q, k, scale, mask):
    """Every score, masked, then the max per query head (k repeated per query head)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    return scores.amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize("masking", ["causal", "bool", "additive"])
@pytest.mark.parametrize("chunk", [attention.SCORES_PER_CHUNK, 40])
def test_max_logits_matches_brute_force(monkeypatch, masking, chunk):
    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 9, 4, generator=g), torch.randn(2, 3, 9, 4, generator=g)  # grouped-query
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    if masking == "causal":
        got, mask = max_logits(q, k, 0.7), causal
    elif masking == "bool":
        mask = torch.rand(2, 1, 9, 9, generator=g) > 0.3
        mask[..., 0] = True
        got = max_logits(q, k, 0.7, attention_mask=mask)
    else:
        mask = torch.where(torch.rand(2, 1, 9, 9, generator=g) > 0.3, 0.0, -1e9)
        got = max_logits(q, k, 0.7, attention_mask=mask)
    torch.testing.assert_close(got, brute_force_max_logits(q, k, 0.7, mask), rtol=1e-5, atol=1e-5)


def test_head_scales_follow_the_formula_and_a_key_head_takes_its_query_heads_max():
    maxima = torch.tensor([1.0, 8.0, 2.0, 3.0])  # τ = 4: head 1 over; heads 0, 1 share key head 0
    q_scales, k_scales = qk_clip.head_scales(maxima, 4.0, 0.25, kv_heads=2)
    assert q_scales.tolist() == pytest.approx([1.0, (4 / 8) ** 0.25, 1.0, 1.0], rel=1e-6)
    assert k_scales.tolist() == pytest.approx([(4 / 8) ** 0.75, 1.0], rel=1e-6)


def attention_model(bias: bool = False, fused: bool = False) -> tuple[nn.Module, dict[str, AttentionLayer]]:
    """Two attention layers' projections: separate q/k (4 query heads, 2 key heads of 3) and a
    GPT-2-style fused QKV along dim 1 (2 heads of 3, queries then keys then values)."""
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(q=nn.Linear(5, 12, bias=bias), k=nn.Linear(5, 6, bias=bias),
                               qkv=nn.Linear(18, 5, bias=False)))  # weight (5, 18): out features along dim 1
    layers = {"sep": AttentionLayer(model.q.weight, model.k.weight, num_heads=4, head_dim=3, num_kv_heads=2,
                                    q_bias=model.q.bias, k_bias=model.k.bias)}
    if fused:
        layers["fused"] = AttentionLayer(model.qkv.weight, model.qkv.weight, num_heads=2, head_dim=3, q_offset=0,
                                         k_offset=6, out_dim=1)
    return model, layers


def test_clip_scales_exactly_the_rows_of_the_heads_over_the_threshold():
    model, layers = attention_model(bias=True, fused=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights change only by the clip
    clip = QKClip(opt, layers, threshold=4.0, alpha=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip.record("sep", torch.tensor([1.0, 16.0, 2.0, 3.0]))
    clip.record("fused", torch.tensor([9.0, 1.0]))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    g_sep, g_fused = (torch.tensor(4.0) / torch.tensor(x) for x in (16.0, 9.0))  # as the clip computes, in fp32
    g_sep, g_fused = g_sep.pow(0.5).item(), g_fused.pow(0.5).item()
    q_rows = torch.tensor([1.0] * 3 + [g_sep] * 3 + [1.0] * 6)
    k_rows = torch.tensor([g_sep] * 3 + [1.0] * 3)
    assert torch.equal(model.q.weight, before["q.weight"] * q_rows[:, None])
    assert torch.equal(model.q.bias, before["q.bias"] * q_rows)
    assert torch.equal(model.k.weight, before["k.weight"] * k_rows[:, None])
    assert torch.equal(model.k.bias, before["k.bias"] * k_rows)
    fused_cols = torch.tensor([g_fused] * 3 + [1.0] * 3 + [g_fused] * 3 + [1.0] * 3 + [1.0] * 6)
    assert torch.equal(model.qkv.weight, before["qkv.weight"] * fused_cols[None, :])
    assert torch.equal(model.qkv.weight[:, 12:], before["qkv.weight"][:, 12:])  # values untouched
    assert clip.statistics() == {"qk_clip/max_logit": 16.0, "qk_clip/heads_clipped": 2.0,
                                 "qk_clip/max_logit/sep": 16.0, "qk_clip/max_logit/fused": 9.0}
    clip.record("sep", torch.tensor([1.0, 2.0, 2.0, 3.0]))  # all under τ now: nothing moves
    clip.record("fused", torch.tensor([1.0, 2.0]))
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert all(torch.equal(p, kept[n]) for n, p in model.named_parameters())


def llama_and_batch(seed: int = 0):
    config = get_config("tiny")
    model = Llama(config, seed=seed)
    inputs, targets = SyntheticTokens(config.vocab_size, seed=0).batch(0, 8, 32)
    return model, inputs, targets


def logits_now(model, inputs, layer: str = "") -> float:
    """The model's largest attention logit on ``inputs``, or that of ``layer`` (a probe clip
    that never clips)."""
    probe = QKClip.for_model(torch.optim.SGD(model.parameters(), lr=0.0), model, threshold=1e30)
    with torch.enable_grad():
        model(inputs).sum().backward()  # records count once the backward pass reaches them
    model.zero_grad()
    probe.clip(apply=False)
    probe.remove()
    return probe.statistics()[f"qk_clip/max_logit/{layer}" if layer else "qk_clip/max_logit"]


def test_after_the_clip_the_same_inputs_give_logits_at_most_the_threshold():
    model, inputs, targets = llama_and_batch()
    with torch.no_grad():  # logits well over τ to begin with
        for layer in model.layers:
            layer.attn.q_proj.weight.mul_(30)
            layer.attn.k_proj.weight.mul_(30)
    start = logits_now(model, inputs)
    assert start > 10 * THRESHOLD
    opt = dmuon.Muon(model, lr=0.0, weight_decay=0.0)  # the step itself changes nothing
    clip = QKClip.for_model(opt, model, threshold=THRESHOLD)
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    opt.step()
    assert opt.statistics()["qk_clip/heads_clipped"] > 0
    assert opt.statistics()["qk_clip/max_logit"] == pytest.approx(start, rel=1e-5)
    assert clip.statistics()["qk_clip/max_logit"] == opt.statistics()["qk_clip/max_logit"]
    clip.remove()
    assert "qk_clip/max_logit" not in opt.statistics()
    # the first layer sees the same inputs again (the later ones see the clipped layers' outputs)
    assert logits_now(model, inputs, "layers.0.attn") <= THRESHOLD * (1 + 1e-4)


def train_tiny(clip: bool, steps: int = 25, lr: float = 0.4) -> list[float]:
    """Max logit per step of the tiny Llama at a deliberately high lr, with or without the clip."""
    model, _, _ = llama_and_batch()
    config = model.config
    opt = dmuon.Muon(model, lr=lr, weight_decay=0.0, ns_dtype=torch.float32)
    watch = QKClip.for_model(opt, model, threshold=THRESHOLD if clip else 1e30)
    data = SyntheticTokens(config.vocab_size, seed=0)
    maxima = []
    for step in range(steps):
        x, y = data.batch(step, 8, 32)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        maxima.append(watch.statistics()["qk_clip/max_logit"])
    return maxima


def test_a_high_learning_rate_drives_logits_past_the_threshold_without_the_clip_and_not_with_it():
    without, with_clip = train_tiny(clip=False), train_tiny(clip=True)
    assert max(without) > 50 * THRESHOLD
    # each step's logit is the clipped weights' plus that step's own growth (lr 0.4 is large)
    assert max(with_clip[5:]) < 5 * THRESHOLD, with_clip


def test_a_skipped_step_clips_nothing():
    model, layers = attention_model()
    opt = dmuon.Muon(model, lr=0.0, weight_decay=0.0)
    clip = QKClip(opt, layers, threshold=4.0)
    before = [p.detach().clone() for p in model.parameters()]
    clip.record("sep", torch.full((4,), 100.0))
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)
    with pytest.warns(UserWarning, match="non-finite"):
        opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert clip.statistics()["qk_clip/heads_clipped"] == 0


def test_a_layer_nobody_recorded_is_left_alone_with_one_warning():
    model, layers = attention_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    QKClip(opt, layers, threshold=4.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.warns(UserWarning, match="no rank recorded max logits for attention layer 'sep'"):
        opt.step()
    opt.step()  # once per layer


@pytest.mark.parametrize("bad,pattern", [
    (dict(num_heads=6), "Attention layer 'sep': 6 heads of 3 from row 0 need rows up to 18, but q_weight has 12"),
    (dict(num_kv_heads=3), "Invalid num_kv_heads=3 for attention layer 'sep': it must divide num_heads=4"),
    (dict(head_dim=0), "Invalid head_dim=0 for attention layer 'sep'"),
    (dict(out_dim=2), "Invalid out_dim=2"),
    (dict(q_weight=nn.Parameter(torch.zeros(12, 5))), "q_weight of attention layer 'sep' .* is not a parameter of "
                                                      "the optimizer"),
])
def test_layers_that_do_not_fit_are_refused_naming_the_layer(bad, pattern):
    model, layers = attention_model()
    fields = dict(q_weight=model.q.weight, k_weight=model.k.weight, num_heads=4, head_dim=3, num_kv_heads=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=pattern):
        QKClip(opt, {"sep": AttentionLayer(**{**fields, **bad})})


def test_fused_rows_that_overlap_and_bad_settings_are_refused():
    model, _ = attention_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    overlapping = AttentionLayer(model.qkv.weight, model.qkv.weight, 2, 3, k_offset=3, out_dim=1)
    with pytest.raises(ValueError, match=r"query rows \[0, 6\) and key rows \[3, 9\) of its fused weight overlap"):
        QKClip(opt, {"fused": overlapping})
    layers = {"sep": AttentionLayer(model.q.weight, model.k.weight, 4, 3, 2)}
    with pytest.raises(ValueError, match="Invalid threshold=0"):
        QKClip(opt, layers, threshold=0)
    with pytest.raises(ValueError, match="Invalid alpha=1.5"):
        QKClip(opt, layers, alpha=1.5)


@pytest.mark.parametrize("record,error,pattern", [
    (lambda c: c.record("sep", torch.ones(3)), ValueError, r"layer 'sep': recorded \(3,\) for heads \[0, 4\)"),
    (lambda c: c.record("nope", torch.ones(4)), ValueError, "a layer name it does not know \\('nope'\\)"),
    (lambda c: c.record("sep", torch.tensor([1.0, math.nan, 1.0, 1.0])), FloatingPointError, "non-finite"),
])
def test_bad_records_raise_at_the_step_before_any_weight_changes(record, error, pattern):
    model, layers = attention_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    clip = QKClip(opt, layers, threshold=0.5)
    clip.record("sep", torch.full((4,), 100.0))  # would clip every head
    record(clip)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(error, match=pattern):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_checkpoints_are_unchanged_and_a_copy_of_the_optimizer_steps():
    model, inputs, targets = llama_and_batch()
    opt = dmuon.Muon(model, lr=0.02)
    keys_before = opt.state_dict()["param_groups"][0].keys()
    QKClip.for_model(opt, model, threshold=THRESHOLD)
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    opt.step()
    assert opt.state_dict()["param_groups"][0].keys() == keys_before
    assert {k for s in opt.state.values() for k in s} <= {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    twin = copy.deepcopy(opt)
    twin.step()  # no QK-clip comes with the copy
    assert "qk_clip/max_logit" not in twin.statistics()


def gpt2_and_llama():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=24, n_layer=2, n_head=4, vocab_size=64,
                                                                 n_positions=32, attn_implementation="sdpa"))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32, attn_implementation="eager"))
    return gpt2, llama


def test_hugging_face_gpt2_records_the_max_logits_of_its_queries_and_keys():
    gpt2, _ = gpt2_and_llama()
    opt = dmuon.Muon(gpt2, lr=0.0, weight_decay=0.0)
    clip = QKClip.for_model(opt, gpt2, threshold=1e30)
    assert sorted(clip.layers) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    seen = {}
    for name in clip.layers:
        attn = gpt2.get_submodule(name)
        attn.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0].detach()))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    gpt2(tokens, labels=tokens).loss.backward()
    opt.step()
    for name in clip.layers:
        attn = gpt2.get_submodule(name)
        q, k, _ = attn.c_attn(seen[name]).split(attn.split_size, dim=2)
        q, k = (t.view(2, 16, 4, 6).transpose(1, 2) for t in (q, k))
        expected = brute_force_max_logits(q, k, 6 ** -0.5, torch.ones(16, 16, dtype=torch.bool).tril())
        torch.testing.assert_close(torch.tensor(clip.statistics()[f"qk_clip/max_logit/{name}"]), expected.max())


def test_hugging_face_llama_with_eager_attention_is_clipped_under_the_threshold():
    _, llama = gpt2_and_llama()
    with torch.no_grad():
        for layer in llama.model.layers:
            layer.self_attn.q_proj.weight.mul_(40)
            layer.self_attn.k_proj.weight.mul_(40)
    opt = dmuon.Muon(llama, lr=0.0, weight_decay=0.0)
    clip = QKClip.for_model(opt, llama, threshold=THRESHOLD)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    out_before = llama(tokens).logits.detach()
    llama(tokens, labels=tokens).loss.backward()
    opt.step()
    assert clip.statistics()["qk_clip/heads_clipped"] > 0 and clip.statistics()["qk_clip/max_logit"] > THRESHOLD
    llama.zero_grad()
    llama(tokens, labels=tokens).loss.backward()
    clip.clip(apply=False)
    assert clip.statistics()["qk_clip/max_logit/model.layers.0.self_attn"] <= THRESHOLD * (1 + 1e-4)
    assert not torch.equal(llama(tokens).logits, out_before)  # the model still runs, now clipped


def test_one_model_records_for_one_clip_at_a_time():
    model, inputs, _ = llama_and_batch()
    first = QKClip.for_model(torch.optim.SGD(model.parameters(), lr=0.0), model)
    with pytest.raises(ValueError, match="Another QKClip records the max logits of 'layers.0.attn' already"):
        QKClip.for_model(torch.optim.SGD(model.parameters(), lr=0.0), model)
    first.remove()
    QKClip.for_model(torch.optim.SGD(model.parameters(), lr=0.0), model)
    _, llama = gpt2_and_llama()
    first = QKClip.for_model(torch.optim.SGD(llama.parameters(), lr=0.0), llama)
    with pytest.raises(ValueError, match="Another QKClip records the max logits of 'LlamaForCausalLM' already"):
        QKClip.for_model(torch.optim.SGD(llama.parameters(), lr=0.0), llama)
    first.remove()
    assert llama.config._attn_implementation == "eager"
    QKClip.for_model(torch.optim.SGD(llama.parameters(), lr=0.0), llama)


def test_a_model_without_known_attention_is_told_to_record_itself():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="No attention module that QKClip recognises in Sequential"):
        QKClip.for_model(torch.optim.SGD(model.parameters(), lr=0.1), model)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_recording_keeps_a_hugging_face_model_causal_and_its_outputs_unchanged(implementation):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32, attn_implementation=implementation))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    without = llama(tokens).logits.detach()
    clip = QKClip.for_model(dmuon.Muon(llama, lr=0.0), llama, threshold=1e30)
    with torch.enable_grad():  # recording
        logits, logits_changed = llama(tokens).logits.detach(), llama(changed).logits.detach()
    assert torch.equal(logits, without)  # the model's outputs are what they were
    assert torch.equal(logits[:, :-1], logits_changed[:, :-1])  # a later token moves no earlier position
    clip.remove()
    assert llama.config._attn_implementation == implementation


def clipped_run(events: list[tuple[str, int]], optimizer: str = "dmuon") -> dict:
    """The tiny Llama with logits over τ, one QKClip, and a loop of ``events``: ("step", seed)
    a normal batch; ("skip", seed) a batch whose step the loop skips (GradScaler-style), then
    zero_grad(); ("fail backward", seed) and ("fail forward", seed) an exception in the backward
    pass (after the last layer's) or in the forward pass (after the first layer), caught, then
    zero_grad(); ("step raises", seed) a step that raises; ("zero_grad late", seed) a batch whose
    zero_grad() comes between its forward and backward passes; ("closure", seed) a batch run by
    ``step(closure)`` (forward, zero_grad(), backward: Lightning's order); ("closure raises",
    seed) such a step that raises after its closure. lr 0: only the clip moves weights."""
    model, _, _ = llama_and_batch()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.q_proj.weight.mul_(30)
            layer.attn.k_proj.weight.mul_(30)
    if optimizer == "dmuon":
        opt = dmuon.Muon(model, lr=0.0, weight_decay=0.0, nonfinite_grads="raise")
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
    clip = QKClip.for_model(opt, model, threshold=THRESHOLD)
    failing = []

    def fail_in_backward(grad):
        raise RuntimeError("out of memory (a test's)")

    def after_first_layer(module, args, output):
        if failing == ["forward"]:
            raise RuntimeError("out of memory (a test's)")
        if failing == ["backward"]:
            output.register_hook(fail_in_backward)
        return output

    model.layers[0].register_forward_hook(after_first_layer)
    data = SyntheticTokens(model.config.vocab_size, seed=0)
    for kind, seed in events:
        x, y = data.batch(seed, 4, 32)
        failing[:] = [kind.removeprefix("fail ")] if kind.startswith("fail") else []
        if kind.startswith("closure"):
            def closure(x=x, y=y, raises=kind == "closure raises"):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad()
                loss.backward()
                if raises:
                    model.lm_head.weight.grad[0, 0] = math.nan
                return loss

            if kind == "closure raises":
                with pytest.raises(FloatingPointError):
                    opt.step(closure)
                opt.zero_grad()
            else:
                opt.step(closure)
            continue
        try:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            if kind == "zero_grad late":
                opt.zero_grad()
            loss.backward()
        except RuntimeError as error:
            assert "a test's" in str(error)
            opt.zero_grad()
            if optimizer != "dmuon":
                clip.discard()
            continue
        if kind == "skip":
            opt.zero_grad()
            if optimizer != "dmuon":
                clip.discard()
            continue
        if kind == "step raises":
            model.lm_head.weight.grad[0, 0] = math.nan
            with pytest.raises(FloatingPointError):
                opt.step()
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()},
                statistics=clip.statistics())


@pytest.mark.parametrize("before,optimizer", [
    ("skip", "dmuon"), ("fail backward", "dmuon"), ("fail forward", "dmuon"), ("step raises", "dmuon"),
    ("skip", "sgd"), ("fail backward", "sgd"), ("fail forward", "sgd"),  # discard() by hand
])
def test_records_of_a_skipped_or_failed_batch_are_never_applied(before, optimizer):
    alone = clipped_run([("step", 2)], optimizer)
    after = clipped_run([(before, 1), ("step", 2)], optimizer)
    assert alone["statistics"]["qk_clip/heads_clipped"] > 0
    assert after["statistics"] == alone["statistics"]
    for name, value in alone["params"].items():
        assert torch.equal(after["params"][name], value), name
    # the batch left out has logits of its own: applied, its records would have changed the result
    both = clipped_run([("step", 1), ("step", 2)], optimizer)
    assert any(not torch.equal(both["params"][n], v) for n, v in alone["params"].items())


@pytest.mark.parametrize("optimizer", ["dmuon", "sgd"])
def test_a_step_with_a_closure_clips_with_the_closure_s_logits(optimizer):
    """The records of the closure's forward and backward passes are the step's: the same bits as
    the loop without a closure (the clip took the step before's records, or none, before)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "no rank recorded" would mean the clip missed the closure's records
        closures = clipped_run([("closure", 1), ("closure", 2)], optimizer)
    loop = clipped_run([("step", 1), ("step", 2)], optimizer)
    assert loop["statistics"]["qk_clip/heads_clipped"] > 0
    assert closures["statistics"] == loop["statistics"]
    for name, value in loop["params"].items():
        assert torch.equal(closures["params"][name], value), name


def test_a_step_that_raises_after_its_closure_applies_none_of_the_closure_s_records():
    after = clipped_run([("closure raises", 1), ("closure", 2)])
    alone = clipped_run([("step", 2)])
    assert after["statistics"] == alone["statistics"]
    for name, value in alone["params"].items():
        assert torch.equal(after["params"][name], value), name


def test_a_zero_grad_between_forward_and_backward_keeps_the_batch_records():
    late = clipped_run([("zero_grad late", 2)])
    usual = clipped_run([("step", 2)])
    assert late["statistics"] == usual["statistics"] and late["statistics"]["qk_clip/heads_clipped"] > 0
    assert all(torch.equal(late["params"][n], v) for n, v in usual["params"].items())


def test_discard_drops_the_records_and_a_record_without_query_counts_at_once():
    model, layers = attention_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    clip = QKClip(opt, layers, threshold=4.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    clip.record("sep", torch.full((4,), 100.0))
    clip.discard()
    clip.record("sep", torch.full((4,), 2.0))
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert clip.statistics()["qk_clip/max_logit"] == 2.0
    query = torch.ones(3, requires_grad=True)
    clip.record("sep", torch.full((4,), 100.0), query=query * 2)  # its backward never runs
    with pytest.warns(UserWarning, match="no rank recorded max logits for attention layer 'sep'"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_head_counts_other_than_the_modules_are_refused_and_uncovered_rows_warned():
    model, _, _ = llama_and_batch()  # 4 query heads, 2 key heads of 8
    attn = model.layers[0].attn
    opt = dmuon.Muon(model, lr=0.0)
    for bad, pattern in [(dict(num_kv_heads=1), r"kv_heads=1 but its module 'layers.0.attn' has kv_heads=2"),
                         (dict(num_heads=2), r"num_heads=2 but its module 'layers.0.attn' has num_heads=4")]:
        fields = {**dict(q_weight=attn.q_proj.weight, k_weight=attn.k_proj.weight, num_heads=4, head_dim=8,
                         num_kv_heads=2), **bad}
        with pytest.raises(ValueError, match=pattern):
            QKClip(opt, {"attention": AttentionLayer(**fields)})
    plain, layers = attention_model()
    short = {"sep": AttentionLayer(plain.q.weight, plain.k.weight, num_heads=4, head_dim=3, num_kv_heads=1)}
    with pytest.warns(UserWarning, match=r"its 1 key heads of 3 cover 3 of k_weight's 6 rows"):
        QKClip(torch.optim.SGD(plain.parameters(), lr=0.0), short)


def test_heads_that_are_not_a_slice_are_reported_at_the_step():
    model, layers = attention_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    clip = QKClip(opt, layers, threshold=4.0)
    clip.record("sep", torch.ones(4), heads=3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match=r"layer 'sep': heads=3 is not a slice of its 4 heads"):
        opt.step()
