"""The repository's import structure, read from the source with `ast` (lazy imports inside functions included).

- The files a saved folder ships (the relative-import closure of the models, the pipelines and the processors in
  `modeling_testa/`) import their siblings flat and relative only (Hub remote code), with no cycle, and their
  dependencies run one way: the models know nothing of the pipelines or of the Hub export code.
- The packages run one way: `testa_search` and `testa_runtimes` use `modeling_testa`, never the reverse (the
  pipelines reach them by name at call time, `pipeline_testa.library`), and the runtimes know nothing of search.
- No private name (`_x`) crosses a module boundary anywhere in the repository: neither imported from another module
  nor called on another module's objects (what another module needs is public).
- The app imports the library packages' exported names only (their `__all__`), never one of their modules.
- No file edits `sys.path`: `modeling_testa`, `processing` and `train` are installed packages, and the benchmarks run as
  modules from the repository root (`python -m benchmarks.<name>`).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from transformers.dynamic_module_utils import get_relative_imports

from modeling_testa import TestaVisionConfig, token_schedule


REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "modeling_testa"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
OUR_PACKAGES = ("modeling_testa", "testa_search", "testa_runtimes", "processing", "train", "benchmarks", "tests", "app",
                "video_llms")
SOURCE_DIRS = OUR_PACKAGES
SHIPPED_ENTRY_POINTS = ("modeling_testa", "pipeline_testa", "processing_testa", "video_processing_testa",
                        "configuration_testa", "modeling_testa_vision")
"""The modules a saved folder names in `auto_map` / `custom_pipelines`: the shipped code is their import closure."""


def _python_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py") if ".venv" not in p.parts)


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _relative_imports(path: Path) -> set[str]:
    """Sibling modules imported by `path` (anywhere in the file), as module names. Fails on non-flat imports."""
    imported = set()
    for node in ast.walk(_tree(path)):
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


def _shipped(graph: dict[str, set[str]]) -> set[str]:
    return set(SHIPPED_ENTRY_POINTS).union(*(_closure(graph, name) for name in SHIPPED_ENTRY_POINTS))


def _absolute_imports(path: Path) -> set[str]:
    """Top-level packages `path` imports absolutely (anywhere in the file)."""
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found


def test_shipped_code_imports_no_package_of_ours_and_the_packages_run_one_way():
    graph = _graph()
    shipped = _shipped(graph)
    assert {"modeling_testa", "pipeline_testa", "saving", "aggregation"} <= shipped
    assert not {"flops", "patching", "hub", "process_start", "visualization"} & shipped, sorted(shipped)
    for name in sorted(shipped):
        ours = _absolute_imports(PACKAGE / f"{name}.py") & set(OUR_PACKAGES)
        assert not ours, f"{name}.py ships in a Hub folder but imports {sorted(ours)}"
    for path in PACKAGE.glob("*.py"):
        upward = _absolute_imports(path) & {"testa_search", "testa_runtimes", "train", "processing", "app"}
        assert not upward, f"modeling_testa/{path.name} imports {sorted(upward)}: the packages use the model, not back"
    for path in (REPO / "testa_runtimes").rglob("*.py"):
        assert "testa_search" not in _absolute_imports(path), f"{path.relative_to(REPO)}: runtimes know no search"


def test_imports_are_flat_siblings_and_match_what_transformers_exports():
    graph = _graph()
    for name, imported in graph.items():
        assert imported <= set(MODULES), f"{name} imports {sorted(imported - set(MODULES))}, which are not siblings"
    # transformers finds the files to export with a regex over the source: for the exported code (the models, the
    # pipelines and what they import) it must see exactly the imports Python runs
    exported = {"modeling_testa", "pipeline_testa"}
    exported |= _closure(graph, "modeling_testa") | _closure(graph, "pipeline_testa")
    assert {"saving", "processing_testa", "video_processing_testa", "configuration_testa"} <= exported
    for name in sorted(exported | {"hub"}):
        assert set(get_relative_imports(PACKAGE / f"{name}.py")) == graph[name], name


def test_import_graph_has_no_cycle():
    graph = _graph()
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def test_dependencies_run_one_way():
    graph = _graph()
    model_side = _closure(graph, "modeling_testa")
    assert "pipeline_testa" not in model_side and "hub" not in model_side, sorted(model_side)
    assert not {"pipeline_testa", "hub"} & graph["modeling_testa"]
    # the encoder and the one TESTA block know nothing of the heads, the text side or the pipelines
    for low_level in ("aggregation", "aggregation_block", "modeling_testa_vision"):
        assert not {"modeling_testa", "pipeline_testa", "ranking", "momentum"} & _closure(graph, low_level), low_level
    # decoding knows nothing of the models
    assert not {"modeling_testa", "modeling_testa_vision"} & _closure(graph, "video_processing_testa")
    # the pipelines may use the models' processors and saving helpers, never the Hub export code
    assert "hub" not in _closure(graph, "pipeline_testa")
    # the export code depends on both
    assert {"modeling_testa", "pipeline_testa"} <= _closure(graph, "hub")
    # nothing but the package's __init__ depends on the export code
    assert [name for name, imported in graph.items() if "hub" in imported] == []


# ----------------------------------------------------------------------------------------------------------------------
# No private names across modules
# ----------------------------------------------------------------------------------------------------------------------

# Hooks that frameworks define and call by their private names (torch, transformers, pytest): not ours to rename.
FRAMEWORK_HOOKS = {
    "_init_weights", "_apply", "_load_from_state_dict", "_sanitize_parameters", "_forward", "_parameters", "_buffers",
    "_modules", "_attn_implementation", "_is_hf_initialized", "_auto_class", "_name_or_path", "_batch_size",
    "_preprocess_params", "_forward_params", "_postprocess_params", "_upload_modified_files", "_replace", "_asdict",
    "_fields", "_version", "_keys_to_ignore_on_save", "_get_name",
}


def _our_module(name: str | None) -> bool:
    return bool(name) and name.split(".")[0] in OUR_PACKAGES + tuple(MODULES)


def _private_definitions() -> set[str]:
    """Private function, method and class names defined anywhere in our code."""
    names = set()
    for path in _python_files():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
                if not node.name.startswith("__"):
                    names.add(node.name)
    return names - FRAMEWORK_HOOKS


def _private_crossings(path: Path, private: set[str], root: Path = REPO) -> list[str]:
    found = []
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or _our_module(node.module)):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr in private:
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            found.append(f"{path.relative_to(root)}:{node.lineno} uses .{node.attr} of another object")
    return sorted(found, key=lambda item: int(item.split(":")[1].split()[0]))


def test_checker_finds_private_crossings(tmp_path):
    """The checker itself, on a hand-written file."""
    bad = tmp_path / "bad.py"
    bad.write_text("from modeling_testa.ranking import _helper\nx = model._itm(1)\ny = self._itm(2)\n")
    found = _private_crossings(bad, {"_itm"}, root=tmp_path)
    assert found == ["bad.py:1 imports _helper", "bad.py:2 uses ._itm of another object"]


def test_no_private_name_crosses_a_module_boundary():
    private = _private_definitions()
    crossings = [item for path in _python_files() for item in _private_crossings(path, private)]
    assert crossings == [], "\n".join(crossings)


# ----------------------------------------------------------------------------------------------------------------------
# The app uses the library's public API
# ----------------------------------------------------------------------------------------------------------------------

LIBRARY_PACKAGES = ("modeling_testa", "testa_search", "testa_runtimes")


def _exported(package: str) -> set[str]:
    """The names `package/__init__.py` lists in `__all__` (read from the source)."""
    for node in ast.walk(_tree(REPO / package / "__init__.py")):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {element.value for element in node.value.elts}
    raise AssertionError(f"{package}/__init__.py has no __all__")


def _non_public_uses(path: Path, exported: dict[str, set[str]], root: Path = REPO) -> list[str]:
    """Where `path` reaches a library package other than by a name its `__all__` exports: a submodule imported
    (``from testa_search.encoding import x``, ``import modeling_testa.flops``), a name not exported, or an attribute of
    the imported package that it does not export (``testa_search.x``)."""
    found, bound = [], {}
    tree = _tree(path)
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            package = node.module.split(".")[0]
            if package not in exported:
                continue
            if node.module != package:
                found.append(f"{where} imports the module {node.module}")
                continue
            found += [f"{where} imports {alias.name}, which {package} does not export" for alias in node.names
                      if alias.name not in exported[package]]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in exported:
                    if "." in alias.name:
                        found.append(f"{where} imports the module {alias.name}")
                    else:
                        bound[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            if node.attr not in exported[bound[node.value.id]]:
                found.append(f"{path.relative_to(root)}:{node.lineno} uses {node.value.id}.{node.attr}, which "
                             "is not exported")
    return sorted(found, key=lambda item: int(item.split(":")[1].split()[0]))


def test_checker_finds_non_public_uses(tmp_path):
    """The checker itself, on a hand-written file."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport pkg\nimport pkg.inner\nfrom pkg.inner import x\nfrom pkg import a, b\n"
                   "from other.inner import y\nz = pkg.a + pkg.c + os.sep\n")
    assert _non_public_uses(bad, {"pkg": {"a"}}, root=tmp_path) == [
        "bad.py:3 imports the module pkg.inner", "bad.py:4 imports the module pkg.inner",
        "bad.py:5 imports b, which pkg does not export", "bad.py:7 uses pkg.c, which is not exported"]


