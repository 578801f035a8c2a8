"""The documentation a user reads: the generated command-line reference is current and lists every flag `--help`
prints, the README stays a short entry point, and the release files exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from paradraft.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_the_cli_reference_is_generated_from_the_configs_and_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_cli_docs.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_help_prints_is_in_the_reference(command):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    flags = {s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    page = (ROOT / "docs" / "reference" / "cli" / f"{command}.md").read_text()
    missing = sorted(f for f in flags if f"`{f}`" not in page)
    assert not missing, f"{command}: flags missing from docs/reference/cli/{command}.md: {missing}"


def test_the_readme_is_an_entry_point():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for needed in ("make demo", "make test", "vllm serve", "LLM(", "pip install"):
        assert needed in text, needed
    assert not [c for c in re.findall(r"^\|.*\|$", text, re.M) if len(c) > 400]  # no table cell runs on


def test_release_files_exist():
    for name in ("LICENSE", "CHANGELOG.md", "CITATION.cff"):
        assert (ROOT / name).is_file(), name
    from paradraft import __version__

    assert f"## {__version__} " in (ROOT / "CHANGELOG.md").read_text()
    assert f"version: {__version__}" in (ROOT / "CITATION.cff").read_text()
