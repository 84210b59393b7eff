"""The codebase's arrows point one way: train -> parallelize -> wrappers -> comm, and the model knows no
parallelism. Read from the source (every import, lazy ones inside functions too), so a shortcut that climbs
back up fails here, not in a reader's head."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("train", "config", "checkpoint", "sample", "export", "bench", "scripts", "tests")  # above parallel/


def imports(path: str, root: str = ROOT) -> set[str]:
    """Every module `path` imports, at any depth of its code."""
    with open(os.path.join(root, path)) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("path", ["model.py", "metrics.py"])
def test_model_and_metrics_know_no_parallelism(path):
    assert not {m for m in imports(path) if m == "parallel" or m.startswith("parallel.")}


@pytest.mark.parametrize("path", sorted(f"parallel/{f}" for f in os.listdir(os.path.join(ROOT, "parallel"))
                                        if f.endswith(".py")))
def test_parallel_does_not_import_the_layers_above_it(path):
    up = {m for m in imports(path) if m.split(".")[0] in TOP}
    assert not up, f"{path} imports {sorted(up)}"


def test_imports_are_read_at_every_depth(tmp_path):
    """The reader itself: a lazy import inside a function counts."""
    (tmp_path / "m.py").write_text("def f():\n    from parallel.comm import local\n    import parallel.mesh\n")
    assert {"parallel.comm", "parallel.mesh"} <= imports("m.py", str(tmp_path))
