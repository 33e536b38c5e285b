"""The README's and the docs pages' commands as a newcomer runs them: their ```bash blocks, in order,
in the one working directory of a fresh clone. The LoRA recipe once could not follow the quick
start: without `--config` it trained into configs/tiny.toml's runs/tiny, the quick start's (refused,
and the refusal's way out, train.overwrite=true, deletes the quick start's model), then converted
runs/default, which no command wrote.

- Every block of README.md and docs/*.md (but the archive of dated benchmarks), the GPU ones
  included, is read without running it: every `moemesh ...` command parses with the real argument
  parser (`moemesh.cli._parser`, what `main` parses with), its `--set` keys are config keys and its
  `--config` files exist; a command that trains must write into a run directory that no earlier
  command of its page wrote (unless it resumes or overwrites by name), and every `runs/...`
  directory a command reads (a checkpoint, an adapter, what `convert` converts) must have been
  written by an earlier one. A docs page is read after the README's quick start (its runs/tiny),
  unless it runs the quick start itself.
- The quick start's `moemesh train` (the README's) and then the LoRA recipe's block (wherever it
  lives) run for real, in one directory.
- The README stays a front page (at most 200 lines), and every relative link of README.md and
  docs/*.md points at a file that exists, and at a heading of it when it names one.

`moemesh` is the console script `moemesh.cli:main` (pyproject.toml's [project.scripts]): the
commands run through that function, in this process, with the words the pages give them, so that
they run the checkout under test whatever `moemesh` a PATH holds."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import os
import re
import shlex
import textwrap
import tomllib
from pathlib import Path

import pytest

from moemesh.cli import _parser, main
from moemesh.config import DEFAULT_CONFIG, TrainConfig, _all_keys

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ARCHIVE = DOCS / "benchmarks-archive.md"  # the dated history, kept as it was written
PAGES = [README, *sorted(page for page in DOCS.glob("*.md") if page != ARCHIVE)]
SERVING = DOCS / "serving.md"


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def commands(block: str) -> list[list[str]]:
    """A block's commands, each a list of words: lines continued by a backslash joined, comments
    dropped, `a && b` split."""
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            end = words.index("&&") if "&&" in words else len(words)
            found.append(words[:end])
            words = words[end + 1 :]
    return [command for command in found if command]


def moemesh_args(command: list[str]) -> list[str] | None:
    """The words after `moemesh` (`moemesh ...`, `python -m moemesh ...`, `torchrun ... -m moemesh
    ...`), or None for another command."""
    for i, word in enumerate(command):
        if word == "moemesh" and (i == 0 or command[i - 1] == "-m"):
            return command[i + 1 :]
    return None


def parsed(args: list[str]) -> argparse.Namespace | str:
    """`moemesh ARGS` as `main` parses it (nothing runs), or argparse's one line of complaint."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return _parser().parse_args(args)
    except SystemExit:
        return err.getvalue().strip() or "does not parse"


def overrides(namespace: argparse.Namespace) -> dict[str, str]:
    """A command's `--set KEY=VALUE` words as {KEY: VALUE}."""
    items = [item for group in getattr(namespace, "overrides", []) for item in group]
    return dict(item.partition("=")[::2] for item in items)


def run_directory(config: str | None, settings: dict[str, str]) -> str:
    """Where `moemesh train` writes: train.run_dir as set, else its config file's, else the default."""
    if "train.run_dir" in settings:
        return settings["train.run_dir"]
    path = ROOT / config if config else DEFAULT_CONFIG
    return tomllib.loads(path.read_text()).get("train", {}).get("run_dir", TrainConfig.run_dir)


