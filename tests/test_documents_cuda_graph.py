"""Packed rows' attention inside a CUDA graph (`ops/documents.py`): flex attention's block mask is
made inside the captured graph, so each replay attends by the positions copied in for it — not by
the capture's, nor the eager warm-up's. Every replay's output equals the eager computation on its
positions (the same kernels: exactly) and the masked SDPA reference within bf16 tolerance, and its
gradients of q, k and v the eager ones within bf16 tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moemesh.ops import documents

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU")


def _positions(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).cuda()


def test_each_replay_attends_by_its_own_positions():
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 512, 64
    q, k, v = (
        torch.randn(batch, h, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    layouts = [
        _positions([[100, 300, 112], [512]]),
        _positions([[512], [7, 505]]),
        _positions([[256, 256], [128, 128, 256]]),
    ]
    buffer = layouts[0].clone()

    def step(positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = documents.attention(q, k, v, positions)
        return (out, *torch.autograd.grad(out.float().square().sum(), (q, k, v)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # the warm-up compiles flex attention
            step(buffer)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = step(buffer)
    assert not documents._flex_failed, documents._flex_failed
    for positions in reversed(layouts):
        buffer.copy_(positions)
        graph.replay()
        mask = documents.document_mask(positions)[:, None]
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.allclose(captured[0].float(), reference.float(), atol=2e-2, rtol=2e-2)
        eager = step(positions.clone())  # a new tensor: its own mask (the cache knows tensors, not values)
        for got, want in zip(captured, eager):
            assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)
        assert torch.equal(captured[0], eager[0])
