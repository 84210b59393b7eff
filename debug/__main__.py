"""python -m debug {hang,diff} ...: dispatch to debug.hang.main or debug.diff.main (each parses its own flags
and returns the exit code: 0 fine, 1 a finding, 2 bad input)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"hang": "debug.hang", "diff": "debug.diff"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m debug {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
