"""Batched generation (fp32, CPU): many prompts of different lengths and settings decoded
together by the engine and the scheduler give, greedy, exactly the tokens of each prompt alone
and of the no-cache reference (the whole sequence recomputed for every token); each request
stops at its own end-of-document token, max_tokens, stop strings or the end of the context;
seeded sampling does not depend on the batch; the streamed pieces add up to the text.

Exact token equality is safe here: random weights with a wide initialisation keep the top two
logits far apart compared with the ~1e-6 by which cached and recomputed logits differ."""

import threading
import time

import pytest
import torch

from moemesh.data.tokenizer import ByteTokenizer
from moemesh.errors import DataError, RequestError
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.generate import generate, read_prompts
from moemesh.inference.request import SamplingParams, prompt_ids
from moemesh.inference.scheduler import QueueFull, Round, Scheduler
from moemesh.models import build
from test_models_decoding import FAMILIES

TOKENIZER = ByteTokenizer()
PROMPTS = [[0, 100, 101, 102], [0], [0, *range(40, 49)], [0, 7, 8], [0, 200, 201, 202, 203, 204], [0, 33]]
MAX_TOKENS = [12, 5, 9, 14, 3, 10]


def reference(model, prompt: list[int], max_tokens: int, eos_id: int = 0) -> list[int]:
    """Greedy by recomputing the whole sequence for each new token (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < max_tokens:
            token = int(model(torch.tensor([ids], device=next(model.parameters()).device)).logits[0, -1].argmax())
            if token == eos_id:
                break
            ids.append(token)
    return ids[len(prompt) :]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "gemma4_k_eq_v"])
def test_batched_greedy_equals_each_prompt_alone(family):
    config = FAMILIES[family]
    model = build(config.replace(vocab_size=256, max_position_embeddings=64), seed=5).eval()
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    # 3 rows for 6 prompts: requests join as others finish (continuous batching)
    engine = DecodeEngine(model, max_batch=3, max_len=32)
    engine.warm_up()  # steps of padding rows first, as `moemesh serve` starts: they must change nothing
    batched = generate(engine, TOKENIZER, PROMPTS, params)
    for prompt, n, result in zip(PROMPTS, MAX_TOKENS, batched):
        alone = generate(
            DecodeEngine(model, max_batch=1, max_len=32), TOKENIZER, [prompt], SamplingParams(max_tokens=n)
        )
        expected = reference(model, prompt, n)
        assert result.token_ids == alone[0].token_ids == expected
        assert result.finish_reason == ("length" if len(expected) == n else "stop")
        assert result.text == TOKENIZER.decode(expected)


@pytest.fixture(scope="module")
def model():
    return build(FAMILIES["qwen3_moe"].replace(max_position_embeddings=64), seed=5).eval()


def test_stop_strings_end_requests_at_their_first_occurrence(model):
    engine = DecodeEngine(model, max_batch=4, max_len=64)
    free = generate(engine, TOKENIZER, ["ab"], SamplingParams(max_tokens=40))[0].text
    stop = free[10:12]
    cut = free[: free.index(stop)]
    stopped = generate(
        engine,
        TOKENIZER,
        ["ab", "ab"],
        [SamplingParams(max_tokens=40, stop=(stop,)), SamplingParams(max_tokens=40, stop=("\x00never",))],
    )
    assert stopped[0].text == cut and stopped[0].finish_reason == "stop"
    assert stopped[1].text == free and stopped[1].finish_reason == "length"


def test_a_request_stops_at_the_end_of_the_context(model):
    engine = DecodeEngine(model, max_batch=2, max_len=16)
    result = generate(engine, TOKENIZER, [[0, 1, 2, 3, 4, 5]], SamplingParams(max_tokens=100))[0]
    assert len(result.token_ids) == 16 - 6 and result.finish_reason == "length"
    with pytest.raises(RequestError, match="the prompt has 16 tokens; the context holds 16"):
        generate(engine, TOKENIZER, [list(range(16))], SamplingParams())


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    engine = DecodeEngine(model, max_batch=4, max_len=64)
    params = SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=11)
    alone = generate(engine, TOKENIZER, ["xy"], params)[0].token_ids
    together = generate(
        engine,
        TOKENIZER,
        ["q", "xy", "long prompt"],
        [SamplingParams(max_tokens=7, temperature=0.5, seed=1), params, SamplingParams(max_tokens=20)],
    )
    assert together[1].token_ids == alone
    assert (
        generate(engine, TOKENIZER, ["xy"], SamplingParams(max_tokens=15, temperature=1.0, seed=12))[0].token_ids
        != alone
    )


def test_streamed_pieces_add_up_to_the_text_and_hold_back_a_possible_stop(model):
    engine = DecodeEngine(model, max_batch=2, max_len=64)
    free = generate(engine, TOKENIZER, ["ab"], SamplingParams(max_tokens=30))[0].text
    stop = free[20:23]
    pieces = []
    scheduler = Scheduler(engine, TOKENIZER)
    sequence = scheduler.submit(
        prompt_ids(TOKENIZER, "ab"),
        SamplingParams(max_tokens=30, stop=(stop,)),
        on_update=lambda s, text: pieces.append((text, s.finish_reason)),
    )
    scheduler.run_until_idle()
    assert "".join(text for text, _ in pieces) == sequence.text == free[: free.index(stop)]
    assert pieces[-1][1] == "stop" and all(reason is None for _, reason in pieces[:-1])


def test_the_queue_is_bounded_and_a_cancelled_request_gives_its_row_back(model):
    engine = DecodeEngine(model, max_batch=1, max_len=64)
    scheduler = Scheduler(engine, TOKENIZER, max_waiting=2)
    first = scheduler.submit([0, 1], SamplingParams(max_tokens=50))
    scheduler.submit([0, 2], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull, match="2 requests are waiting already"):
        scheduler.submit([0, 3], SamplingParams())
    scheduler.step()  # the first takes the one row
    assert first.row == 0 and len(scheduler.waiting) == 1
    first.cancelled = True
    scheduler.run_until_idle()
    assert first.finish_reason == "cancelled" and len(first.token_ids) < 50
    assert scheduler.free_rows == [0] and not scheduler.running and not scheduler.waiting


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
        (SamplingParams(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (SamplingParams(temperature=-1), "temperature must be a finite number >= 0"),
        (SamplingParams(top_p=0), r"top_p must be in \(0, 1\]"),
        (SamplingParams(stop=("",)), "stop must be non-empty strings"),
    ],
)
def test_bad_settings_are_named(model, params, message):
    with pytest.raises(RequestError, match=message):
        generate(DecodeEngine(model, max_batch=1, max_len=8), TOKENIZER, ["x"], params)


def test_prompts_files(tmp_path):
    """Every line of a text file is a prompt, as written, numbered as editors number lines: an
    empty line and one of spaces too (they once vanished, and the outputs no longer matched the
    lines), a form feed inside a line (a line break to str.splitlines), a CRLF file's lines. A
    .jsonl file's blank lines hold no object."""
    defaults = SamplingParams(max_tokens=5)
    (tmp_path / "p.txt").write_bytes(b"first\n\n   \n{not json}\nclass A:\x0c pass\r\n")
    assert read_prompts(tmp_path / "p.txt", defaults) == [
        (1, "first", defaults),
        (2, "", defaults),
        (3, "   ", defaults),
        (4, "{not json}", defaults),
        (5, "class A:\x0c pass", defaults),
    ]
    (tmp_path / "one.txt").write_text("\n")  # one empty line: one empty prompt
    assert read_prompts(tmp_path / "one.txt", defaults) == [(1, "", defaults)]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b", "temperature": 0.5, "stop": "x"}\n')
    assert read_prompts(tmp_path / "p.jsonl", defaults) == [
        (1, "a", defaults),
        (3, "b", SamplingParams(max_tokens=5, temperature=0.5, stop=("x",))),
    ]
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="has no prompt"):
        read_prompts(tmp_path / "empty.txt", defaults)
    for line, message in [
        ("{oops", "line 1 column 2: invalid JSON: Expecting property name enclosed in double quotes at column 2"),
        ('{"text": "a"}', "line 1: expected an object"),
        ('{"prompt": "a", "temp": 1}', "line 1: unknown field 'temp'"),
        ('{"prompt": "a", "top_p": 2}', r"line 1: top_p must be in \(0, 1\]"),
        ('{"prompt": "a", "stop": 5}', "line 1: stop must be non-empty strings"),
    ]:
        (tmp_path / "bad.jsonl").write_text(line + "\n")
        with pytest.raises(DataError, match=message):
            read_prompts(tmp_path / "bad.jsonl", defaults)