def test_the_app_uses_only_the_names_the_library_packages_export():
    """`app/` is the library's first user: it imports `from modeling_testa import ...`, `from testa_search import
    ...`, `from testa_runtimes import ...` and nothing from their modules (nor from a command line's), so that what
    an application needs is public and the packages' insides can move."""
    exported = {package: _exported(package) for package in LIBRARY_PACKAGES}
    files = sorted((REPO / "app").rglob("*.py"))
    assert files, "no app/*.py"
    found = [item for path in files for item in _non_public_uses(path, exported)]
    assert found == [], "\n".join(found)
    for package, names in exported.items():  # every exported name is there
        module = __import__(package)
        assert not [name for name in names if not hasattr(module, name)], package


# ----------------------------------------------------------------------------------------------------------------------
# No sys.path edits
# ----------------------------------------------------------------------------------------------------------------------


def _sys_path_edits(path: Path, root: Path = REPO) -> list[str]:
    found = []
    for node in ast.walk(_tree(path)):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value  # sys.path.insert(...), sys.path.append(...)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t for t in targets if isinstance(t, (ast.Attribute, ast.Subscript))), None)
            target = target.value if isinstance(target, ast.Subscript) else target
        if (
            isinstance(target, ast.Attribute)
            and target.attr == "path"
            and isinstance(target.value, ast.Name)
            and target.value.id == "sys"
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(found, key=lambda item: int(item.split(":")[1]))


def test_checker_finds_sys_path_edits(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.path.insert(0, 'x')\nsys.path = []\nsys.path[0] = 'y'\nprint(sys.path)\n")
    assert _sys_path_edits(bad, root=tmp_path) == ["bad.py:2", "bad.py:3", "bad.py:4"]


def test_no_file_edits_sys_path():
    edits = [item for path in _python_files() for item in _sys_path_edits(path)]
    assert edits == [], "\n".join(edits)


# Run in a fresh interpreter in which Pillow, torchvision and the decoders cannot be found, as on a GPU machine that
# has torch and transformers only (benchmarks/gpu.py runs there).
WITHOUT_VISION_STACK = """
import sys

HIDDEN = {"PIL", "torchvision", "av", "decord", "faiss", "torchcodec"}


class Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [Hide(finder) for finder in sys.meta_path]
import torch
from modeling_testa import TestaConfig, TestaForVideoTextRetrieval, TestaVisionConfig, TestaVisionModel

vision = dict(num_frames=4, image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64, temporal_reduction=1, spatial_reduction=3)
video = torch.randn(1, 4, 3, 32, 32)
print(TestaVisionModel(TestaVisionConfig(**vision))(video).last_hidden_state.shape[1])
text = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
model = TestaForVideoTextRetrieval(TestaConfig(vision_config=vision, text_config=text, enc_token_id=119,
                                               dec_token_id=118, projection_dim=16))
print(tuple(model(input_ids=torch.randint(0, 118, (1, 5)), pixel_values=video).itm_score.shape))
print(sorted(name for name in ("PIL", "torchvision", "av", "decord") if name in sys.modules))
"""


def test_the_models_run_without_pillow_torchvision_and_the_decoders():
    result = subprocess.run([sys.executable, "-c", WITHOUT_VISION_STACK], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    frames, patches = token_schedule(TestaVisionConfig(num_frames=4, image_size=32, patch_size=8, hidden_size=32,
                                                       num_hidden_layers=2, num_attention_heads=4,
                                                       temporal_reduction=1, spatial_reduction=3))[-1]
    assert result.stdout.splitlines() == [str(1 + frames * patches), "(1, 2)", "[]"], result.stdout
