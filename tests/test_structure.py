"""The codebase's arrows point one way: train -> parallelize -> wrappers -> comm, and the model knows no
parallelism. Read from the source (every import, lazy ones inside functions too), so a shortcut that climbs
back up fails here, not in a reader's head."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BELOW = ("model", "moe", "loss", "metrics")  # the only repository modules parallel/ may import, besides itself
# every other top-level module and package of the repository sits above parallel/ (train, config, faults, plan, ...)
OURS = sorted({f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
              | {f for f in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, f, "__init__.py"))})
TOP = tuple(m for m in OURS if m not in BELOW + ("parallel",))
PARALLEL = sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "parallel"))
                  for f in fs if f.endswith(".py"))


def imports(path: str, root: str = ROOT, runtime_only: bool = False) -> set[str]:
    """Every module `path` imports, at any depth of its code; `runtime_only`: less those under
    `if TYPE_CHECKING:` (type hints only: nothing is imported at run time)."""
    with open(os.path.join(root, path)) as f:
        tree = ast.parse(f.read())
    hints = [n for n in ast.walk(tree) if runtime_only and isinstance(n, ast.If)
             and ast.unparse(n.test) == "TYPE_CHECKING"]
    skip = {id(m) for n in hints for b in n.body for m in ast.walk(b)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("path", ["model.py", "moe.py", "loss.py", "metrics.py"])
def test_model_and_metrics_know_no_parallelism(path):
    assert not {m for m in imports(path) if m == "parallel" or m.startswith("parallel.")}


def test_the_layers_above_are_found():
    """The list is read off the repository, so a new top-level module is above parallel/ by default."""
    assert {"train", "config", "faults", "plan", "debug", "bench", "checkpoint", "tests"} <= set(TOP)


@pytest.mark.parametrize("path", PARALLEL)
def test_parallel_does_not_import_the_layers_above_it(path):
    """faults.py (the test hooks) included: they reach the runtime through parallel/comm.HOOKS, set from above;
    plan/ (the formula sheet, the simulator) included: theory sits beside the runtime, not inside it."""
    up = {m for m in imports(path) if m.split(".")[0] in TOP}
    assert not up, f"{path} imports {sorted(up)}"


@pytest.mark.parametrize("path", [p for p in PARALLEL if not p.startswith(os.path.join("parallel", "twins"))
                                  and p != os.path.join("parallel", "parallelize.py")])
def test_the_mechanisms_do_not_reach_into_the_twins(path):
    """PyTorch's wrappers sit beside ours: only the composition (parallelize.py) picks between them."""
    twins = {m for m in imports(path) if m == "parallel.twins" or m.startswith("parallel.twins.")}
    assert not twins, f"{path} imports {sorted(twins)}"


@pytest.mark.parametrize("path", ["model.py", "moe.py", "loss.py", "metrics.py"])
def test_model_and_metrics_import_nothing_above_them(path):
    up = {m for m in imports(path) if m.split(".")[0] in TOP + ("parallel",)}
    assert not up, f"{path} imports {sorted(up)}"


@pytest.mark.parametrize("path", ["moe.py", "loss.py"])
def test_the_model_parts_do_not_import_the_model(path):
    """model.py imports them (a Block builds an MoE, GPT's head is loss.py's): an import back, outside
    TYPE_CHECKING, would be a cycle."""
    assert "model" not in imports(path, runtime_only=True), f"{path} imports model at run time"


def test_imports_are_read_at_every_depth(tmp_path):
    """The reader itself: a lazy import inside a function counts."""
    (tmp_path / "m.py").write_text("def f():\n    from parallel.comm import local\n    import parallel.mesh\n")
    assert {"parallel.comm", "parallel.mesh"} <= imports("m.py", str(tmp_path))
