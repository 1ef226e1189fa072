"""GRPO maths against hand-computed numbers, and one end-to-end check that the sign is right."""

from __future__ import annotations

import math

import pytest
import torch

from echo2swarm.train.grpo import LossOptions, group_advantages, grpo_loss, token_logprobs
from echo2swarm.models.tiny import build_tiny_model

# ---------------------------------------------------------------------------- group_advantages


def test_group_advantages_std_scaled_and_plain() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # mean 0.5, sample std sqrt(1/3)

    scaled = group_advantages(rewards)
    plain = group_advantages(rewards, scale_std=False)

    torch.testing.assert_close(scaled, torch.tensor([0.5, -0.5, -0.5, 0.5]) / (math.sqrt(1 / 3) + 1e-4))
    torch.testing.assert_close(plain, torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.7])
@pytest.mark.parametrize("scale_std", [True, False])
def test_group_advantages_all_equal_is_exact_zeros(value: float, scale_std: bool) -> None:
    adv = group_advantages(torch.full((5,), value), scale_std=scale_std)
    assert torch.equal(adv, torch.zeros(5))
    assert torch.equal(group_advantages(torch.tensor([value])), torch.zeros(1))


def test_group_advantages_int_rewards_and_rows() -> None:
    adv = group_advantages(torch.tensor([[1, 0, 0, 1], [2, 2, 2, 2]]), scale_std=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))


# ---------------------------------------------------------------------------- grpo_loss
#
# B=2, T=3, clip 0.2 (so the trust region is [0.8, 1.2]); row 0 has one padding token.
#   token   A     r     r*A     clip(r)*A   min     loss    clipped?
#   (0,0)   2.0   1.5   3.0     2.4         2.4    -2.4     yes (A>0, r>1.2)
#   (0,1)   2.0   0.5   1.0     1.6         1.0    -1.0     no
#   (0,2)   pad
#   (1,0)  -0.5   0.5  -0.25   -0.4        -0.4     0.4     yes (A<0, r<0.8)
#   (1,1)  -0.5   1.1  -0.55   -0.55       -0.55    0.55    no (inside)
#   (1,2)  -0.5   1.5  -0.75   -0.6        -0.75    0.75    no (A<0, r>1.2: pessimistic branch is unclipped)
# token mean = (-2.4 - 1.0 + 0.4 + 0.55 + 0.75) / 5 = -1.7 / 5 = -0.34
# clip_frac = 2/5, ratio_mean = (1.5 + 0.5 + 0.5 + 1.1 + 1.5) / 5 = 1.02
# d loss / d lp = -A r / 5 on unclipped tokens: (0,1) -0.2, (1,1) +0.11, (1,2) +0.15; 0 elsewhere.

D = torch.float64
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=D)
ADV = torch.tensor([2.0, -0.5], dtype=D)
RATIO = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.1, 1.5]], dtype=D)
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.7, -2.2]], dtype=D)
EXPECTED_GRAD = torch.tensor([[0.0, -0.2, 0.0], [0.0, 0.11, 0.15]], dtype=D)


def _logprobs(base: torch.Tensor, ratio: torch.Tensor = RATIO) -> torch.Tensor:
    return (base + ratio.log()).clone().requires_grad_(True)


def test_grpo_loss_hand_computed_ppo_clip() -> None:
    lp = _logprobs(BEHAVIOUR)

    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, options=LossOptions(clip_low=0.2, clip_high=0.2))
    loss.backward()

    assert loss.item() == pytest.approx(-0.34, abs=1e-12)
    assert stats["loss"] == pytest.approx(-0.34, abs=1e-12)
    assert stats["clip_frac"] == pytest.approx(0.4)
    assert stats["ratio_mean"] == pytest.approx(1.02)
    assert stats["kl"] == 0.0
    assert stats["is_weight_mean"] == 1.0
    assert all(isinstance(v, float) for v in stats.values())
    torch.testing.assert_close(lp.grad, EXPECTED_GRAD)
    # clipped tokens get exactly no gradient, unclipped ones do
    assert lp.grad[0, 0] == 0 and lp.grad[1, 0] == 0
    assert lp.grad[0, 1] != 0 and lp.grad[1, 1] != 0 and lp.grad[1, 2] != 0