def run_directory_mistakes(blocks: list[str]) -> tuple[list[str], int]:
    """What goes wrong with run directories when `blocks` run in order (a command that does not
    parse is a mistake too), and how many moemesh commands were read."""
    written: set[str] = set()
    mistakes, read = [], 0
    for block in blocks:
        for command in commands(block):
            args = moemesh_args(command)
            if args is None:
                continue
            read += 1
            said = shlex.join(command)
            namespace = parsed(args)
            if isinstance(namespace, str):
                mistakes.append(f"{said}: {namespace}")
                continue
            settings = overrides(namespace)
            sources = [getattr(namespace, "checkpoint", None), getattr(namespace, "adapter", None)]
            sources += [settings.get("train.init_from"), settings.get("lora.init_from")]
            target = None
            if namespace.command == "train":
                target = run_directory(namespace.config, settings)
                if "true" in (settings.get("train.resume"), settings.get("train.overwrite")):
                    written.discard(os.path.normpath(target))  # continued or replaced, as asked
            elif namespace.command == "convert":
                sources.append(namespace.source)
                target = namespace.target
            for source in sources:
                if source and source.startswith("runs/") and os.path.normpath(source) not in written:
                    mistakes.append(f"{said}: reads {source}, which no earlier command wrote")
            if target is not None and os.path.normpath(target) in written:
                mistakes.append(f"{said}: writes into {target}, which an earlier command wrote")
            if target is not None:
                written.add(os.path.normpath(target))
    return mistakes, read


def quick_start() -> str:
    """The README's first bash block: the install and `moemesh train`."""
    return bash_blocks(README.read_text())[0]


def page_blocks(page: Path) -> list[str]:
    """A page's bash blocks as a reader runs them: a docs page after the README's quick start,
    unless it holds the quick start itself."""
    blocks = bash_blocks(page.read_text())
    if page == README or quick_start() in blocks:
        return blocks
    return [quick_start(), *blocks]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_each_command_writes_its_own_run_directory_and_reads_what_ran_before(page):
    mistakes, _ = run_directory_mistakes(page_blocks(page))
    assert mistakes == []


def test_the_commands_of_the_pages_were_read():
    """Not skipped: every page's moemesh commands count (the quick start's once)."""
    read = {page: run_directory_mistakes(bash_blocks(page.read_text()))[1] for page in PAGES}
    assert read[README] >= 2 and sum(read.values()) >= 35, read
    for name in ("training", "parallel", "fine-tuning", "serving", "checkpoints"):
        assert read[DOCS / f"{name}.md"] >= 3, name


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_moemesh_command_parses_with_known_keys_and_existing_configs(page):
    """Each `moemesh ...` of a bash block, through the real parser (a synopsis such as `moemesh
    train [--config FILE]` belongs in a ```text block): its `--set` keys are config keys (a typo
    would stop the run with exit code 2), and the config files it names exist."""
    keys = set(_all_keys())
    wrong = []
    for block in bash_blocks(page.read_text()):
        for command in commands(block):
            args = moemesh_args(command)
            if args is None:
                continue
            namespace = parsed(args)
            if isinstance(namespace, str):
                wrong.append(f"{shlex.join(command)}: {namespace}")
                continue
            unknown = [key for key in overrides(namespace) if key not in keys]
            if unknown:
                close = [difflib.get_close_matches(key, keys, n=1) for key in unknown]
                wrong.append(f"{shlex.join(command)}: unknown keys {unknown} (closest {close})")
            config = getattr(namespace, "config", None)
            if config and not (ROOT / config).is_file():
                wrong.append(f"{shlex.join(command)}: {config} does not exist")
    assert wrong == []


def test_the_check_finds_what_the_lora_recipe_did_wrong():
    """The quick start and the LoRA recipe as the README gave them before issue 47."""
    before = textwrap.dedent(
        """\
        ```bash
        python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && moemesh train
        ```
        ```bash
        moemesh train --set train.init_from=/models/Qwen3-30B-A3B data.path=my.jsonl train.lr=1e-4 \\
            lora.rank=16 lora.alpha=32 train.activation_checkpointing=full train.cuda_graphs=true \\
            train.global_batch=1 train.micro_batch=1 train.seq_len=4096
        moemesh convert runs/default runs/my-adapter                     # a PEFT adapter directory
        ```
        """
    )
    mistakes, read = run_directory_mistakes(bash_blocks(before))
    assert read == 3
    assert [m.split(": ", 1)[1] for m in mistakes] == [
        "writes into runs/tiny, which an earlier command wrote",
        "reads runs/default, which no earlier command wrote",
    ]


