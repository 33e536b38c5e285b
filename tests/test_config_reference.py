"""docs/config.md is generated from the config dataclasses' own comments (docs/config_reference.py):
every key of every section has a description, the page lists every key the config accepts, and
the committed page is the one the code makes today."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moemesh.config import _all_keys

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
import config_reference  # noqa: E402


def test_every_key_has_a_description():
    undescribed = [key.name for key in config_reference.keys() if not key.description]
    assert not undescribed, f"give these fields a comment in their dataclass: {undescribed}"


def test_the_page_lists_exactly_the_keys_the_config_accepts():
    assert sorted(key.name for key in config_reference.keys()) == sorted(_all_keys())


def test_descriptions_come_from_the_comment_on_or_above_a_field():
    class Example:
        plain: int = 1  # on its line
        # above it,
        # on two lines
        above: str = "x"
        # ---- a section's title is no description ----
        bare: bool = False
        wrapped: list[int] = [  # its first line's
            1,
        ]

    assert config_reference.described_fields(Example) == {
        "plain": "on its line",
        "above": "above it, on two lines",
        "bare": "",
        "wrapped": "its first line's",
    }


def test_the_committed_page_is_the_codes(capsys):
    code = config_reference.main(["--check"])
    if code:
        pytest.fail(capsys.readouterr().err)
