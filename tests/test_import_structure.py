"""The package's import graph, read from the source with `ast` (lazy imports inside functions included): flat
sibling-relative imports only (the package is exported as Hub remote code), no cycle, and dependencies that run one
way: the models know nothing of the pipelines or of the Hub export code, which depends on both."""

import ast
from pathlib import Path

import pytest
from transformers.dynamic_module_utils import get_relative_imports


PACKAGE = Path(__file__).resolve().parents[1] / "modeling_testa"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _relative_imports(path: Path) -> set[str]:
    """Sibling modules imported by `path` (anywhere in the file), as module names. Fails on non-flat imports."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            assert node.level == 1, f"{path.name}:{node.lineno} imports from a parent package (level {node.level})"
            if node.module is None:  # `from . import x`
                imported.update(alias.name for alias in node.names)
            else:
                assert "." not in node.module, f"{path.name}:{node.lineno} imports a nested module {node.module!r}"
                imported.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "modeling_testa":
            pytest.fail(f"{path.name}:{node.lineno} imports the package by name ({node.module}); remote code can't")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] != "modeling_testa", f"{path.name}:{node.lineno} imports the package"
    return imported


def _graph() -> dict[str, set[str]]:
    return {name: _relative_imports(PACKAGE / f"{name}.py") for name in MODULES}


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for child in graph[todo.pop()]:
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules (first == last), or None. Iterative three-colour DFS."""
    state: dict[str, int] = {}
    for root in graph:
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_cycle_finder_finds_cycles():
    """The checker itself: a known cycle is found, a DAG passes."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert _closure({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}


def test_imports_are_flat_siblings_and_match_what_transformers_exports():
    graph = _graph()
    for name, imported in graph.items():
        assert imported <= set(MODULES), f"{name} imports {sorted(imported - set(MODULES))}, which are not siblings"
    # transformers finds the files to export with a regex over the source: for the exported code (the models, the
    # pipelines and what they import) it must see exactly the imports Python runs
    exported = {"modeling_testa", "pipeline_testa"}
    exported |= _closure(graph, "modeling_testa") | _closure(graph, "pipeline_testa")
    assert {"saving_testa", "processing_testa", "video_processing_testa", "configuration_testa"} <= exported
    for name in sorted(exported | {"hub_testa"}):
        assert set(get_relative_imports(PACKAGE / f"{name}.py")) == graph[name], name


def test_import_graph_has_no_cycle():
    graph = _graph()
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def test_dependencies_run_one_way():
    graph = _graph()
    model_side = _closure(graph, "modeling_testa")
    assert "pipeline_testa" not in model_side and "hub_testa" not in model_side, sorted(model_side)
    assert not {"pipeline_testa", "hub_testa"} & graph["modeling_testa"]
    # the pipelines may use the models' processors and saving helpers, never the Hub export code
    assert "hub_testa" not in _closure(graph, "pipeline_testa")
    # the export code depends on both
    assert {"modeling_testa", "pipeline_testa"} <= graph["hub_testa"]
    # nothing but the package's __init__ depends on the export code
    assert [name for name, imported in graph.items() if "hub_testa" in imported] == []
