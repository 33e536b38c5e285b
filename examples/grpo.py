"""GRPO on a toy task whose answers can be checked: sample with the inference engine, train with
the trainer's forward, hand the weights back to the engine, every step — on a CPU, in minutes.

    python examples/grpo.py                 # 400 steps, about a minute on two CPU cores
    python examples/grpo.py --steps 20
    python examples/grpo.py --batch-invariant   # sampler and trainer on the same bits: differences 0

The task: reverse three digits — prompt "418=", answer "814". The reward of a completion is the
share of its three characters that are right, position by position. The model is a freshly
initialised tiny MoE over the 13 tokens of `CharTokenizer`, so that a random policy samples a right
digit one time in 13 and a group's rewards differ from the first step on. (Two-digit addition,
"3+9=" -> "12", learnt its tens digit and then stalled near 0.55 in 300 steps: the units digit,
a function of both operands, is harder to find by sampling than a digit to copy.)

One step (Shao et al. 2024, GRPO; the ratio against the sampler's log-probabilities, as verl and
slime compute it):
  1. sample `group` completions of each of `prompts` prompts with the engine (temperature 1),
     each with its log-probability as the engine computed it (SamplingParams.logprobs) and the
     experts every MoE layer chose for its tokens (the scheduler's record_routing);
  2. reward each, and normalise within its group: advantage = (r − mean) / (std + 1e-4);
  3. score the same tokens with the trainer's forward (train/logprobs.py: autograd, the training
     kernels) and print how far they are from the engine's: the largest |difference| and the
     (token, layer) routing decisions that differ;
  4. the clipped surrogate: ratio = exp(trainer − sampler), loss = −mean over tokens of
     min(ratio · A, clip(ratio, 1 ± 0.2) · A); one AdamW step;
  5. the new weights into the engine in place (`DecodeEngine.load_weights`, which also empties
     its prefix cache).
No KL penalty and no reference model (DAPO drops them too); one optimizer step per batch, so the
ratio is the trainer/sampler mismatch alone and the clip guards against it.

What holds on CPU in fp32: by default the trainer's and the engine's log-probabilities differ by
about 1e-6 (at most 6.6e-6 over the default run, growing with the logits) and no routing decision
differs (0 of 712,614): the engine's paged attention and few-token expert kernels sum in other
orders than the training forward. With --batch-invariant both run in that mode
(`ops/invariant.py`) and every difference is exactly 0: the ratio is exactly 1 before the step.

The end-of-document token ends a completion early; the engine reports no log-probability for it
(its token is not part of the completion), so it is not trained on.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from moemesh.config import TrainConfig
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.request import SamplingParams
from moemesh.inference.scheduler import Scheduler
from moemesh.models import ModelConfig, build
from moemesh.train.logprobs import completion_logprobs
from moemesh.train.optim import build_optimizer

CLIP = 0.2  # PPO's clip range of the importance ratio


class CharTokenizer:
    """One token a character of "0123456789+=", after the end-of-document token 0."""

    chars = "0123456789+="
    vocab_size = len(chars) + 1
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return [self.chars.index(c) + 1 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i - 1] for i in ids if 0 < i < self.vocab_size)


def task(rng: random.Random) -> tuple[str, str]:
    """(prompt, answer): "418=", "814"."""
    digits = "".join(str(rng.randrange(10)) for _ in range(3))
    return f"{digits}=", digits[::-1]


def reward(text: str, answer: str) -> float:
    """The share of the answer's characters that the completion has right, position by position."""
    return sum(x == y for x, y in zip(text, answer)) / len(answer)


def model_config() -> ModelConfig:
    return ModelConfig(
        model_type="qwen3_moe",
        vocab_size=CharTokenizer.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=16,
    )


