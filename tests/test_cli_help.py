"""The command line's help says what each option is, and lists what the code accepts (the demo
checkpoints and served model types come from the code, so the help cannot fall behind it)."""

from __future__ import annotations

import pytest

from mmserve.cli import build_parser
from mmserve.config.checks import known_builtins
from mmserve.models.loading import FAMILIES


def help_of(command: str, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no wrapping inside a name
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command")
    return subcommands.choices[command].format_help()


def option_line(text: str, option: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(option))


def test_serve_model_lists_every_demo_and_model_type(monkeypatch):
    line = option_line(help_of("serve", monkeypatch), "--model")
    assert "demo-qwen" in known_builtins()
    for name in (*known_builtins(), *FAMILIES):
        assert name in line, (name, line)


@pytest.mark.parametrize("command, option", [("serve", "--host"), ("serve", "--port"), ("make-model", "--out"),
                                             ("make-model", "--seed")])
def test_options_have_help(monkeypatch, command, option):
    line = option_line(help_of(command, monkeypatch), option)
    words = line.split()
    assert len(words) > 4, f"{command} {option} has no help: {line!r}"  # "--out OUT" and nothing else