def test_grpo_loss_asymmetric_clip() -> None:
    # clip_high 0.6 puts r=1.5 inside the region for A>0: (0,0) becomes unclipped, loss -3.0.
    lp = _logprobs(BEHAVIOUR)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, options=LossOptions(clip_low=0.2, clip_high=0.6))
    assert loss.item() == pytest.approx((-3.0 - 1.0 + 0.4 + 0.55 + 0.75) / 5)
    assert stats["clip_frac"] == pytest.approx(0.2)


def test_grpo_loss_unclipped_equals_policy_gradient() -> None:
    # at r = 1 (on-policy) nothing is clipped and the gradient is -A / n_tokens
    lp = BEHAVIOUR.clone().requires_grad_(True)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK)
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 * 2 - 0.5 * 3) / 5)
    assert stats["clip_frac"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0)
    torch.testing.assert_close(lp.grad, -ADV[:, None] * MASK / 5)


# Decoupled PPO: the same ratios, now against proximal; IS weights w = exp(proximal - behaviour)
#   w (raw)   = 3.0, 0.5, pad, 1.0, 1.5, 2.5   -> capped at 2: 2.0, 0.5, 1.0, 1.5, 2.0
#   weighted  = -2.4*2 - 1.0*0.5 + 0.4*1 + 0.55*1.5 + 0.75*2 = -2.575 -> mean -0.515
#   uncapped  = -2.4*3 - 0.5 + 0.4 + 0.825 + 0.75*2.5 = -4.6 -> mean -0.92
#   is_weight_mean capped = 7/5; grad (0,1) = -A r w / 5 = -0.1
WEIGHT = torch.tensor([[3.0, 0.5, 1.0], [1.0, 1.5, 2.5]], dtype=D)
PROXIMAL = BEHAVIOUR + WEIGHT.log()
CAP2 = LossOptions(is_cap=2.0)


def test_grpo_loss_decoupled_is_weights_capped() -> None:
    proximal = PROXIMAL.clone().requires_grad_(True)  # must receive no gradient
    lp = _logprobs(PROXIMAL)

    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=proximal, options=CAP2)
    loss.backward()

    assert loss.item() == pytest.approx(-0.515)
    assert stats["is_weight_mean"] == pytest.approx(1.4)
    assert stats["clip_frac"] == pytest.approx(0.4)
    assert stats["ratio_mean"] == pytest.approx(1.02)  # ratio is against proximal, not behaviour
    capped = WEIGHT.clamp(max=2.0)
    torch.testing.assert_close(lp.grad, EXPECTED_GRAD * capped * MASK)
    assert lp.grad[0, 1].item() == pytest.approx(-0.1)
    assert proximal.grad is None


def test_grpo_loss_decoupled_without_cap() -> None:
    lp = _logprobs(PROXIMAL)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=PROXIMAL, options=LossOptions(is_cap=None))
    assert loss.item() == pytest.approx(-0.92)
    assert stats["is_weight_mean"] == pytest.approx((3.0 + 0.5 + 1.0 + 1.5 + 2.5) / 5)


def test_grpo_loss_proximal_equal_behaviour_matches_plain() -> None:
    lp = _logprobs(BEHAVIOUR)
    plain, _ = grpo_loss(lp, BEHAVIOUR, ADV, MASK)
    decoupled, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=BEHAVIOUR.clone())
    assert decoupled.item() == pytest.approx(plain.item())
    assert stats["is_weight_mean"] == pytest.approx(1.0)


# KL k3 per token, d = ref - lp: exp(d) - d - 1
#   d = 0, ln 2, pad, ln 0.5, 1, 0  ->  0, 1 - ln 2, -, ln 2 - 0.5, e - 2, 0  -> sum e - 1.5
KL_DELTA = torch.tensor([[0.0, math.log(2.0), 0.0], [math.log(0.5), 1.0, 0.0]], dtype=D)


