"""The README's commands run as written: every `wbrag` line of its bash / sh blocks names a real subcommand with
flags that subcommand's parser accepts (and values it parses), every `make` target is in the Makefile, every
path under jobs/configs exists, and every dataset given to `wbrag data fetch` / `check` is one of FlashRAG's
folders (`formats.DATASET_FOLDERS`, the listing the project ships). The docs' command blocks are held to the same
rules. Also: the README stays a guide (under 320 lines, no timing table per CPU kind: those live in
benchmarks/RESULTS.md). Reads files and builds the argparse parser only: no Ray, no model."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from wbrag_ray.cli import build_parser
from wbrag_ray.formats import DATASET_FOLDERS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "shell", "console"}
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;"}
REPO_DIRS = ("jobs/", "cluster/", "docs/", "benchmarks/", "wbrag_ray/", "tests/")


def strip_comment(line: str) -> str:
    """The line without its shell comment: a `#` outside quotes at the start of a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of every bash / sh fenced block: comments stripped, `\\` continuations joined."""
    out: list[tuple[int, str]] = []
    lang: str | None = None  # the open block's language; None outside blocks
    pending, start = "", 0
    for n, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```\s*([\w+-]*)", line)
        if fence:
            lang = None if lang is not None else fence.group(1).lower()
            continue
        if lang not in SHELLS:
            continue
        body = strip_comment(line).rstrip()
        if not pending:
            start = n
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        logical, pending = (pending + body).strip(), ""
        if logical:
            out.append((start, logical))
    return out


def commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at &&, ||, ;, |), leading VAR=value assignments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    out, current = [], []
    for token in lexer:
        if token in OPERATORS:
            out.append(current)
            current = []
        else:
            current.append(token)
    out.append(current)
    for cmd in out:
        while cmd and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", cmd[0]):
            cmd.pop(0)
    return [cmd for cmd in out if cmd]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def make_targets() -> set[str]:
    """Targets the Makefile has rules for (`name: ...` at a line's start, not a `:=` assignment)."""
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        rule = re.match(r"^([A-Za-z0-9_.-]+(?:[ \t]+[A-Za-z0-9_.-]+)*)[ \t]*:(?!=)", line)
        if rule and not rule.group(1).startswith("."):
            targets.update(rule.group(1).split())
    return targets


def wbrag_problems(args: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """What is wrong with `wbrag ARGS`: an unknown subcommand, a flag its parser lacks (exactly: no prefix
    abbreviations), arguments it refuses, a FlashRAG dataset that is not one of its folders."""
    subs = subparsers(parser)
    if not args or args[0] not in subs:
        return [f"no subcommand {args[0] if args else ''!r} (wbrag has {', '.join(sorted(subs))})"]
    sub = subs[args[0]]
    flags = {opt for action in sub._actions for opt in action.option_strings}
    problems = [f"`wbrag {args[0]}` has no flag {tok.split('=', 1)[0]}" for tok in args[1:]
                if tok.startswith("-") and tok != "-" and tok.split("=", 1)[0] not in flags]
    if problems or {"-h", "--help"} & set(args):
        return problems
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = parser.parse_args(args)
    except SystemExit:
        return [f"`wbrag {args[0]}` refuses it: {err.getvalue().strip().splitlines()[-1]}"]
    if args[0] == "data":
        problems += [f"wbrag data {ns.action}: {d!r} is not one of FlashRAG's dataset folders (formats.DATASET_FOLDERS)"
                     for d in ns.datasets if d not in DATASET_FOLDERS]
    return problems


def command_problems(path: Path) -> tuple[list[str], int]:
    """Every problem of the file's command blocks, as 'FILE:LINE: `command`: problem', and how many wbrag
    commands were checked."""
    parser, targets = build_parser(), make_targets()
    problems, checked = [], 0
    for n, line in command_lines(path.read_text()):
        for cmd in commands(line):
            found: list[str] = []
            if Path(cmd[0]).name == "wbrag":
                checked += 1
                found += wbrag_problems(cmd[1:], parser)
            elif cmd[0] == "make":
                found += [f"the Makefile has no target {t!r}" for t in cmd[1:]
                          if not t.startswith("-") and "=" not in t and t not in targets]
            found += [f"{tok} does not exist" for tok in cmd
                      if tok.startswith(REPO_DIRS) and not (ROOT / tok).exists()]
            problems += [f"{path.relative_to(ROOT)}:{n}: `{' '.join(cmd)}`: {p}" for p in found]
    return problems, checked


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_command_blocks_run_as_written(path):
    problems, _ = command_problems(path)
    assert not problems, "\n".join(problems)


def test_readme_checks_are_not_vacuous():
    """The reader finds the README's commands: dozens of wbrag lines and the two first commands, as written."""
    _, checked = command_problems(README)
    assert checked >= 20, f"only {checked} wbrag commands found in README.md's bash blocks"
    lines = [line for _, line in command_lines(README.read_text())]
    assert lines[:2] == ["make demo", "make test"], lines[:2]


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_exist(path):
    """Every path under jobs/configs the file names, and every relative link it makes, exists."""
    text = path.read_text()
    missing = [f"{name} (jobs/configs)" for name in re.findall(r"jobs/configs/[\w.-]*[\w-]", text)
               if not (ROOT / name).exists()]
    missing += [f"{target} (a link)" for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
                if "://" not in target and not (path.parent / target).exists()]
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"


def test_readme_is_a_guide_not_a_measurement_log():
    lines = README.read_text().splitlines()
    assert len(lines) < 320, f"README.md has {len(lines)} lines: move details to docs/ or benchmarks/RESULTS.md"
    per_kind = [line for line in lines if line.lstrip().startswith("|") and re.search(r"AVX|CPU kind", line)]
    assert not per_kind, f"a timing table per CPU kind belongs in benchmarks/RESULTS.md: {per_kind}"


def test_the_reader_sees_what_it_checks():
    """The reader's own rules, on lines made for them: a wrong flag, a prefix of a flag, a dataset FlashRAG does
    not hold, a make target that does not exist, and a commented, continued, chained line that is fine."""
    parser = build_parser()
    assert wbrag_problems(["eval", "RUN", "--dataset", "d.jsonl", "--bogus"], parser)
    assert wbrag_problems(["plan", "CONFIG", "--calib"], parser)  # argparse would take the prefix
    assert wbrag_problems(["data", "fetch", "flashrag", "entityquestions", "--out", "x"], parser)
    assert wbrag_problems(["frobnicate"], parser)
    assert not wbrag_problems(["data", "fetch", "flashrag", "nq", "popqa", "--corpus", "wiki18", "--out", "x"], parser)
    assert "nonesuch" not in make_targets() and {"demo", "test"} <= make_targets()
    block = "```bash\nX=1 wbrag eval RUN \\\n  --dataset d.jsonl --writeback  # a comment --bogus\nmake demo && make test\n```\n"
    assert [commands(line) for _, line in command_lines(block)] == [
        [["wbrag", "eval", "RUN", "--dataset", "d.jsonl", "--writeback"]], [["make", "demo"], ["make", "test"]]]
