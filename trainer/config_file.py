"""train.py's flags as a TOML file: `--config FILE.toml` reads them, every run writes its own to OUT_DIR/config.toml.

A config file is flat: `key = value`, one key per flag, named as the flag without its dashes (`micro_batch_size =
8`, `sequence_parallel = true`); a flag left out keeps its default, and flags given on the command line override the
file. An unknown key or a value of the wrong type is one line naming the key (UsageError). The file a run writes
holds every flag that has a value (TOML has no null: flags left unset stay out), so

    python train.py --config OUT_DIR/config.toml --out_dir NEW

replays the run: the same flags, so the same losses, bit for bit (every layout is a pure function of them).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os

import tomllib

NOT_IN_FILE = ("help", "config", "resume", "overwrite")  # what a run does to its out_dir is not part of the run


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's flags by name (their dest), less those a config file does not hold."""
    return {a.dest: a for a in parser._actions if a.dest not in NOT_IN_FILE}


def _kind(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "a boolean (true or false)"
    return {int: "an integer", float: "a number"}.get(action.type, "a string")


def _value(key: str, value, action: argparse.Action, path: str):
    """`value` as the flag would hold it from the command line; _Refused naming `key` if it cannot be."""
    kind = _kind(action)
    ok = {
        "a boolean (true or false)": isinstance(value, bool),
        "an integer": isinstance(value, int) and not isinstance(value, bool),
        "a number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "a string": isinstance(value, str),
    }[kind]
    if not ok:
        raise _Refused(
            f"--config {path}: key {key!r} must be {kind}, got {type(value).__name__} {json.dumps(value, default=str)}"
        )
    value = float(value) if kind == "a number" else value
    if action.choices is not None and value not in action.choices:
        raise _Refused(
            f"--config {path}: key {key!r} must be one of {', '.join(map(str, action.choices))}, got {value!r}"
        )
    return value


class _Refused(ValueError):
    """What read() finds wrong with a file (parse_args hands it to parser.error: one line)."""


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """parser's arguments from `argv`, the file of its --config (if any) supplying the defaults: the command line
    wins. A bad file goes to parser.error in one line (config.Parser: UsageError)."""
    args = parser.parse_args(argv)
    if args.config is not None:
        try:
            parser.set_defaults(**read(args.config, parser))
        except _Refused as e:
            parser.error(str(e))
        args = parser.parse_args(argv)
    return args


def read(path: str, parser: argparse.ArgumentParser) -> dict:
    """The flag values in TOML file `path`, checked against `parser`'s flags: name -> value."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise _Refused(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _Refused(f"--config {path}: cannot read it ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise _Refused(f"--config {path}: not valid TOML ({e})") from None
    known = flags(parser)
    values = {}
    for key, value in table.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _Refused(f"--config {path}: unknown key {key!r}: not a {parser.prog} flag{hint}")
        values[key] = _value(key, value, known[key], path)
    return values


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return (
            repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
        )
    if isinstance(value, int):
        return str(value)
    return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's


def dumps(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """Every flag of `args` that has a value, in the parser's order, as TOML (read() gives them back)."""
    lines = [f"# {parser.prog}'s flags for this run. Replay it: {parser.prog} --config THIS_FILE --out_dir NEW"]
    lines += [f"{key} = {_toml(getattr(args, key))}" for key in flags(parser) if getattr(args, key) is not None]
    return "\n".join(lines) + "\n"


def write(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """OUT_DIR/config.toml of this run (replaced whole: written aside, then renamed). Returns its path."""
    path = os.path.join(args.out_dir, "config.toml")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(dumps(args, parser))
    os.replace(path + ".tmp", path)
    return path
