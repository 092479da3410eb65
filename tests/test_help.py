"""The --help of the commands a new user runs first (serve, pack, demo, info, generate and the command list),
read as printed at 80 columns: the description, every option's help and the epilog are whole sentences.
argparse wraps whatever it is given, so a help cut mid-sentence (serve's description once ended
"...shipped in the nvidia-pytriton wheel on the") or an option without help shows only here."""
import re
from pathlib import Path

import pytest

from colibri import __main__ as cli

COMMANDS = [[], ["pack"], ["demo"], ["info"], ["stage"], ["serve"], ["generate"]]


def help_text(command, monkeypatch, capsys) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def help_paragraphs(text):
    """(what, prose) for each paragraph of an argparse help: ("description", ...), one per option or
    command listed (its invocation, its help joined into one line) and ("epilog", ...)."""
    paragraphs = []
    blocks = text.strip("\n").split("\n\n")
    for position, block in enumerate(blocks):
        lines = block.splitlines()
        if lines[0].startswith("usage:"):
            continue
        if re.match(r"\S.*:$", lines[0]):  # a section: "options:", "positional arguments:"
            entries = []
            for line in lines[1:]:
                indent = len(line) - len(line.lstrip())
                if indent <= 4:  # an invocation (a command listed: 4), its help after two spaces or below
                    invocation, _, prose = line.strip().partition("  ")
                    entries.append([invocation, prose.strip()])
                else:
                    entries[-1][1] = f"{entries[-1][1]} {line.strip()}".strip()
            paragraphs += [tuple(entry) for entry in entries]
        else:
            what = "epilog" if position == len(blocks) - 1 and position > 1 else "description"
            paragraphs.append((what, " ".join(line.strip() for line in lines)))
    return paragraphs


def test_the_paragraph_reader_sees_a_cut_sentence():
    """The reader itself, on a help as argparse prints it, with serve's old cut description."""
    text = ("usage: python -m colibri serve [-h]\n\n"
            "`python -m colibri serve`: runs the real tritonserver shipped in the nvidia-\npytriton wheel on the\n\n"
            "options:\n  -h, --help            show this help message and exit\n"
            "  --http-port HTTP_PORT\n  --weights WEIGHTS     packed checkpoint; default: a demo\n"
            "                        checkpoint.\n")
    assert help_paragraphs(text) == [
        ("description", "`python -m colibri serve`: runs the real tritonserver shipped in the nvidia- pytriton "
                        "wheel on the"),
        ("-h, --help", "show this help message and exit"), ("--http-port HTTP_PORT", ""),
        ("--weights WEIGHTS", "packed checkpoint; default: a demo checkpoint.")]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "commands")
def test_help_is_whole_sentences(command, monkeypatch, capsys):
    paragraphs = help_paragraphs(help_text(command, monkeypatch, capsys))
    assert paragraphs[0][0] == "description" and len(paragraphs) > 2
    for what, prose in paragraphs:
        assert prose, f"{what}: no help"
        assert prose[0].isupper() or prose[0] == "`", f"{what}: {prose!r} does not start a sentence"
        assert prose.endswith((".", ")")), f"{what}: {prose!r} stops mid-sentence"


def test_serve_help_says_what_a_request_sends(monkeypatch, capsys):
    """Triton's own error for a request of the wrong width advises max_batch_size 0, which is not the
    fix: serve's help says what is (hidden_states [T, H] with the checkpoint's H, and where to read H)."""
    epilog = help_paragraphs(help_text(["serve"], monkeypatch, capsys))[-1]
    assert epilog[0] == "epilog" and "hidden_states [T, H]" in epilog[1]
    assert "GET /v2/models/colibri_moe/config" in epilog[1] and "python -m colibri info FILE" in epilog[1]


def test_readme_lists_every_serve_option(monkeypatch, capsys):
    """README's `serve --help` block is the real one: an option the launcher gains shows there too."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("$ .venv/bin/python -m colibri serve --help", 1)[1].split("```", 1)[0]
    options = set(re.findall(r"^  (--[a-z-]+)", help_text(["serve"], monkeypatch, capsys), re.M))
    missing = options - set(re.findall(r"--[a-z-]+", block))
    assert options and not missing, f"README's serve --help block lacks {sorted(missing)}"
