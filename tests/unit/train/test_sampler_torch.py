"""The seeded sampler in torch (train/sampling.py): the reference's bits, an exact draw from the
nucleus, and choice gaps an honest engine within δ of the learner's logits always passes."""

from __future__ import annotations

import math
import random

import pytest
import torch
from helpers.protocol_doc import sampler_vectors

from echo2swarm.train import sampling
from echo2swarm.train.sampling import choice_gaps, gumbel_noise, nucleus, sample_seeded, seeded_choice, uniform_bits
from echo2swarm.wire import sampling as reference

G_TOLERANCE = 2.0**-19  # how far float32 logs may move g between implementations (protocol.md §10.7)


def keyed(rows: list[tuple[int, int, int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    k0, k1, t = (torch.tensor(c, dtype=torch.long) for c in zip(*rows))
    return uniform_bits(k0, k1, t, vocab), gumbel_noise(k0, k1, t, vocab)


def test_torch_gives_the_reference_bits_on_random_inputs() -> None:
    rng = random.Random(7)
    rows = [(rng.getrandbits(32), rng.getrandbits(32), rng.randrange(2**13)) for _ in range(24)]
    rows += [(0, 0, 0), (2**32 - 1, 2**32 - 1, 2**32 - 1)]  # the extremes of every word
    vocab = 700
    words, noise = keyed(rows, vocab)
    for r, (k0, k1, t) in enumerate(rows):
        for v in list(range(0, vocab, 7)) + [vocab - 1]:
            x = reference.prf(k0, k1, t, v)
            assert int(words[r, v]) == x, (k0, k1, t, v)
            g = reference.gumbel(reference.uniform(x))
            assert abs(float(noise[r, v]) - g) <= G_TOLERANCE, (k0, k1, t, v)
    # The lowbias32 constants split into 16-bit halves never overflow int64, whatever the input.
    top = torch.tensor([2**32 - 1, 2**31, 0x9E3779B9], dtype=torch.long)
    from echo2swarm.train.sampling import lowbias32

    assert lowbias32(top.clone()).tolist() == [reference.lowbias32(int(x)) for x in top]


def test_torch_gives_the_documented_vectors() -> None:
    for row in sampler_vectors():
        words, noise = keyed([(row["k0"], row["k1"], row["t"])], row["v"] + 1)
        assert int(words[0, row["v"]]) == row["x"]
        assert abs(float(noise[0, row["v"]]) - row["g"]) <= G_TOLERANCE


def test_the_noise_does_not_depend_on_the_cpu_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5)
    rows = [(rng.getrandbits(32), rng.getrandbits(32), rng.randrange(2**32)) for _ in range(5)]
    whole = keyed(rows, 1000)[1]
    monkeypatch.setattr(sampling, "CPU_BLOCK_ELEMENTS", 5 * 37)  # 37 columns a block, the last one short
    assert torch.equal(keyed(rows, 1000)[1], whole)


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.3])
def test_the_engines_choice_is_sample_seeded_with_the_whole_noise(top_p: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # seeded_choice draws the noise block by block (top_p = 1) or of the nucleus only (top_p < 1):
    # the same tokens as the full noise gives, peaked rows and flat ones, over several blocks.
    monkeypatch.setattr(sampling, "CPU_BLOCK_ELEMENTS", 40 * 97)
    gen = torch.Generator().manual_seed(8)
    rows, vocab = 40, 3000
    scaled = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.1, 12.0, rows).unsqueeze(1)
    rng = random.Random(6)
    k0, k1, t = (torch.tensor(c, dtype=torch.long)
                 for c in zip(*[(rng.getrandbits(32), rng.getrandbits(32), rng.randrange(500)) for _ in range(rows)]))
    expected, expected_logprobs = sample_seeded(scaled.clone(), gumbel_noise(k0, k1, t, vocab), top_p)
    tokens, logprobs = seeded_choice(scaled, k0, k1, t, top_p)
    assert tokens.tolist() == expected.tolist()
    assert torch.allclose(logprobs, expected_logprobs, atol=1e-5)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_gumbel_max_draws_from_the_nucleus_at_its_probabilities(temperature: float, top_p: float) -> None:
    logits = torch.tensor([2.0, 1.5, 0.3, -0.5, -1.0, -3.0])
    rows = 40_000
    rng = random.Random(3)
    k0 = torch.tensor([rng.getrandbits(32) for _ in range(rows)])
    k1 = torch.tensor([rng.getrandbits(32) for _ in range(rows)])
    t = torch.randint(0, 100, (rows,), generator=torch.Generator().manual_seed(0))
    scaled = (logits / temperature).expand(rows, -1)
    tokens, logprobs = sample_seeded(scaled.clone(), gumbel_noise(k0, k1, t, len(logits)), top_p)
    p = torch.softmax(logits.double() / temperature, dim=-1)
    kept = (p.sort(descending=True).values.cumsum(0) - p.sort(descending=True).values) < top_p
    inside = p.sort(descending=True).indices[kept]
    expected = torch.zeros_like(p)
    expected[inside] = p[inside] / p[inside].sum()
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    sigma = (rows * expected * (1 - expected)).sqrt()
    assert bool(((counts - rows * expected).abs() <= 5 * sigma + 1e-9).all()), (counts / rows, expected)
    assert bool((counts[expected == 0] == 0).all())  # nothing outside the nucleus, ever
    # The behaviour logprob is the nucleus renormalised one (rollout/engines/base.py).
    assert torch.allclose(logprobs.double(), expected.log()[tokens], atol=1e-5)