def test_grpo_loss_kl_k3_hand_computed() -> None:
    lp = _logprobs(BEHAVIOUR)
    ref = lp.detach() + KL_DELTA
    expected_kl = (math.e - 1.5) / 5

    k3 = LossOptions(kl_estimator="k3", kl_coef=0.1)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, ref_logprobs=ref, options=k3)
    assert stats["kl"] == pytest.approx(expected_kl)
    assert loss.item() == pytest.approx(-0.34 + 0.1 * expected_kl)

    # reported but not added when kl_coef is 0
    loss0, stats0 = grpo_loss(lp, BEHAVIOUR, ADV, MASK, ref_logprobs=ref, options=LossOptions(kl_estimator="k3"))
    assert loss0.item() == pytest.approx(-0.34)
    assert stats0["kl"] == pytest.approx(expected_kl)

    # d/dlp of k3 = 1 - exp(d), token mean: (0,1) -> (1 - 2)/5 more (times kl_coef)
    lp.grad = None
    loss, _ = grpo_loss(lp, BEHAVIOUR, ADV, MASK, ref_logprobs=ref, options=k3)
    loss.backward()
    kl_grad = 0.1 * (1 - KL_DELTA.exp()) * MASK / 5
    torch.testing.assert_close(lp.grad, EXPECTED_GRAD + kl_grad)

    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, BEHAVIOUR, ADV, MASK, options=LossOptions(kl_coef=0.1))


@pytest.mark.parametrize("garbage", [1e4, -1e4, float("inf"), float("-inf"), float("nan")])
def test_grpo_loss_padding_contributes_nothing(garbage: float) -> None:
    ref = BEHAVIOUR + KL_DELTA
    lp = _logprobs(PROXIMAL)
    clean_loss, clean_stats = grpo_loss(
        lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=PROXIMAL, ref_logprobs=ref, options=LossOptions(kl_coef=0.1)
    )
    clean_loss.backward()
    clean_grad = lp.grad.clone()

    def dirty(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        t[0, 2] = garbage
        return t

    lp2 = dirty(lp).requires_grad_(True)
    loss, stats = grpo_loss(
        lp2, dirty(BEHAVIOUR), ADV, MASK, proximal_logprobs=dirty(PROXIMAL), ref_logprobs=dirty(ref),
        options=LossOptions(kl_coef=0.1),
    )
    loss.backward()

    assert loss.item() == pytest.approx(clean_loss.item())
    assert stats == pytest.approx(clean_stats)
    torch.testing.assert_close(lp2.grad, clean_grad)
    assert lp2.grad[0, 2] == 0


def test_grpo_loss_bool_mask_and_shape_errors() -> None:
    lp = _logprobs(BEHAVIOUR)
    loss, _ = grpo_loss(lp, BEHAVIOUR, ADV, MASK.bool())
    assert loss.item() == pytest.approx(-0.34)
    with pytest.raises(ValueError):
        grpo_loss(lp, BEHAVIOUR[:, :2], ADV, MASK)
    with pytest.raises(ValueError):
        grpo_loss(lp, BEHAVIOUR, ADV[:1], MASK)


def test_grpo_loss_empty_mask_is_zero_not_nan() -> None:
    lp = _logprobs(BEHAVIOUR)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, torch.zeros_like(MASK))
    loss.backward()
    assert loss.item() == 0.0 and not math.isnan(stats["loss"])
    assert torch.equal(lp.grad, torch.zeros_like(lp))


# ---------------------------------------------------------------------------- token_logprobs


def _left_padded(rows: list[tuple[list[int], list[int]]], pad: int = 0):
    length = max(len(p) + len(c) for p, c in rows)
    ids, attn, comp = [], [], []
    for prompt, completion in rows:
        n_pad = length - len(prompt) - len(completion)
        ids.append([pad] * n_pad + prompt + completion)
        attn.append([0] * n_pad + [1] * (len(prompt) + len(completion)))
        comp.append([0] * (n_pad + len(prompt)) + [1] * len(completion))
    return torch.tensor(ids), torch.tensor(attn), torch.tensor(comp)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny_model(seed=0)
    return model, tokenizer


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_left_padded_matches_unpadded(tiny, temperature: float) -> None:
    model, tok = tiny
    eos = tok.eos_token_id
    assert tok.pad_token_id == 0
    rows = [
        (_encode(tok, "12+34="), _encode(tok, "46") + [eos]),
        (_encode(tok, "7="), _encode(tok, "7") + [eos]),
        (_encode(tok, "999+1="), _encode(tok, "1000") + [eos]),
    ]
    ids, attn, comp = _left_padded(rows)
    comp_before = comp.clone()

    with torch.no_grad():
        out = token_logprobs(model, ids, attn, comp, temperature=temperature)

    assert torch.equal(comp, comp_before)  # the caller's mask is not modified
    assert out.shape == ids.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.equal(out[comp == 0], torch.zeros(int((comp == 0).sum())))
    for b, (prompt, completion) in enumerate(rows):
        seq = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0].double()
        ref = torch.log_softmax(logits / temperature, dim=-1)
        expected = torch.stack([ref[t - 1, seq[0, t]] for t in range(len(prompt), seq.shape[1])])
        got = out[b, -len(completion):]
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


