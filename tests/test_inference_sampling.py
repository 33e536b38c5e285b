"""Sampling on the device: greedy is the argmax; a draw follows softmax(logits / temperature);
top-p never draws outside the nucleus; a row's draw depends on its seed and step only (not on
the other rows of its batch).

Frequencies: 4000 draws (different seeds) of a 4-token distribution; each frequency's standard
deviation is at most sqrt(0.25 / 4000) = 0.008, so 0.04 is five of them: a biased sampler (a wrong
temperature, an off-by-one in the nucleus) misses by more."""

import pytest
import torch

from moemesh.inference.sampling import gumbel_noise, mode_for, sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _draws(logits, temperature, top_p, n=4000, mode="nucleus"):
    rows = logits.expand(n, -1)
    return sample(
        rows,
        torch.full((n,), temperature),
        torch.full((n,), top_p),
        torch.arange(n),
        torch.zeros(n, dtype=torch.long),
        mode,
    )


def test_draws_follow_the_softmax_at_the_temperature():
    logits = PROBS.log()
    freq = torch.bincount(_draws(logits, 1.0, 1.0, mode="sample"), minlength=4) / 4000
    assert (freq - PROBS).abs().max() < 0.04
    hot = torch.softmax(logits / 2.0, dim=-1)
    freq = torch.bincount(_draws(logits, 2.0, 1.0, mode="sample"), minlength=4) / 4000
    assert (freq - hot).abs().max() < 0.04


def test_top_p_keeps_only_the_nucleus():
    logits = PROBS.log()
    freq = torch.bincount(_draws(logits, 1.0, 0.7), minlength=4) / 4000
    assert freq[2:].sum() == 0  # 0.5 + 0.3 reaches 0.7: tokens 2 and 3 never come
    assert abs(freq[0] - 0.5 / 0.8) < 0.04
    assert set(_draws(logits, 1.0, 0.4).tolist()) == {0}


def test_greedy_rows_take_the_argmax_in_any_mode():
    logits = torch.randn(6, 50)
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    for mode in ("greedy", "sample", "nucleus"):
        out = sample(
            logits, temperature, torch.full((6,), 0.9), torch.arange(6), torch.zeros(6, dtype=torch.long), mode
        )
        assert torch.equal(out[::2], logits.argmax(-1)[::2])


def test_a_draw_depends_on_its_seed_and_step_alone():
    logits = torch.randn(1, 1000)
    alone = sample(logits, torch.ones(1), torch.ones(1), torch.tensor([7]), torch.tensor([3]), "sample")
    batch = sample(
        torch.cat([torch.randn(2, 1000), logits]),
        torch.ones(3),
        torch.ones(3),
        torch.tensor([1, 2, 7]),
        torch.tensor([0, 5, 3]),
        "sample",
    )
    assert batch[2] == alone[0]
    noise = gumbel_noise(torch.tensor([7, 7, 8]), torch.tensor([3, 4, 3]), 1000)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert noise.isfinite().all()
    # Gumbel(0, 1): mean = Euler's constant, variance pi^2 / 6 (3000 draws: 0.05 is > 5 standard errors)
    assert abs(noise.mean() - 0.5772) < 0.05 and abs(noise.var() - 1.6449) < 0.15


@pytest.mark.parametrize(
    "temperatures, top_ps, mode",
    [([0, 0], [0.5, 1], "greedy"), ([0, 1], [0.5, 1], "sample"), ([1, 0], [0.5, 1], "nucleus")],
)
def test_the_mode_is_the_cheapest_that_serves_every_row(temperatures, top_ps, mode):
    assert mode_for(temperatures, top_ps) == mode


def test_a_seed_s_high_bits_count_and_small_seeds_draw_as_they_always_did():
    """Seeds below 2**32 keep the noise of the hash of their 32 bits (the formula before high bits
    counted); seeds that differ only above bit 32 draw differently."""
    from moemesh.inference.sampling import _MASK32, _mix32

    seed, step = torch.tensor([12345, 12345 + 2**32, 12345 + 2**40]), torch.tensor([3, 3, 3])
    noise = gumbel_noise(seed, step, 64)
    row = _mix32(_mix32(seed[:1] & _MASK32) ^ (step[:1] & _MASK32))
    bits = _mix32(row[:, None] ^ torch.arange(64))
    assert torch.equal(noise[0], -torch.log(-torch.log(((bits[0] >> 8).float() + 0.5) * 2.0**-24)))
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[1], noise[2])