def test_the_check_finds_a_command_that_does_not_parse():
    mistakes, read = run_directory_mistakes(["moemesh generate --checkpoint runs/tiny --temprature 0.7\n"])
    assert read == 1 and len(mistakes) == 1 and "--temprature" in mistakes[0], mistakes


def test_the_serving_section_says_how_to_get_its_client():
    """`serve` answers the `openai` client, which `pip install -e '.[serve]'` does not bring: the
    paragraph that says the client works says how to get it, and names what `[serve]` brings."""
    [serving] = [part for part in SERVING.read_text().split("\n\n") if part.startswith("`moemesh serve` (")]
    assert "`openai` client" in serving
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    assert "openai" in extra or re.search(r"`pip install [^`]*\bopenai\b[^`]*`", serving)
    assert "pip install -e '.[serve]'" in serving
    assert [package for package in extra if package.lower() not in serving.lower()] == []


def section(text: str, title: str) -> str:
    return next(part for part in text.split("\n## ") if part.startswith(title))


@pytest.mark.parametrize("page", [README, DOCS / "getting-started.md"], ids=page_id)
def test_the_quick_start_and_its_config_give_the_same_measured_figures(page):
    """How long the quick start takes and where its validation loss ends, as the README's quick
    start (and Getting started) and configs/tiny.toml's header give them: ranges, with the days
    they were measured, the same in both (they had drifted apart: "about two minutes" against "3–7
    minutes", and "about 2.05" where 2.01 was measured)."""
    text = page.read_text()
    said = " ".join((section(text, "Quick start") if page == README else text).split())
    header = " ".join(line.removeprefix("#") for line in DEFAULT_CONFIG.read_text().splitlines() if line[:1] == "#")
    header = " ".join(header.split())
    for pattern in (r"(\d[\d.]*–\d[\d.]*) minutes on two CPU cores", r"to (?:a validation loss of )?(\d\.\d+–\d\.\d+)"):
        found = [re.search(pattern, text) for text in (said, header)]
        assert all(found) and found[0][1] == found[1][1], pattern
    for day in ("2026-11-27", "2026-12-01"):
        assert day in said and day in header, day


