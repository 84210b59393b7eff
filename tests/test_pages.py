"""The learner's pages state facts about the code, and the facts are held here, so a change that makes a page wrong
fails CI instead of misleading its next reader (docs/learn.md's line counts drifted 11 of 14 within a day when
nothing checked them).

- docs/learn.md: every table row that names a file and its line count is within 5% of the file's lines
  (`wc -l`); every file, function, class, method and test it names in backticks exists; and each reading path's
  cost, as its table "What each path costs" states it, is the import graph's within 5%: the path's modules, plus
  the repository modules they import directly (function-level imports included, tests/test_structure.py's
  `module_graph`; an `__init__.py` counts as the lines it has), and every path the page lays out has a row.
- docs/adding-a-dimension.md and README.md's file map: every file and folder they name exists, and every name in
  backticks that looks like code (dotted, snake_case or CamelCase) is defined in the repository.
"""

from __future__ import annotations

import ast
import functools
import os
import re

import pytest

from tests.test_structure import module_graph

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


def module_path(module: str, root: str = ROOT) -> str:
    """The file of a dotted repository module: its .py, or its package's __init__.py."""
    base = os.path.join(root, *module.split("."))
    return base + ".py" if os.path.exists(base + ".py") else os.path.join(base, "__init__.py")


def module_of(path: str) -> str:
    """The dotted module of a repository file (`parallel/comm.py` -> parallel.comm)."""
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def is_empty_init(path: str) -> bool:
    """A package's __init__.py that holds nothing but a docstring: importing it costs a reader nothing to read."""
    if not path.endswith("__init__.py"):
        return False
    with open(path) as f:
        body = ast.parse(f.read()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def reading_cost(modules: list[str], root: str = ROOT) -> tuple[int, dict[str, int]]:
    """(lines of the path's own modules, {module: lines} of the repository modules they import directly and are
    not the path's), function-level imports included: what a reader of the path meets."""
    graph = module_graph(root)
    imported = set().union(*(graph[m] for m in modules)) - set(modules)
    lines = {m: count_lines(module_path(m, root)) for m in [*modules, *imported]}
    return sum(lines[m] for m in modules), {m: lines[m] for m in imported}


COST_HEADER = ["path", "its modules", "lines", "the modules they import", "lines", "total"]


def cost_rows(page: str) -> list[tuple[str, list[str], int, list[str], int, int]]:
    """(path, its modules, their lines, the modules they import, their lines, total) for each row of `page`'s
    table headed COST_HEADER (modules named in backticks, dotted)."""
    with open(os.path.join(ROOT, page)) as f:
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None for line in f]
    start = rows.index(COST_HEADER)
    out = []
    for row in rows[start + 2 :]:
        if row is None:
            break
        name, own, own_n, imported, imported_n, total = row
        n = [int(c.replace(",", "")) for c in (own_n, imported_n, total)]
        out.append((name, backticked(own), n[0], backticked(imported), n[1], n[2]))
    return out


def path_tables(page: str) -> list[list[str]]:
    """The files of each reading table of `page` (a table with a `file` and a `lines` column), as modules."""
    out, column = [], None
    with open(os.path.join(ROOT, page)) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
            if cells is None:
                column = None
            elif column is None and "file" in cells and "lines" in cells:
                column = cells.index("file")
                out.append([])
            elif column is not None and (m := re.fullmatch(r"`([\w/.\-]+\.py)`", cells[column])):
                out[-1].append(module_of(m.group(1)))
    return [t for t in out if t]


def cost_errors(rows: list[tuple], root: str = ROOT) -> list[str]:
    """Where a cost row is not what the import graph says: each number within 5%, the imported modules named
    exactly (an __init__.py that holds only a docstring counts its lines but need not be named)."""
    wrong = []
    for name, own, own_n, imported, imported_n, total in rows:
        real_own, real_imported = reading_cost(own, root)
        named = sorted(m for m in real_imported if not is_empty_init(module_path(m, root)))
        if sorted(imported) != named:
            wrong.append(f"{name}: imports {named}, the page names {sorted(imported)}")
        real_n = sum(real_imported.values())
        for what, said, real in (("its modules", own_n, real_own), ("imports", imported_n, real_n)):
            if abs(real - said) > LINES_RTOL * real:
                wrong.append(f"{name}: {what} {said} lines, the graph says {real}")
        if abs(real_own + real_n - total) > LINES_RTOL * (real_own + real_n):
            wrong.append(f"{name}: total {total} lines, the graph says {real_own + real_n}")
    return wrong


def test_learn_md_reading_costs_are_the_import_graphs():
    """Each path's cost as learn.md states it (its modules, the modules they import, the total) is within 5% of
    the import graph's, and every reading table of the page is a path with a row."""
    rows = cost_rows("docs/learn.md")
    assert len(rows) >= 8, rows  # first read, DDP, ZeRO, TP, PP, CP, EP, Muon at least
    wrong = cost_errors(rows)
    assert not wrong, "docs/learn.md's reading costs are not the import graph's: " + "; ".join(wrong)
    costed = [sorted(own) for _, own, *_ in rows]
    uncosted = [t for t in path_tables("docs/learn.md") if sorted(t) not in costed]
    assert not uncosted, f"reading paths of docs/learn.md with no row in its cost table: {uncosted}"


def test_a_wrong_reading_cost_is_caught(tmp_path):
    """The cost check itself: the true row passes; a total 6% off, a module it imports left unnamed (here one
    imported inside a function: the graph reads function bodies) and a docstring-only package left unnamed
    (allowed) are told apart."""
    files = {
        "a.py": "import b\nfrom p import q\n\n\ndef f():\n    import c\n" + "x = 1\n" * 94,  # 100 lines
        "b.py": "y = 1\n" * 50,
        "c.py": "z = 1\n" * 25,
        "p/__init__.py": '"""A package."""\n',
        "p/q.py": "w = 1\n" * 10,
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
    imports = 50 + 25 + 1 + 10
    row = ("a", ["a"], 100, ["b", "c", "p.q"], imports, 100 + imports)
    assert cost_errors([row], str(tmp_path)) == []
    assert cost_errors([(*row[:5], 196)], str(tmp_path)) == ["a: total 196 lines, the graph says 186"]
    assert cost_errors([(*row[:3], ["b", "p.q"], 61, 161)], str(tmp_path)) == [
        "a: imports ['b', 'c', 'p.q'], the page names ['b', 'p.q']",
        "a: imports 61 lines, the graph says 86",
        "a: total 161 lines, the graph says 186",
    ]


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
