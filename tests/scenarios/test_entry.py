"""Ctrl-C at any moment of a `pretrain` command ends it in one line, exit 130: while the CLI is
still loading (the entry point), and in a command that does not catch it itself (typer ends those
silently)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from pretrain.entry import INTERRUPTED


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_ctrl_c_while_the_cli_loads_is_one_line_and_exit_130():
    done = run_python("""
        import sys

        class Interrupt:  # Ctrl-C arriving while pretrain.cli.app is being imported
            def find_spec(self, name, path=None, target=None):
                if name == "pretrain.cli.app":
                    raise KeyboardInterrupt

        sys.meta_path.insert(0, Interrupt())
        from pretrain.entry import main
        main()
    """)
    assert (done.returncode, done.stderr, done.stdout) == (130, INTERRUPTED + "\n", "")


def test_ctrl_c_in_a_command_that_does_not_catch_it_says_so():
    done = run_python("""
        import sys
        from pretrain.cli import app as cli

        @cli.app.command("boom")
        def boom():
            raise KeyboardInterrupt

        sys.argv = ["pretrain", "boom"]
        cli.main()
    """)
    assert (done.returncode, done.stderr.strip()) == (130, "interrupted"), done.stderr
