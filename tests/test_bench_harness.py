"""bench/harness.py's results file: `record` writes a row a figure into $MOEMESH_RESULTS (made with its
header if missing), a row of the same figure, at, peer and device replacing the older one in place;
the command that ran, today's date and the commit filled in; only rank 0 writing."""

import csv
import datetime
import re
import subprocess
import sys

import pytest

from bench import harness

HEADER = "figure,at,value,unit,peer,peer_value,device,command,date,commit"


@pytest.fixture
def results(tmp_path, monkeypatch):
    path = tmp_path / "benchmarks" / "results.csv"  # its folder too is missing
    monkeypatch.setenv("MOEMESH_RESULTS", str(path))
    monkeypatch.setattr(sys, "argv", [str(harness.ROOT / "bench" / "serve" / "decode.py"), "--layers", "48"])
    return path


def rows(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_record_writes_the_header_and_replaces_a_row_of_the_same_key(results):
    harness.record("decode ms/token", "batch=1;layers=48", 3.61, "ms", "transformers", 61.38)
    harness.record("decode ms/token", {"layers": 48, "batch": 64}, 18.68, "ms")  # another at: a row of its own
    harness.record("decode ms/token", "batch=1;layers=48", 2.894, "ms", "transformers", 60.0)  # replaces the first

    assert results.read_text().splitlines()[0] == HEADER
    written = rows(results)
    assert [(r["at"], r["value"], r["peer"], r["peer_value"]) for r in written] == [
        ("batch=1;layers=48", "2.894", "transformers", "60"),
        ("batch=64;layers=48", "18.68", "", ""),
    ]
    first = written[0]
    assert first["figure"] == "decode ms/token" and first["unit"] == "ms"
    assert first["command"] == "python3 bench/serve/decode.py --layers 48"
    assert first["date"] == datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=harness.ROOT, capture_output=True, text=True)
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/benchmarks/results.csv"],
        cwd=harness.ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    commit = head.stdout.strip() + ("-dirty" if changed else "") if head.returncode == 0 else "unknown"
    assert first["commit"] == commit  # a figure of uncommitted code says so
    assert re.fullmatch(r"[0-9a-f]{4,}(-dirty)?|unknown", first["commit"])
    assert first["device"] == harness.results_device()


def test_another_peer_or_device_is_another_row_and_a_command_can_be_given(results):
    harness.record("serve tokens/s", "clients=64;layers=48", 2648.4, "tokens/s", "engine alone", 2836.0)
    harness.record("serve tokens/s", "clients=64;layers=48", 2700.0, "tokens/s", command="python3 bench/x.py")
    written = rows(results)
    assert [(r["peer"], r["value"]) for r in written] == [("engine alone", "2648"), ("", "2700")]
    assert written[1]["command"] == "python3 bench/x.py"


def test_under_torchrun_the_command_says_so_and_only_rank_0_writes(results, monkeypatch):
    monkeypatch.setattr(harness, "WORLD", 4)
    monkeypatch.setattr(harness, "RANK", 1)
    assert harness.record("train tokens/s per GPU", "gpus=4;layers=6;layout=ep", 70934.0, "tokens/s") is None
    assert not results.exists()
    monkeypatch.setattr(harness, "RANK", 0)
    row = harness.record("train tokens/s per GPU", "gpus=4;layers=6;layout=ep", 70934.0, "tokens/s")
    assert row["command"] == "torchrun --nproc-per-node 4 bench/serve/decode.py --layers 48"
    assert rows(results) == [row]


def test_a_peer_goes_with_its_value(results):
    with pytest.raises(ValueError, match="peer"):
        harness.record("decode ms/token", "batch=1", 1.0, "ms", "transformers")
    with pytest.raises(ValueError, match="peer"):
        harness.record("decode ms/token", "batch=1", 1.0, "ms", peer_value=2.0)
    assert not results.exists()


def test_a_file_of_another_header_is_left_alone(results):
    results.parent.mkdir(parents=True)
    results.write_text("figure,value\nx,1\n")
    with pytest.raises(SystemExit, match="header"):
        harness.record("decode ms/token", "batch=1", 1.0, "ms")
    assert results.read_text() == "figure,value\nx,1\n"