def compare(sequences, scored) -> tuple[float, int, int]:
    """(the largest |engine − trainer| log-probability, the routing decisions that differ, those
    compared): each (token, MoE layer) the engine computed against the trainer's at that position."""
    worst, differ, compared = 0.0, 0, 0
    for sequence, trainer, routing in zip(sequences, scored.logprobs, scored.routing):
        engine = torch.tensor([p.logprob for p in sequence.logprobs])
        if len(engine):
            worst = max(worst, float((engine - trainer.detach()).abs().max()))
        for position, chosen in sequence.routing.items():
            differ += int((chosen != routing[position]).any(dim=-1).sum())
            compared += chosen.shape[0]
    return worst, differ, compared


def run(
    steps: int = 400,
    prompts: int = 16,
    group: int = 8,
    lr: float = 1e-3,
    seed: int = 0,
    say=print,
    batch_invariant: bool = False,
) -> list[dict]:
    """The loop; returns each step's record (and `say`s one line a step)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = CharTokenizer()
    policy = build(model_config(), seed=seed)  # the trainer's model, trained in place
    engine = DecodeEngine(
        build(model_config(), seed=seed).eval(),
        max_batch=prompts * group,
        max_len=16,
        block_size=4,
        batch_invariant=batch_invariant,
    )
    scheduler = Scheduler(engine, tokenizer, max_waiting=prompts * group, record_routing=True)
    optimizer = build_optimizer(policy, TrainConfig(lr=lr, weight_decay=0.0))
    records = []
    for step in range(steps):
        start = time.perf_counter()
        # 1. sample
        questions = [task(rng) for _ in range(prompts)]
        sequences = [
            scheduler.submit(
                [tokenizer.eos_id, *tokenizer.encode(prompt)],
                SamplingParams(max_tokens=3, temperature=1.0, seed=rng.randrange(2**31), logprobs=0),
            )
            for prompt, _ in questions
            for _ in range(group)
        ]
        scheduler.run_until_idle()
        # 2. rewards, normalised within each group
        rewards = torch.tensor([reward(s.text, questions[i // group][1]) for i, s in enumerate(sequences)])
        grouped = rewards.view(prompts, group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
        # 3. the trainer's log-probabilities of the same tokens, against the engine's
        scored = completion_logprobs(
            policy,
            [s.prompt_ids for s in sequences],
            [s.token_ids for s in sequences],
            1.0,
            routing=True,
            batch_invariant=batch_invariant,
        )
        worst, differ, compared = compare(sequences, scored)
        # 4. the clipped surrogate, averaged over every completion token of the batch
        terms = []
        for sequence, trainer, advantage in zip(sequences, scored.logprobs, advantages):
            sampler = torch.tensor([p.logprob for p in sequence.logprobs])
            ratio = torch.exp(trainer - sampler)
            terms.append(torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP, 1 + CLIP) * advantage))
        loss = -torch.cat(terms).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # 5. the new weights into the engine
        engine.load_weights(policy)
        record = {
            "step": step + 1,
            "reward": float(rewards.mean()),
            "max_logprob_diff": worst,
            "routing_differ": differ,
            "routing_compared": compared,
            "seconds": time.perf_counter() - start,
        }
        records.append(record)
        say(
            f"step {step + 1:4d}  reward {record['reward']:.3f}  max|sampler-trainer| logprob {worst:.2e}  "
            f"routing differs {differ}/{compared}  {record['seconds']:.2f}s"
        )
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--prompts", type=int, default=16, help="prompts a step")
    parser.add_argument("--group", type=int, default=8, help="completions sampled per prompt")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batch-invariant", action="store_true", help="sample and score in batch-invariant mode: differences 0"
    )
    args = parser.parse_args(argv)
    records = run(args.steps, args.prompts, args.group, args.lr, args.seed, batch_invariant=args.batch_invariant)
    tenth = max(1, len(records) // 10)
    first = sum(r["reward"] for r in records[:tenth]) / tenth
    last = sum(r["reward"] for r in records[-tenth:]) / tenth
    print(f"mean reward: first {tenth} steps {first:.3f}, last {tenth} steps {last:.3f}")


if __name__ == "__main__":
    main()
