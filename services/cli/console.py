"""What every `muster` command shares: its exit codes, the error that ends it with one, and
where its lines go (stdout, stderr). No import beyond the standard library."""

from __future__ import annotations

import sys

EXIT_OK, EXIT_FAIL, EXIT_INVALID = 0, 1, 2


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAIL):
        super().__init__(message)
        self.code = code


def out(line: str = "") -> None:
    print(line, flush=True)


def err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