def test_the_nucleus_is_the_engines_rule() -> None:
    logp = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    for top_p, kept in ((0.7, [0, 1]), (0.45, [0]), (0.55, [0, 1]), (0.81, [0, 1, 2]), (0.999, [0, 1, 2, 3])):
        log_mass, drop = nucleus(logp, top_p)
        assert (~drop).nonzero().squeeze(1).tolist() == kept, top_p
        assert float(log_mass) == pytest.approx(math.log(sum([0.5, 0.3, 0.15, 0.05][i] for i in kept)), abs=1e-6)


def test_draws_do_not_depend_on_rows_order_or_batch() -> None:
    rng = random.Random(11)
    rows = [(rng.getrandbits(32), rng.getrandbits(32), rng.randrange(64)) for _ in range(16)]
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    _, noise = keyed(rows, 50)
    together, _ = sample_seeded(logits.clone(), noise, 0.9)
    order = list(reversed(range(16)))
    _, shuffled_noise = keyed([rows[i] for i in order], 50)
    shuffled, _ = sample_seeded(logits[order].clone(), shuffled_noise, 0.9)
    alone = [int(sample_seeded(logits[i:i + 1].clone(), keyed([rows[i]], 50)[1], 0.9)[0]) for i in range(16)]
    assert together.tolist() == shuffled.flip(0).tolist() == alone


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5])
def test_an_engine_within_delta_of_the_learner_always_passes(top_p: float) -> None:
    # The engine's logits differ from the learner's by up to delta / 2 per token, so by up to delta in any
    # difference of two: every choice it makes passes the learner's check with that delta, wherever the
    # nucleus's edge falls. Peaked and flat rows, many near-ties, to reach the edge often.
    delta = 0.2
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 4000, 12
    learner = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    learner[::3, 1] = learner[::3, 0] + 0.05  # near-ties at the top
    engine = learner + (torch.rand(rows, vocab, generator=gen) - 0.5) * delta
    rng = random.Random(2)
    _, noise = keyed([(rng.getrandbits(32), rng.getrandbits(32), rng.randrange(99)) for _ in range(rows)], vocab)
    tokens, _ = sample_seeded(engine.clone(), noise, top_p)
    gap, outside = choice_gaps(learner, tokens, noise.clone(), top_p, delta)
    assert not bool(outside.any()) and float(gap.max()) <= delta + 1e-5
    # The same logits as the learner's: the choice is the learner's own, gap 0 wherever defined.
    same, _ = sample_seeded(learner.clone(), noise, top_p)
    gap, outside = choice_gaps(learner, same, noise.clone(), top_p, 0.0)
    assert not bool(outside.any()) and float(gap.max()) <= 0.0


def test_choices_at_another_temperature_or_nucleus_or_greedy_fail() -> None:
    gen = torch.Generator().manual_seed(9)
    rows, vocab = 2000, 20
    logits = torch.randn(rows, vocab, generator=gen) * 2
    rng = random.Random(4)
    _, noise = keyed([(rng.getrandbits(32), rng.getrandbits(32), rng.randrange(99)) for _ in range(rows)], vocab)
    delta = 0.1
    cases = {
        "T 1.2": sample_seeded(logits / 1.2, noise, 1.0)[0],
        "T 0.8": sample_seeded(logits / 0.8, noise, 1.0)[0],
        "top_p 0.9": sample_seeded(logits.clone(), noise, 0.9)[0],
        "greedy": logits.argmax(dim=-1),
        "own noise": sample_seeded(logits.clone(), torch.rand(rows, vocab, generator=gen).log_().neg_().log_().neg_(),
                                   1.0)[0],
    }
    for name, tokens in cases.items():
        gap, outside = choice_gaps(logits, tokens, noise.clone(), 1.0, delta)
        failed = float(((gap > delta) | outside).float().mean())
        assert failed > 0.03, (name, failed)  # per position: a completion of tens of tokens fails almost surely
    # Sent outside a small nucleus, a token is surely outside it.
    tokens = logits.argmin(dim=-1)
    _, outside = choice_gaps(logits, tokens, noise.clone(), 0.5, delta)
    assert float(outside.float().mean()) > 0.99
