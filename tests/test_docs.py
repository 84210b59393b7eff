"""The docs stay true: docs/training.md's flag table matches `train.py --help`, every flag the README's and its
tables name exists, and relative links resolve.

A flag counts as documented when a docs/training.md table row's first cell starts with `--flag` (in backticks,
e.g. "`--profile N`") or names it as `--flag` in backticks (e.g. "`--lr`, `--warmup_steps`").
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FLAG_PAGE = os.path.join(ROOT, "docs", "training.md")  # every flag has a row here

FLAG = r"--[A-Za-z0-9][A-Za-z0-9_-]*"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)


def help_flags() -> set[str]:
    """Every long option `python train.py --help` lists, less --help itself."""
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"python train.py --help exited {out.returncode}:\n{out.stderr}"
    flags = set()
    for line in out.stdout.splitlines():
        # option lines: "  --flag METAVAR   help" or "  -h, --help ..."; continuation lines are indented deeper
        m = re.match(r"^ {2}(-\w, )?(" + FLAG + ")", line)
        if m:
            flags.add(m.group(2))
    flags.discard("--help")
    assert flags, f"no flags found in python train.py --help:\n{out.stdout}"
    return flags


def first_cells(markdown: str) -> list[str]:
    """The first cell of every table row (header and separator rows included; they name no flags)."""
    cells = []
    for line in markdown.splitlines():
        line = line.strip()
        if line.startswith("|") and line.count("|") >= 2:
            cells.append(line.split("|")[1].strip())
    return cells


def documents(cell: str, flag: str) -> bool:
    return re.match(re.escape(f"`{flag}") + r"(?![A-Za-z0-9_-])", cell) is not None or f"`{flag}`" in cell


def flags_named(cell: str) -> set[str]:
    """Flags a first cell names: "`--flag`" anywhere, or "`--flag ARG`" at its start."""
    named = set(re.findall(r"`(" + FLAG + r")`", cell))
    m = re.match(r"`(" + FLAG + r")[ `]", cell)
    if m:
        named.add(m.group(1))
    return named


def relative_links(path: str) -> list[str]:
    """Targets of the markdown links in `path` that are not URLs or in-page anchors, without #fragments."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code blocks are not links
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def cells_of(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return first_cells(f.read())


class TestFlagTables(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.flags = help_flags()

    def test_every_train_flag_has_a_row(self):
        cells = cells_of(FLAG_PAGE)
        missing = sorted(f for f in self.flags if not any(documents(c, f) for c in cells))
        self.assertEqual(
            missing,
            [],
            "flags in `python train.py --help` with no row in docs/training.md "
            "(add a row like | `--flag` | description |)",
        )

    def test_every_train_flag_is_in_the_readme_table(self):
        """The README's table names every flag (a group's row lists them in backticks)."""
        with open(README, encoding="utf-8") as f:
            rows = [line for line in f.read().splitlines() if line.startswith("|")]
        missing = sorted(f for f in self.flags if not any(re.search(re.escape(f"`{f}") + r"[` ]", r) for r in rows))
        self.assertEqual(missing, [], "flags in `python train.py --help` that no README table row names")

    def test_every_flag_row_names_a_real_flag(self):
        for page in (README, FLAG_PAGE):
            with open(page, encoding="utf-8") as f:
                rows = [line for line in f.read().splitlines() if line.startswith("|")]
            named = set().union(*(flags_named(c) for c in cells_of(page))) | {
                n for r in rows for n in re.findall(r"`(" + FLAG + r")`", r)
            }
            stale = sorted(named - self.flags)
            self.assertEqual(
                stale, [], f"{os.path.basename(page)} table rows name flags that `python train.py --help` does not list"
            )


class TestLinks(unittest.TestCase):
    def test_relative_links_point_to_files_that_exist(self):
        pages = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
        broken = []
        for page in pages:
            for target in relative_links(page):
                if not os.path.exists(os.path.join(os.path.dirname(page), target)):
                    broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
        self.assertEqual(broken, [], "relative links to files that do not exist")

    def test_link_parser(self):
        text = "[a](docs/x.md) ![p](../r/p.png) [u](https://e.org/y) [s](#top) [f](b.md#sec)\n```\n[c](no.md)\n```"
        path = os.path.join(ROOT, "tests", ".link_parser_probe.md")
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            self.assertEqual(relative_links(path), ["docs/x.md", "../r/p.png", "b.md"])
        finally:
            os.remove(path)

    def test_cell_parser(self):
        self.assertTrue(documents("`--profile N`", "--profile"))
        self.assertTrue(documents("`--lr`, `--warmup_steps`", "--warmup_steps"))
        self.assertFalse(documents("`--lr_min`", "--lr"))
        self.assertEqual(flags_named("`--lr`, `--warmup_steps`"), {"--lr", "--warmup_steps"})
        self.assertEqual(flags_named("`--checkpoint_interval N`"), {"--checkpoint_interval"})


if __name__ == "__main__":
    unittest.main()
