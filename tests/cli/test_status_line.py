"""The start-up status line (base/progress.py ``status``): on a terminal a command says what it is
doing from its first moment (before it imports torch), each stage rewriting the line, and the
first thing the command prints erases it; where stderr is not a terminal nothing is added."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

import pytest

from multitoken.base import progress
from multitoken.base.progress import CLEAR
from multitoken.pipeline import cli


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch):
    """``terminal()`` -> (stderr, stdout): stderr a terminal from then on. Called in the test's body:
    pytest puts its own capture back on sys.stderr between a fixture's set-up and the test."""
    def install():
        err, out = _Terminal(), io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        monkeypatch.setattr(sys, "stdout", out)
        return err, out

    yield install
    progress.status_on(False)


def test_the_status_shows_before_the_command_loads_and_the_first_output_erases_it(terminal, monkeypatch):
    err, out = terminal()
    seen = []
    real = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda command: seen.append(err.getvalue()) or real(command))
    assert cli.main(["generate", "  ", "--max-new-tokens", "1"]) == 2  # an empty prompt: refused after parsing
    assert seen == [f"{CLEAR}multitoken generate: starting ..."]  # before the command's module (torch) is imported
    assert err.getvalue() == seen[0] + CLEAR + "multitoken generate: error: the prompt is empty" + err.getvalue().split("is empty", 1)[1]
    assert sys.stderr is err and sys.stdout is out  # the streams given back


def test_a_stage_rewrites_the_line_and_stdout_erases_it(terminal):
    err, out = terminal()
    progress.status_on()
    progress.status("loading a model")
    progress.status("packing 3 linears")
    print("Once upon a time")
    assert err.getvalue() == f"{CLEAR}loading a model ...{CLEAR}packing 3 linears ...{CLEAR}"
    assert out.getvalue() == "Once upon a time\n" and sys.stdout is out


def test_nothing_is_added_where_stderr_is_not_a_terminal_nor_outside_the_cli(monkeypatch, terminal):
    err, out = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", out)
    progress.status_on()
    progress.status("loading a model")
    print("text")
    assert err.getvalue() == "" and out.getvalue() == "text\n" and sys.stdout is out
    progress.status_on(False)
    tty, _ = terminal()
    progress.status("loading a model")  # a library call (a REPL, a notebook): the CLI did not turn it on
    assert tty.getvalue() == ""


def test_help_shows_no_status(terminal):
    err, out = terminal()
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "starting" not in err.getvalue() and "usage: multitoken generate" in out.getvalue()


def test_a_real_terminal_sees_the_status_first_and_the_text_after(tmp_path):
    """``multitoken generate`` on a pseudo-terminal: its first bytes are the status line, then the
    loading stage, and the prompt with its continuation on a cleared line."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "multitoken.pipeline.cli", "generate", "Once upon a time",
                             "--max-new-tokens", "4", "--mode", "ar"], stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower, cwd=tmp_path)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the follower closed: the process ended
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    os.close(leader)
    shown = b"".join(chunks).decode()
    assert shown.startswith(f"{CLEAR}multitoken generate: starting ..."), shown[:200]
    assert f"{CLEAR}loading embedded:stories260K ..." in shown
    assert f"...{CLEAR}Once upon a time" in shown  # erased before the text, which comes whole
