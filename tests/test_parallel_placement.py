"""The placement checker decides where a tensor-parallel region's one all-reduce goes."""

import pytest

from moemesh.errors import ConfigError
from moemesh.parallel.placement import Op, place_reduce

MOE = [
    Op("gate_up_proj", "packed_colwise"),
    Op("swiglu", "local"),
    Op("down_proj", "rowwise"),
    Op("routing-weight multiply", "linear"),
    Op("top-k sum", "linear"),
]


def test_moe_block_reduces_once_after_combine():
    """Routing-weight multiply and top-k sum are linear: one reduce of [tokens, hidden] at the end."""
    assert place_reduce(MOE) == len(MOE)
    with_scales = [*MOE[:3], Op("per-expert scale", "linear"), Op("another scale", "linear"), *MOE[3:]]
    assert place_reduce(with_scales) == len(with_scales)


def test_a_nonlinear_op_forces_the_reduce_before_it():
    """A per-expert activation after down_proj: the reduce must come first, once per expert slot
    (k times the bytes of the reduce after combine)."""
    chain = [*MOE[:3], Op("per-expert activation", "local"), *MOE[3:]]
    assert place_reduce(chain) == 3


def test_replicated_bias_is_added_after_the_reduce():
    chain = [
        Op("q/k/v_proj", "colwise"),
        Op("attention", "local"),
        Op("o_proj", "rowwise"),
        Op("o_proj.bias", "add_replicated"),
    ]
    assert place_reduce(chain) == 3


def test_replicated_region_needs_no_reduce():
    assert place_reduce([Op("q/k/v_proj", "replicated"), Op("attention", "local"), Op("o_proj", "replicated")]) is None


@pytest.mark.parametrize(
    "chain, message",
    [
        (
            [Op("gate_up_proj", "replicated"), Op("swiglu", "local"), Op("down_proj", "rowwise")],
            r"down_proj \(rowwise\) cannot take a Replicated\(\) input",
        ),
        (
            [Op("q/k/v_proj", "colwise"), Op("attention", "local"), Op("o_proj", "replicated")],
            r"o_proj \(replicated\) cannot take a Sharded\(dim=-1\) input",
        ),
        ([Op("gate_proj", "colwise")], r"leaves its output Sharded"),
        (
            [
                Op("a", "colwise"),
                Op("b", "rowwise"),
                Op("act", "local"),
                Op("c", "colwise"),
                Op("d", "rowwise"),
                Op("act", "local"),
            ],
            r"act \(local\) cannot take a Partial\(\) input",
        ),
    ],
)
def test_chains_that_do_not_fit_are_fatal(chain, message):
    with pytest.raises(ConfigError, match=message):
        place_reduce(chain)