def test_the_lora_recipe_runs_after_the_quick_start(tmp_path, monkeypatch, capsys):
    """The quick start's `moemesh train`, then the LoRA recipe's block, in one directory. What the
    pages leave to the reader is the test's own: the model directory (a tiny Qwen3-MoE that
    transformers makes, random weights, nothing downloaded, with 4,096 positions for the recipe's
    train.seq_len=4096) and the data (my.jsonl, written here); the one GPU-only setting, which the
    page names as such (train.cuda_graphs: "It takes one GPU"), is turned off.

    Both runs are shortened, by a `--set train.steps=N` of their own after the pages' words, so
    that the test takes seconds: the quick start to 1 step, the recipe to 2. The collision cannot
    hide behind that: the quick start's run directory is its config's (the override leaves it),
    and a run of one step leaves checkpoints there as one of 300 does (step_1 rather than step_100
    to step_300), which is all it takes for a later run into that directory to be refused. The
    quick start's checkpoint is still there at the end."""
    transformers = pytest.importorskip("transformers")
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"] == {"moemesh": "moemesh.cli:main"}
    [recipe] = [block for page in PAGES for block in bash_blocks(page.read_text()) if "lora.rank=" in block]
    base = tmp_path / "base"  # stands for /models/Qwen3-30B-A3B
    substitutes = {"/models/Qwen3-30B-A3B": str(base), "train.cuda_graphs=true": "train.cuda_graphs=false"}
    assert all(word in recipe for word in substitutes)

    config = transformers.Qwen3MoeConfig(
        vocab_size=256,  # the byte tokenizer's: the directory has no tokenizer.json
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    )
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(base)
    monkeypatch.chdir(tmp_path)
    documents = [Path(module.__file__).read_text() for module in (argparse, difflib, textwrap)]
    Path("my.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))  # ~220 kB

    [train] = [moemesh_args(command) for command in commands(quick_start()) if moemesh_args(command)]
    assert main([*train, "--set", "train.steps=1"]) == 0
    quick_start_checkpoint = tmp_path / "runs" / "tiny" / "checkpoints" / "step_1"
    assert quick_start_checkpoint.is_dir()

    for word, substitute in substitutes.items():
        recipe = recipe.replace(word, substitute)
    steps = [moemesh_args(command) for command in commands(recipe)]
    assert [args[0] for args in steps] == ["train", "convert", "convert", "generate"]
    capsys.readouterr()
    for args in steps:
        assert main([*args, "--set", "train.steps=2"] if args[0] == "train" else args) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        if args[0] == "train":
            assert "\nlora    rank 16 adapters on 8 projections (q_proj, k_proj, v_proj, o_proj) and 4 expert" in out
    assert out.startswith("...") and len(out) > len("...\n")  # generate: the prompt and its continuation
    assert (tmp_path / "runs" / "my-adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "runs" / "merged" / "config.json").is_file()
    assert sorted(p.name for p in quick_start_checkpoint.parent.iterdir()) == ["step_1"]


def test_ci_runs_the_quick_start_install_as_the_readme_writes_it():
    """.ci/run runs .ci/quickstart, which takes the install from the README's first bash block and
    installs nothing of its own; that block installs the CPU build of torch by its version, then
    the package with no extra, then runs `moemesh train`; the README's `moemesh generate` from
    runs/tiny, which .ci/quickstart runs word for word, is there; and the package itself needs no
    triton (the CPU build of torch brings none: its stand-in must do)."""
    ci = (ROOT / ".ci" / "run").read_text()
    quickstart = (ROOT / ".ci" / "quickstart").read_text()
    assert re.search(r"^\.ci/quickstart$", ci, re.M)
    assert ci.index(".ci/quickstart") < ci.index("python -m pytest")
    assert "pip install" not in "".join(line for line in quickstart.splitlines(True) if not line.startswith("#"))
    blocks = bash_blocks(README.read_text())
    first = blocks[0].strip()
    assert re.fullmatch(
        r"python3 -m venv \.venv && \. \.venv/bin/activate && pip install torch==[\d.]+ && pip install -e \. && "
        r"moemesh train",
        first,
    ), first
    lines = "".join(blocks).splitlines()
    assert [line for line in lines if line.startswith("moemesh generate --checkpoint runs/tiny ")]
    tests = r"python3 -m venv \.venv && .* && pip install -e '\.\[test\]' && python -m pytest -q"
    assert [line for line in lines if re.fullmatch(tests, line)]
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in dependencies if re.match(r"triton|pytest|transformers", d)]


def test_the_serve_extra_brings_every_package_the_server_imports():
    """`pip install -e '.[serve]'` is the server's install: every package outside the standard
    library and the base dependencies that moemesh/inference imports is in that extra
    (llguidance was not: response_format's JSON schemas were a 400 after the documented install)."""
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {re.match(r"[\w-]+", d)[0] for d in project["dependencies"]}
    imported = set()
    for file in (ROOT / "moemesh" / "inference").glob("*.py"):
        imported |= set(re.findall(r"^\s*(?:import|from) (\w+)", file.read_text(), re.M))
    outside = imported - set(sys.stdlib_module_names) - base - {"moemesh", "__future__"}
    brought = {"starlette"}  # fastapi's own requirement, imported for its types
    assert outside and outside - brought <= set(project["optional-dependencies"]["serve"]), outside


def test_the_readme_is_a_front_page():
    """The README says what moemesh is, how to start and where to go; the rest lives in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, len(lines)


def unfenced(text: str) -> str:
    """Markdown without its fenced code blocks (a `# comment` line there is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """Markdown without its code: fenced blocks and inline code spans blanked."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them (and mkdocs, for these headings:
    `mkdocs build --strict` checks its own)."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*$", unfenced(page.read_text()).replace("`", ""), re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_every_relative_link_points_at_a_file_and_heading_that_exist():
    """A link (or image) of README.md or a docs page that is not a URL resolves from its page to a
    file of the checkout, and its #anchor, if any, to a heading of that page."""
    broken = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        text = prose(page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page_id(page)}: {target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page_id(page)}: {target}: no such heading")
    assert broken == []