def serve_until_finished(scheduler: Scheduler, sequence, timeout_s: float = 30.0) -> None:
    """`serve_forever` on its own thread until `sequence` has finished (or timeout_s), then closed."""
    worker = threading.Thread(target=scheduler.serve_forever)
    worker.start()
    deadline = time.monotonic() + timeout_s
    while sequence.finish_reason is None and time.monotonic() < deadline:
        time.sleep(0.01)
    scheduler.close()
    worker.join()


@pytest.mark.parametrize("window_s, reply_after_s", [(1.0, 0.03), (0.0, 0.03), (0.3, None)])
def test_the_reply_window_holds_the_next_round_for_the_clients_that_finished(model, window_s, reply_after_s):
    """Short requests finish beside a long one; the client of the first sends its next request
    `reply_after_s` later (None: never). With a window, the next round waits for it (and no
    longer), so the reply is in the round right after the finish; without one, rounds go on
    meanwhile. With nobody replying, the next round starts when the window has passed, and the
    next finishing round does not wait again (a missed window skips the next one)."""
    engine = DecodeEngine(model, max_batch=3, max_len=64)
    engine.warm_up()  # on a GPU: no graph captured inside the timed rounds (they would outlast windows)
    scheduler = Scheduler(engine, TOKENIZER, reply_window_s=window_s)
    rounds, step = [], scheduler.step
    scheduler.step = lambda: rounds.append(time.monotonic()) or step()
    finishes, replies = [], []

    def finished(sequence, text):
        if sequence.finish_reason is not None:
            finishes.append(len(rounds))  # the next round's index
            if reply_after_s is not None and len(finishes) == 1:
                reply = ([0, 9], SamplingParams(max_tokens=1), lambda s, t: replies.append(len(rounds)))
                threading.Timer(reply_after_s, scheduler.submit, reply).start()

    long = scheduler.submit([0, 1], SamplingParams(max_tokens=60))
    scheduler.submit([0, 2], SamplingParams(max_tokens=2), finished)
    scheduler.submit([0, 3], SamplingParams(max_tokens=6), finished)
    serve_until_finished(scheduler, long)
    assert long.finish_reason == "length" and len(finishes) == 2

    def waited(finish: int) -> float:  # from the finishing round's start to the next one's
        return rounds[finish] - rounds[finish - 1]

    if reply_after_s is None:
        assert waited(finishes[0]) >= window_s and waited(finishes[1]) < window_s
        assert scheduler.reply_windows["missed"] == 1 and scheduler.reply_windows["skipped"] >= 1
    elif window_s:  # admitted in the round after the finish; its token read in the round after that
        assert replies[0] == finishes[0] + 2 and reply_after_s <= waited(finishes[0]) < window_s
        assert scheduler.reply_windows["caught"] == 1
    else:
        assert replies[0] > finishes[0] + 2 and not scheduler.reply_windows


