"""Batch-invariant mode over four ranks (issue 50), CPU, fp32, gloo: the engine's log-probabilities
and routing equal the trainer's bit for bit under tensor parallelism (two ranks for each of the two
key/value heads, copied) and expert parallelism for decoding. Over two ranks a sum has one order;
over four, gloo splits an all-reduce by its size, so the engine's step (a few rows) and the
trainer's forward (whole sequences) added the same partial sums in other orders — the mode now
adds them in rank order (`parallel/comm._summed_in_rank_order`). A module of its own: its pool has
four ranks."""

from test_batch_invariant import (
    check_engine_and_trainer_bit_equal_under_ep,
    check_engine_and_trainer_bit_equal_under_tp,
)

WORLD = 4


def test_over_four_ranks_the_trainer_s_logprobs_equal_the_engine_s_bit_for_bit(pool):
    assert min(pool.run(check_engine_and_trainer_bit_equal_under_tp)) > 100
    assert min(pool.run(check_engine_and_trainer_bit_equal_under_ep)) > 100
