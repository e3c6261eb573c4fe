"""``--help`` of every user tool (and of pretrain_gpt.py), built in this process: the tool's
own description (its docstring's first line, never the trainer's for a tool that extends
the trainer's parser), its own flags before the trainer's, and no flag whose help states
its default twice (e.g. ``(default 9) (default: 9)``)."""

import importlib
import re

import pytest

TOOLS = ["pretrain_gpt", "tools.profile_latency", "tools.preprocess_data", "tools.check_launch_script",
         "tools.checkpoint.convert", "tools.propose_layout", "tools.dataset_lengths", "tools.make_corpus",
         "tools.bench_attention", "tools.timeline"]
HEADING = re.compile(r"^(\S.*):$")
DEFAULT = re.compile(r"\bdefault\b[: ]", re.IGNORECASE)


def help_of(module, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out, module
    return out


def parse_help(text):
    """(description, [(heading, [entry text joined over its wrapped lines])])."""
    lines = text.splitlines()
    body = lines[next(i for i, ln in enumerate(lines) if not ln.strip()) + 1:]  # after the usage block
    n = next(i for i, ln in enumerate(body) if HEADING.match(ln))
    description = " ".join(" ".join(body[:n]).split())
    sections = []
    for ln in body[n:]:
        if HEADING.match(ln):
            sections.append((ln[:-1], []))
        elif re.match(r"^  \S", ln):  # an option (or positional) starts; deeper lines continue it
            sections[-1][1].append(ln.strip())
        elif ln.strip():
            sections[-1][1][-1] += " " + ln.strip()
    return description, sections


@pytest.fixture(scope="module")
def trainer_headings():
    from megatron.training.arguments import build_parser

    _, sections = parse_help(build_parser().format_help())
    return {h for h, _ in sections} - {"options", "positional arguments"}


@pytest.mark.parametrize("module", TOOLS)
def test_help_lists_own_description_and_flags_first_and_each_default_once(module, capsys, monkeypatch,
                                                                          trainer_headings):
    description, sections = parse_help(help_of(module, capsys, monkeypatch))
    doc = " ".join(importlib.import_module(module).__doc__.strip().splitlines()[0].split())
    assert description.startswith(doc), (description, doc)
    headings = [h for h, _ in sections]
    if module != "pretrain_gpt" and trainer_headings <= set(headings):  # extends the trainer's parser
        own = [h for h in headings if h not in {"options", "positional arguments"}][0]
        assert own not in trainer_headings, headings  # its own group comes first
    for _, entries in sections:
        for entry in entries:
            assert len(DEFAULT.findall(entry)) <= 1, entry