def test_token_logprobs_has_grad_and_works_without_logits_to_keep(tiny) -> None:
    model, tok = tiny

    class Plain(torch.nn.Module):  # a model whose forward lacks `logits_to_keep`
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return self.inner(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache
            )

    ids, attn, comp = _left_padded([(_encode(tok, "3+4="), _encode(tok, "7")), (_encode(tok, "10="), _encode(tok, "ab"))])
    out = token_logprobs(model, ids, attn, comp)
    with torch.no_grad():
        plain = token_logprobs(Plain(), ids, attn, comp)
    torch.testing.assert_close(out.detach(), plain)
    out.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_token_logprobs_position_zero_and_empty_mask(tiny) -> None:
    model, tok = tiny
    ids = torch.tensor([_encode(tok, "abc")])
    ones = torch.ones_like(ids)
    out = token_logprobs(model, ids, ones, ones)
    assert out[0, 0] == 0 and (out[0, 1:] < 0).all()
    assert torch.equal(token_logprobs(model, ids, ones, torch.zeros_like(ids)), torch.zeros(1, 3))


# ---------------------------------------------------------------------------- end to end


def test_grpo_steps_raise_logprob_of_rewarded_completions() -> None:
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=1)
    model.train()
    eos = tok.eos_token_id
    prompts = ["3+4=", "12+5="]
    target = {"3+4=": _encode(tok, "7") + [eos], "12+5=": _encode(tok, "17") + [eos]}
    rows, rewards, adv = [], [], []
    for prompt in prompts:
        group = [target[prompt], target[prompt], _encode(tok, "xq") + [eos], _encode(tok, "0")]
        r = torch.tensor([1.0, 1.0, 0.0, 0.0])
        rows += [(_encode(tok, prompt), c) for c in group]
        rewards += r.tolist()
        adv.append(group_advantages(r))
    advantages = torch.cat(adv)
    ids, attn, comp = _left_padded(rows)
    rewarded = torch.tensor(rewards).bool()

    def mean_lp(which: torch.Tensor) -> float:
        with torch.no_grad():
            lp = token_logprobs(model, ids, attn, comp)
        return float((lp[which] * comp[which]).sum() / comp[which].sum())

    with torch.no_grad():
        behaviour = token_logprobs(model, ids, attn, comp)
    before_good, before_bad = mean_lp(rewarded), mean_lp(~rewarded)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(5):
        with torch.no_grad():
            proximal = token_logprobs(model, ids, attn, comp)
        lp = token_logprobs(model, ids, attn, comp)
        loss, stats = grpo_loss(lp, behaviour, advantages, comp, proximal_logprobs=proximal)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert math.isfinite(stats["loss"])

    after_good, after_bad = mean_lp(rewarded), mean_lp(~rewarded)
    assert after_good > before_good + 0.05, (before_good, after_good)
    assert after_bad < before_bad - 0.05, (before_bad, after_bad)


# ---------------------------------------------------------------------------- loss options
#
# Unweighted token losses from the PPO table above: row 0: -2.4, -1.0 (2 tokens); row 1: 0.4, 0.55, 0.75.


