"""The README and docs/ stay true: links resolve, `pilot-online` commands and flags exist, and
every config key they name is a real key (and every real key is in the configuration page)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from pilot_online.cli.main import build_parser
from pilot_online.engine.config import INJECTED_KEYS, ONLINE_KEYS, PILOT_KEYS
from pilot_online.engine.registry import get_method, list_methods

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
if (REPO / "benchmarks" / "README.md").is_file():
    PAGES.append(REPO / "benchmarks" / "README.md")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)
CODE_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
JSON_KEY = re.compile(r'"([a-z][a-z0-9_]*)"\s*:')
#: Sweep axes that are not config keys (``harness/points.py``: ``variant`` rows, ``fgh.<option>``).
GRID_AXES = {"variant"}


def all_keys() -> set[str]:
    keys = set(PILOT_KEYS) | set(ONLINE_KEYS) | set(INJECTED_KEYS)
    for name in list_methods():
        keys |= set(get_method(name).config_keys)
    return keys


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces
    to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_the_pages_exist_and_the_readme_is_short():
    assert (REPO / "docs").is_dir()
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move reference material to docs/"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page: Path):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(CODE_BLOCK.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and file.suffix == ".md":
            body = CODE_BLOCK.sub("", file.read_text(encoding="utf-8"))
            anchors = {slug(h) for h in HEADING.findall(body)}
            if anchor not in anchors:
                broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page_id(page)}: " + "; ".join(broken)


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def command_lines(text: str) -> list[str]:
    """Every ``pilot-online ...`` invocation in code blocks and inline code, continuation lines
    joined, comments dropped."""
    found = []
    for block in CODE_BLOCK.findall(text):
        block = re.sub(r"\\\n\s*", " ", block)
        for line in block.splitlines():
            line = line.split(" #", 1)[0]
            found += [
                " ".join(m.group(0).split()) for m in re.finditer(r"pilot-online\s+[^;&|]*", line)
            ]
    for span in re.findall(r"`([^`\n]+)`", CODE_BLOCK.sub("", text)):
        found += [m.group(0) for m in re.finditer(r"pilot-online\s+[a-z][^;&|]*", span)]
    return found


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_and_flags_exist(page: Path):
    commands = subparsers(build_parser())
    problems = []
    for line in command_lines(page.read_text(encoding="utf-8")):
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        if len(words) < 2 or not re.fullmatch(r"[a-z][a-z-]*", words[1]):
            continue  # prose such as "pilot-online is a plugin"
        sub = commands.get(words[1])
        if sub is None:
            if words[1] in ("is", "setup's", "and", "to", "command"):
                continue
            problems.append(f"`{line.strip()}`: no subcommand {words[1]!r}")
            continue
        options = {s for a in sub._actions for s in a.option_strings}
        for word in words[2:]:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and flag not in options:
                problems.append(f"`{line.strip()}`: {words[1]} has no option {flag}")
        for i, word in enumerate(words[2:-1], start=2):
            if word in ("--grid", "--set"):
                key = words[i + 1].split("=", 1)[0]
                if key.split(".", 1)[0] not in all_keys() | GRID_AXES | {"fgh"}:
                    problems.append(f"`{line.strip()}`: {word} {key}: not a config key")
    assert not problems, f"{page_id(page)}: " + "; ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_config_keys_named_are_real(page: Path):
    """Keys written as JSON (``"key": value``) anywhere in a page must be config keys (or FGH's
    options, the only nested object); results-file fields are written without a colon."""
    text = page.read_text(encoding="utf-8")
    from pilot_online.core.fgh_options import OPTION_KEYS

    known = all_keys() | set(OPTION_KEYS)
    unknown = set()
    for block in CODE_BLOCK.findall(text):
        if block.lstrip().startswith("{"):
            try:
                data = json.loads(block)
            except json.JSONDecodeError:
                data = None
            # A config snippet: mostly config keys (results-file excerpts share a few names).
            if isinstance(data, dict) and 2 * len(set(data) & all_keys()) > len(data):
                unknown |= set(data) - known
    for span in re.findall(r"`([^`\n]+)`", CODE_BLOCK.sub("", text)):
        if JSON_KEY.match(span):  # `"key": value`; objects such as backbone_kwargs nest
            unknown |= {JSON_KEY.match(span).group(1)} - known
    assert not unknown, f"{page_id(page)} names config keys that do not exist: {sorted(unknown)}"


def test_configuration_page_lists_every_key_and_only_real_keys():
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\|\s*`([a-z][a-z0-9_]*)`\s*\|", text, re.MULTILINE))
    assert listed, "docs/configuration.md has no key table"
    assert not listed - all_keys(), f"not config keys: {sorted(listed - all_keys())}"
    documented = listed | set(re.findall(r"`([a-z][a-z0-9_]*)`", text))
    missing = (set(PILOT_KEYS) | set(ONLINE_KEYS)) - documented
    assert not missing, f"docs/configuration.md does not mention: {sorted(missing)}"


def test_the_checker_catches_a_wrong_flag_and_a_wrong_key(tmp_path: Path):
    """The checks above can fail: a page with a made-up flag, key and link is caught."""
    commands = subparsers(build_parser())
    words = shlex.split("pilot-online sweep --config x.json --gird init_lr=1")
    options = {s for a in commands["sweep"]._actions for s in a.option_strings}
    assert "--gird" not in options and "--grid" in options
    assert "online_prototype" not in all_keys() and "online_prototypes" in all_keys()
    assert command_lines("```bash\npilot-online sweep \\\n  --grid a=1\n```\n") == [
        "pilot-online sweep --grid a=1"
    ]
    assert words[1] == "sweep"
    assert slug("Checkpoints and resume") == "checkpoints-and-resume"
    assert slug("`pretrained_path`") == "pretrained_path"
    assert slug("Sweep engines: GPUs, clusters, restarts") == "sweep-engines-gpus-clusters-restarts"
