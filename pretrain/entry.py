"""The ``pretrain`` command's entry point: loads the CLI (~0.2 s of imports) so that a Ctrl-C
pressed meanwhile ends the command in one line, exit 130, as one pressed later does, instead of
a traceback of whatever module was loading."""

from __future__ import annotations

import os
import sys

INTERRUPTED = "interrupted before anything started"


def main() -> None:
    try:
        from pretrain.cli.app import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write(INTERRUPTED + "\n")
        sys.stderr.flush()
        os._exit(130)
    cli_main()
