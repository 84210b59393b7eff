"""The learner's pages state facts about the code, and the facts are held here, so a change that makes a page wrong
fails CI instead of misleading its next reader (docs/learn.md's line counts drifted 11 of 14 within a day when
nothing checked them).

- docs/learn.md: every table row that names a file and its line count is within 5% of the file's lines
  (`wc -l`); every file, function, class, method and test it names in backticks exists.
- docs/adding-a-dimension.md and README.md's file map: every file and folder they name exists, and every name in
  backticks that looks like code (dotted, snake_case or CamelCase) is defined in the repository.
"""

from __future__ import annotations

import ast
import functools
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ("docs/learn.md", "docs/adding-a-dimension.md", "README.md")
LINES_RTOL = 0.05
# names a page may cite that live outside the repository (torch's), or that are words the code uses as values
EXTERNAL = {
    "parallelize_module",
    "fully_shard",
    "DistributedDataParallel",
    "ZeroRedundancyOptimizer",
    "all_to_all_single",
    "torch.distributed.pipelining",
    "torch.optim.Muon",
    "_grouped_mm",
    "torch._grouped_mm",
    "_format_pipeline_order",
    "reshard_after_forward",
    "batch_isend_irecv",
    "torch.compile",
    "torch.profiler",
    "torch.distributed",
    "DeviceMesh",
    "DTensor",
    "FakeTensorMode",
}


def python_files() -> list[str]:
    out = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if not x.startswith((".", "__")) and x not in ("runs", "results")]
        out += [os.path.relpath(os.path.join(d, f), ROOT) for f in files if f.endswith(".py")]
    return sorted(out)


@functools.lru_cache(maxsize=None)
def definitions() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """({module: names defined at any depth in it}, {class name: its attribute names}) over the repository:
    functions, classes, assigned names and dataclass fields."""
    by_module: dict[str, set[str]] = {}
    by_class: dict[str, set[str]] = {}
    for path in python_files():
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
                    names |= {n.attr for n in ast.walk(t) if isinstance(n, ast.Attribute)}
            if isinstance(node, ast.ClassDef):
                attrs = by_class.setdefault(node.name, set())
                for n in ast.walk(node):
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        attrs.add(n.name)
                    elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                        attrs.add(n.attr)
                    elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                        for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                            attrs |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
        by_module[path[:-3].replace(os.sep, ".").removesuffix(".__init__")] = names
    return by_module, by_class


def missing_name(token: str) -> str | None:
    """Why `token` (a backticked name of a page) is not in the code, or None when it is (or is not code-like)."""
    by_module, by_class = definitions()
    name = token.strip().removesuffix("()")
    if (
        not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*", name)
        or name in EXTERNAL
        or re.search(r"\.(jsonl?|toml|txt|bin|md|py|sh|pt)$", name)
    ):
        return None
    parts = name.split(".")
    short: dict[str, list[str]] = {}  # comm -> [parallel.comm]: pages name modules short (maybe several)
    for m in by_module:
        short.setdefault(m.rpartition(".")[2], []).append(m)
    if len(parts) == 1:
        if "_" not in name and not re.search(r"[a-z][A-Z]|^[A-Z][a-z]", name):
            return None  # a plain word (batch, loss, gpipe): a value, not a definition
        everything = set().union(*by_module.values()) | set(short)
        return None if name in everything else f"{name} is defined nowhere"
    if name in by_module:
        return None
    for i in range(len(parts) - 1, 0, -1):  # the longest prefix that is one of our modules: the rest is in it
        prefix = ".".join(parts[:i])
        modules = [prefix] if prefix in by_module else short.get(prefix, []) if i == 1 else []
        if modules:
            rest = parts[i:]
            if not any(rest[0] in by_module[m] for m in modules):
                return f"{prefix} defines no {rest[0]}"
            if len(rest) > 1 and rest[1] not in by_class.get(rest[0], set()):
                return f"{prefix}.{rest[0]} has no {rest[1]}"
            return None
    if parts[0] in by_class:  # Class.method
        return None if parts[1] in by_class[parts[0]] else f"class {parts[0]} has no {parts[1]}"
    if parts[0] in ("torch", "torchtitan", "megatron", "nn", "F", "dist"):
        return None
    return f"{name}: no module or class {parts[0]} here"


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def is_path(token: str) -> bool:
    return bool(re.fullmatch(r"[\w./-]+(\.py|\.md|\.sh|/)", token)) and not token.startswith(("-", "."))