def test_a_reply_window_takes_the_launched_round_when_its_step_ends_not_when_the_window_does(model):
    """With overlap a window waits while the next round's step runs; when that step ends (here
    50 ms in, a window of 1 s that no reply ends), its tokens are taken and handed over then."""
    scheduler = Scheduler(DecodeEngine(model, max_batch=1, max_len=64), TOKENIZER, reply_window_s=1.0)

    class Running:  # a launched step that ends 50 ms from now
        end = time.monotonic() + 0.05

        def done(self):
            return time.monotonic() >= self.end

        def tokens(self):
            return []

    scheduler._launched = Round([], [], Running(), needs_host=False)
    handed = []
    start = time.monotonic()
    scheduler._reply_window(scheduler.submitted, 1, lambda: handed.append(time.monotonic() - start))
    assert scheduler._launched is None and len(handed) == 1 and 0.05 <= handed[0] < 0.5
    assert scheduler.reply_windows["missed"] == 1 and time.monotonic() - start >= 1.0


def test_a_round_that_fails_while_admitting_fails_that_request_and_serving_goes_on(model):
    """A round that raises before any request runs (here: admitting the first request, every
    time) fails the request it was admitting, with the error, rather than failing again forever
    with the queue held behind it; the next request is served as usual."""
    engine = DecodeEngine(model, max_batch=2, max_len=64)
    scheduler = Scheduler(engine, TOKENIZER)
    first = scheduler.submit([0, 1], SamplingParams(max_tokens=3))
    second = scheduler.submit([0, 2], SamplingParams(max_tokens=3))
    admit = scheduler._admit

    def admit_but_the_first(budget, whole):
        if scheduler.waiting and scheduler.waiting[0] is first:
            raise RuntimeError("no room for this one")
        return admit(budget, whole)

    scheduler._admit = admit_but_the_first
    serve_until_finished(scheduler, second)
    assert first.finish_reason == "error" and "no room for this one" in first.error
    assert second.finish_reason == "length" and len(second.token_ids) == 3
    assert scheduler.pool.num_free == scheduler.pool.num_blocks - 1  # every block back (the null one aside)