@pytest.mark.parametrize(
    ("options", "expected_loss", "grad_01", "grad_11", "grad_12"),
    [
        # token mean: sum -1.7 over 5 tokens; d/dlp = -A r / 5
        (LossOptions(loss_type="bnpo"), -1.7 / 5, -1.0 / 5, 0.55 / 5, 0.75 / 5),
        # mean of row means: row 0 -3.4/2, row 1 1.7/3; d/dlp = -A r / (tokens in row) / 2 rows
        (LossOptions(loss_type="grpo"), (-3.4 / 2 + 1.7 / 3) / 2, -1.0 / 4, 0.55 / 6, 0.75 / 6),
        # Dr. GRPO: sum over 2 rows x max length 4
        (LossOptions(loss_type="dr_grpo", max_completion_length=4), -1.7 / 8, -1.0 / 8, 0.55 / 8, 0.75 / 8),
        # DAPO: sum over the step's 10 tokens (this minibatch holds 5 of them)
        (LossOptions(loss_type="dapo", global_tokens=10), -1.7 / 10, -1.0 / 10, 0.55 / 10, 0.75 / 10),
    ],
)
def test_loss_aggregation_hand_computed(options: LossOptions, expected_loss: float, grad_01: float,
                                        grad_11: float, grad_12: float) -> None:
    lp = _logprobs(BEHAVIOUR)
    loss, _ = grpo_loss(lp, BEHAVIOUR, ADV, MASK, options=options)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss)
    expected = torch.zeros_like(lp)
    expected[0, 1], expected[1, 1], expected[1, 2] = grad_01, grad_11, grad_12
    torch.testing.assert_close(lp.grad, expected)


def test_loss_options_validated() -> None:
    with pytest.raises(ValueError, match="loss_type"):
        LossOptions(loss_type="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_completion_length"):
        LossOptions(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="global_tokens"):
        LossOptions(loss_type="dapo")
    with pytest.raises(ValueError, match="is_mode"):
        LossOptions(is_mode="drop")  # type: ignore[arg-type]


def test_token_mask_mode_hand_computed() -> None:
    # WEIGHT (proximal/behaviour) = [[3, .5, pad], [1, 1.5, 2.5]], cap 2: tokens (0,0) and (1,2) weigh 0
    # and stay in the token mean. Left: (0,1) -1.0 * .5, (1,0) 0.4 * 1, (1,1) 0.55 * 1.5 -> 0.725 over 5.
    lp = _logprobs(PROXIMAL)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=PROXIMAL,
                            options=LossOptions(is_mode="mask", is_cap=2.0))
    loss.backward()
    assert loss.item() == pytest.approx(0.725 / 5)
    assert stats["is_masked_frac"] == pytest.approx(2 / 5)
    assert stats["is_truncated_frac"] == 0.0
    assert stats["is_weight_mean"] == pytest.approx((0.5 + 1.0 + 1.5) / 3)
    # d/dlp = -A r w / 5 on unclipped kept tokens; masked and clipped ones get nothing
    expected = torch.tensor([[0.0, -2.0 * 0.5 * 0.5 / 5, 0.0], [0.0, 0.55 * 1.5 / 5, 0.0]], dtype=D)
    torch.testing.assert_close(lp.grad, expected)


def test_truncate_mode_reports_truncated_share_and_ess() -> None:
    lp = _logprobs(PROXIMAL)
    _, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=PROXIMAL, options=CAP2)
    assert stats["is_truncated_frac"] == pytest.approx(2 / 5)  # weights 3 and 2.5 cut to 2
    raw = [3.0, 0.5, 1.0, 1.5, 2.5]
    assert stats["is_ess"] == pytest.approx(sum(raw) ** 2 / (5 * sum(w * w for w in raw)))
    logs = [abs(math.log(w)) for w in raw]
    assert stats["offpolicy_gap_mean"] == pytest.approx(sum(logs) / 5)
    assert stats["offpolicy_gap_max"] == pytest.approx(math.log(3.0))


