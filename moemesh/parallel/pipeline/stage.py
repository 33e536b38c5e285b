"""The model cut into pipeline stages.

The model is a row of items — the embedding, the decoder layers, the head (final norm, LM head and
loss) — and a stage is a contiguous range of them (`partition.py` chooses the ranges). A rank keeps
the modules of the stages it holds and drops the rest, so its parameter names stay those of the
whole model: checkpoints written by any stage layout load into any other, one process included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moemesh.errors import ConfigError
from moemesh.models.moe import RouterStats
from moemesh.models.transformer import MoECausalLM


@dataclass(frozen=True)
class Stage:
    index: int
    first: bool  # holds the embedding: takes token ids
    last: bool  # holds the head: gives the loss
    layers: tuple[int, ...]  # decoder layer indices, in order


def cut_model(model: MoECausalLM, ranges: list[range], stage_rank: list[int], rank: int) -> dict[int, Stage]:
    """Keep in `model` only the modules of the stages `rank` holds (stage s covers items
    `ranges[s]`, held by `stage_rank[s]`); return those stages by index."""
    layers = model.config.num_hidden_layers
    head = layers + 1
    stages = {}
    for index, items in enumerate(ranges):
        if stage_rank[index] == rank:
            stages[index] = Stage(index, 0 in items, head in items, tuple(i - 1 for i in items if 1 <= i <= layers))
    held = {i for stage in stages.values() for i in stage.layers}
    if model.config.tie_word_embeddings and any(s.first for s in stages.values()) != any(
        s.last for s in stages.values()
    ):
        raise ConfigError(
            "tie_word_embeddings needs the embedding and the LM head on the same pipeline rank "
            '(parallel.pp_schedule = "dualpipev" puts them both on rank 0)'
        )
    for i in range(layers):
        if i not in held:
            model.model.layers[i] = nn.Identity()  # keeps the other layers' indices, so their names
    if not any(s.first for s in stages.values()):
        model.model.embed_tokens = None
    if not any(s.last for s in stages.values()):
        model.model.norm = model.lm_head = None
    return stages


def stage_forward(
    model: MoECausalLM, stage: Stage, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, list[RouterStats]]:
    """Token ids (first stage) or hidden states -> hidden states after the stage's layers (before
    the head), with the router statistics of its MoE layers."""
    return model.run_layers(model.model.embed_tokens(x) if stage.first else x, positions, stage.layers)


class RankStages(nn.Module):
    """The stages one pipeline rank holds, as one module: `forward(index, ...)` runs stage `index`.
    One module per rank gives FSDP a single root, which gathers the embedding and the head for
    whichever stage uses them (DualPipeV's rank 0 holds both ends)."""

    def __init__(self, model: MoECausalLM, stages: dict[int, Stage]):
        super().__init__()
        self.model, self.stages = model, stages

    def forward(
        self, index: int, x: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor, reduce_stats: bool = True
    ):
        """-> (hidden states, or the last stage's mean cross-entropy; the MoE layers' token counts
        [layers, E] and summed router probabilities, this rank's (differentiable) and their sum
        over the data-parallel ranks (with `reduce_stats`; detached), or None without MoE layers;
        tokens per layer, over those ranks).

        The sum is taken outside autograd: its backward would be a collective that autograd
        schedules by its own order, which under overlapped chunks (`runtime.py`, two threads'
        graph nodes in one backward) may differ from rank to rank — two ranks each waiting in a
        different collective. The load-balancing loss is linear in the probabilities, so each
        rank differentiates its own share instead (`PipelineRunner._aux_share`)."""
        stage = self.stages[index]
        h, stats = stage_forward(self.model, stage, x, positions)
        counts = prob_sums = prob_totals = None
        num_tokens = stats[0].num_tokens if stats else 0
        if stats:
            prob_sums = torch.stack([st.prob_sum for st in stats])
            if reduce_stats:
                stats = self.model.reduce_router_stats(
                    [RouterStats(st.counts.detach(), st.prob_sum.detach(), st.num_tokens) for st in stats]
                )
                num_tokens = stats[0].num_tokens
            counts, prob_totals = torch.stack([st.counts for st in stats]), torch.stack([st.prob_sum for st in stats])
        if stage.last:
            h = self.model.head(self.model.model.norm(h), labels, return_logits=False)[1]
        return h, counts, prob_sums, prob_totals, num_tokens