def resolve(page: str, token: str) -> str:
    """A path a page names: from the repository root, else relative to the page, else (a bare file name, as
    learn.md writes `zero_bubble.py` after `parallel/`) anywhere in the repository."""
    for base in (ROOT, os.path.dirname(os.path.join(ROOT, page))):
        if os.path.exists(os.path.join(base, token)):
            return os.path.join(base, token)
    name = token.rstrip("/")
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if not x.startswith((".", "__")) and x not in ("runs",)]
        if name in (files if not token.endswith("/") else dirs):
            return os.path.join(d, name)
    return ""


def line_claims(page: str) -> list[tuple[str, int]]:
    """(path, lines) for every table row of `page` with a `path.py` cell and a number cell (the count), and every
    "`path.py` (N lines)" in its prose."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    out = [(p, int(n.replace(",", ""))) for p, n in re.findall(r"`([\w/.\-]+\.py)`\s*\((\d[\d,]*) lines", text)]
    with open(os.path.join(ROOT, page)) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            paths = [m.group(1) for c in cells for m in [re.fullmatch(r"`([\w/.\-]+\.py)`", c)] if m]
            nums = [int(c.replace(",", "")) for c in cells if re.fullmatch(r"\d[\d,]*", c)]
            nums = [n for n in nums if n > 20]  # an order column (1, 2, ...) is not a count
            if line.startswith("|") and paths and nums:
                out.append((paths[0], nums[0]))
    return out


def count_lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


@pytest.mark.parametrize("page", PAGES)
def test_every_file_a_page_names_exists(page):
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    gone = sorted({t for t in backticked(text) if is_path(t) and not resolve(page, t)})
    assert not gone, f"{page} names files that are not there: {gone}"


@pytest.mark.parametrize("page", PAGES)
def test_every_name_a_page_cites_is_defined(page):
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    gone = sorted({why for t in backticked(text) if not is_path(t) for why in [missing_name(t)] if why})
    assert not gone, f"{page} cites names the code does not define: {gone}"


def test_learn_md_line_counts_are_within_5_percent():
    claims = line_claims("docs/learn.md")
    assert len(claims) >= 10, claims  # the reading tables' rows are found
    wrong = []
    for path, n in claims:
        real = count_lines(resolve("docs/learn.md", path))
        if abs(real - n) > LINES_RTOL * real:
            wrong.append(f"{path}: says {n}, has {real}")
    assert not wrong, "docs/learn.md's line counts drifted: " + "; ".join(wrong)


def test_the_checks_can_fail(tmp_path):
    """A count 6% off, a file that is gone and a name nothing defines are each caught."""
    page = tmp_path / "p.md"
    real = count_lines(os.path.join(ROOT, "train.py"))
    page.write_text(f"| 1 | `train.py` | {round(real * 1.06)} | x |\n")
    ((path, n),) = line_claims(str(page))
    assert abs(count_lines(os.path.join(ROOT, path)) - n) > LINES_RTOL * real
    assert not resolve("docs/learn.md", "parallel/no_such_file.py")
    assert missing_name("no_such_function_here") == "no_such_function_here is defined nowhere"
    assert missing_name("plan.theory.no_such_formula") == "plan.theory defines no no_such_formula"
    assert missing_name("PipelineRunner.no_such_method") == "class PipelineRunner has no no_such_method"
    assert missing_name("train_step") is None and missing_name("plan.theory.bubble_fraction") is None