def test_sequence_level_weights_hand_computed() -> None:
    # one weight per sequence: the geometric mean of its tokens' weights
    w0, w1 = math.sqrt(3.0 * 0.5), (1.0 * 1.5 * 2.5) ** (1 / 3)  # 1.2247, 1.5536
    lp = _logprobs(PROXIMAL)
    seq = LossOptions(is_level="sequence", is_cap=2.0)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=PROXIMAL, options=seq)
    assert loss.item() == pytest.approx((w0 * -3.4 + w1 * 1.7) / 5)
    assert stats["is_truncated_frac"] == 0.0
    # cap 1.5 with masking: sequence 1 (weight 1.55) leaves the objective as a whole
    masked = LossOptions(is_level="sequence", is_mode="mask", is_cap=1.5)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=PROXIMAL, options=masked)
    assert loss.item() == pytest.approx(w0 * -3.4 / 5)  # sequence 1's three tokens count, as zeros
    assert stats["is_masked_frac"] == pytest.approx(3 / 5)
    # truncated instead: sequence 1 weighs 1.5
    cut = LossOptions(is_level="sequence", is_mode="truncate", is_cap=1.5)
    loss, _ = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=PROXIMAL, options=cut)
    assert loss.item() == pytest.approx((w0 * -3.4 + 1.5 * 1.7) / 5)


def test_kl_k3_is_hand_computed() -> None:
    # lp = behaviour + log RATIO: the prefix weights pi(y<=t)/mu(y<=t) are RATIO's running products,
    # W = [[1.5, 0.75, -], [0.5, 0.55, 0.825]] (below the cap); k3 per token from KL_DELTA:
    # [[0, 1 - ln 2, -], [ln 2 - 0.5, e - 2, 0]]; KL = sum W k3 / 5 = 0.72176 / 5.
    lp = _logprobs(BEHAVIOUR)
    ref = lp.detach() + KL_DELTA
    k3 = (torch.exp(KL_DELTA) - KL_DELTA - 1) * MASK
    w = torch.tensor([[1.5, 0.75, 0.0], [0.5, 0.55, 0.825]], dtype=D)
    expected_kl = float((w * k3).sum() / 5)
    assert expected_kl == pytest.approx(0.72176 / 5, abs=1e-5)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, ref_logprobs=ref, options=LossOptions(kl_coef=0.1))
    loss.backward()
    assert stats["kl"] == pytest.approx(expected_kl)
    assert loss.item() == pytest.approx(-0.34 + 0.1 * expected_kl)
    # d/dlp_s = sum_{t >= s} W_t k3_t (through the weights of the prefixes holding s)
    #         + W_s (1 - exp(delta_s))  (through k3_s), over 5 tokens, times kl_coef
    later = (w * k3).flip(1).cumsum(1).flip(1)
    kl_grad = (later + w * (1 - KL_DELTA.exp())) * MASK / 5
    assert kl_grad[1, 1].item() == pytest.approx((0.55 * (math.e - 2) + 0.55 * (1 - math.e)) / 5)
    torch.testing.assert_close(lp.grad, EXPECTED_GRAD + 0.1 * kl_grad)


def test_sequence_product_weights_hand_computed() -> None:
    # one weight per sequence: the product of its tokens' weights, pi(y)/mu(y) of the completion
    p0, p1 = 3.0 * 0.5, 1.0 * 1.5 * 2.5  # 1.5, 3.75
    lp = _logprobs(PROXIMAL)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=PROXIMAL,
                            options=LossOptions(is_level="sequence_product", is_cap=5.0))
    assert loss.item() == pytest.approx((p0 * -3.4 + p1 * 1.7) / 5)
    assert stats["is_truncated_frac"] == 0.0
    # cap 2: sequence 1 (3.75) is truncated to 2, all three of its tokens counted as cut
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=PROXIMAL,
                            options=LossOptions(is_level="sequence_product", is_cap=2.0))
    assert loss.item() == pytest.approx((p0 * -3.4 + 2.0 * 1.7) / 5)
    assert stats["is_truncated_frac"] == pytest.approx(3 / 5)
    # masked instead: sequence 1 leaves the objective as a whole
    masked = LossOptions(is_level="sequence_product", is_mode="mask", is_cap=2.0)
    loss, stats = grpo_loss(lp, BEHAVIOUR, ADV, MASK, proximal_logprobs=PROXIMAL, options=masked)
    assert loss.item() == pytest.approx(p0 * -3.4 / 5)  # sequence 1's three tokens count, as zeros
    assert stats["is_masked_frac"] == pytest.approx(3 / 5)
