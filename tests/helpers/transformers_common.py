"""Loads transformers' own common test mixins (`ModelTesterMixin`, `ConfigTester`, `VideoProcessingTestMixin`,
`ProcessorTesterMixin`) from an unpacked transformers source distribution, unchanged, without copying them here.

The source distribution ships `tests/test_*_common.py` but not four helper files they import from the full git
checkout; this module registers small stand-ins for those (see `STAND_INS`) and says so. Nothing here edits
`sys.path`: the sdist's `tests/` folder is loaded as a package named `transformers_common_tests`.

`make test` fetches the sdist first (`python tests/helpers/transformers_common.py`: pip downloads it into `.cache/`
and unpacks its `tests/`); or point `TRANSFORMERS_SDIST_DIR` at an unpacked `transformers-<version>/` folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import transformers

PACKAGE = "transformers_common_tests"

# What the four helper files missing from the sdist provide, and what our stand-ins do instead.
STAND_INS = {
    "__init__": "tests/__init__.py: written empty, as it is in the git checkout",
    "exporters.test_export": "ExportTesterMixin: an empty mixin, so the torch.export tests are not run",
    "generation.test_utils": "GenerationTesterMixin: an empty mixin (the classes under test do not generate)",
    "utils.test_configuration_utils": "config_common_kwargs: five common config attributes instead of the full list",
    "fetch_hub_objects_for_ci": "url_to_local_path: the identity (tests that need a URL need the network)",
}


class ExportTesterMixin:
    """Stand-in for `tests/exporters/test_export.py` (not in the sdist): no export tests."""


class GenerationTesterMixin:
    """Stand-in for `tests/generation/test_utils.py` (not in the sdist): no generation tests."""


CONFIG_COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "chunk_size_feed_forward": 5,
    "problem_type": "regression",
}


CACHE = Path(__file__).resolve().parents[2] / ".cache"


def sdist_dir() -> Path | None:
    """The unpacked `transformers-<installed version>` folder: `$TRANSFORMERS_SDIST_DIR`, else `.cache/` of the repo."""
    env = os.environ.get("TRANSFORMERS_SDIST_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(CACHE / f"transformers-{transformers.__version__}")
    for candidate in candidates:
        if (candidate / "tests" / "test_modeling_common.py").is_file():
            return candidate
    return None


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def load_common_tests(root: Path) -> dict[str, types.ModuleType]:
    """Imports the sdist's common test modules from `root/tests` and returns them by file stem."""
    tests = root / "tests"
    init = tests / "__init__.py"
    if not init.exists():  # empty in the git checkout, left out of the sdist; the mixins import it by path
        init.write_text("")
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, tests / "__init__.py", submodule_search_locations=[str(tests)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = package  # the sdist's tests/ has no __init__.py: an empty namespace-like package
        for sub in ("exporters", "generation", "utils"):
            _module(f"{PACKAGE}.{sub}", __path__=[])
        _module(f"{PACKAGE}.exporters.test_export", ExportTesterMixin=ExportTesterMixin)
        _module(f"{PACKAGE}.generation.test_utils", GenerationTesterMixin=GenerationTesterMixin)
        _module(f"{PACKAGE}.utils.test_configuration_utils", config_common_kwargs=CONFIG_COMMON_KWARGS)
        _module("fetch_hub_objects_for_ci", url_to_local_path=lambda url, *args, **kwargs: url)
    names = ("test_configuration_common", "test_modeling_common", "test_video_processing_common",
             "test_processing_common")
    return {name: importlib.import_module(f"{PACKAGE}.{name}") for name in names}


def common_tests_or_skip() -> dict[str, types.ModuleType]:
    """`load_common_tests` of the sdist `sdist_dir` finds, for a test module at import: without one, the module is
    skipped (failed under ``CI=true``) with the command that fetches it."""
    from helpers.requirements import skip_or_fail  # (not at the top: this file also runs as a script)

    root = sdist_dir()
    if root is None:
        skip_or_fail(f"no transformers {transformers.__version__} source distribution",
                     "python tests/helpers/transformers_common.py  (it downloads one with pip; or set "
                     "TRANSFORMERS_SDIST_DIR)", allow_module_level=True)
    return load_common_tests(root)


def fetch_sdist(cache: Path = CACHE) -> Path:
    """Downloads the installed version's source distribution with pip and unpacks its `tests/` into `cache`."""
    target = cache / f"transformers-{transformers.__version__}"
    if (target / "tests" / "test_modeling_common.py").is_file():
        return target
    with tempfile.TemporaryDirectory() as download:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-binary", ":all:", f"transformers=={transformers.__version__}", "-d", download],
                       check=True)
        (archive,) = Path(download).glob("transformers-*.tar.gz")
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{target.name}/tests/")]
            tar.extractall(cache, members=members, filter="data")
    return target


def main() -> int:
    """Fetches the sdist. A failure is a warning (the module is then skipped), or an error under `CI=true`."""
    try:
        print(f"transformers' common tests: {fetch_sdist()}")
    except (subprocess.CalledProcessError, ValueError, OSError) as error:
        command = " ".join(error.cmd) if isinstance(error, subprocess.CalledProcessError) else "unpacking the sdist"
        ci = os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
        print(f"{'error' if ci else 'warning'}: could not fetch the transformers {transformers.__version__} source "
              f"distribution ({error}); the command was: {command}. tests/test_transformers_common.py "
              + ("cannot run, and CI=true fails instead of skipping it." if ci else "will be skipped."),
              file=sys.stderr)
        return 1 if ci else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
