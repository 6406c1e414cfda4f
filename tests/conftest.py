import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # read by gradio at import (tests/test_app.py)

import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import fork_guard  # noqa: E402

# The fork guard (`helpers/fork_guard.py`), for this process and every Python process a test starts (through
# `sitecustomize` on PYTHONPATH): a test during which one of them forks with other threads alive fails.
FORK_RECORDS = tempfile.mkdtemp(prefix="testa-fork-guard-")
os.environ[fork_guard.ENV] = FORK_RECORDS
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fork_guard.SITE), os.environ.get("PYTHONPATH")]))
fork_guard.install()
_reported: set[str] = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The test's call fails when a fork with threads alive was recorded since the last check (its setup included:
    a module fixture's forks count against the first test that uses it)."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call":
        return
    found = {name: record for name, record in fork_guard.records(FORK_RECORDS).items() if name not in _reported}
    _reported.update(found)
    # a fork with no frame of ours on its stack (a library's own thread) is reported beside the test, not failed
    new = {name: record for name, record in found.items() if record.get("ours", True)}
    theirs = [record for record in found.values() if not record.get("ours", True)]
    if theirs:
        report.sections.append(("fork guard: forks taken by a library's own thread",
                                "\n\n".join(map(fork_guard.describe, theirs))))
    if new and not report.failed:
        report.outcome = "failed"
        report.longrepr = (f"{len(new)} fork(s) with other threads alive during this test (a forked child can "
                           "deadlock; see tests/helpers/fork_guard.py):\n\n"
                           + "\n\n".join(map(fork_guard.describe, new.values())))
    elif new:
        report.sections.append(("fork guard", "\n\n".join(map(fork_guard.describe, new.values()))))


def pytest_unconfigure(config):
    shutil.rmtree(FORK_RECORDS, ignore_errors=True)


def pytest_configure(config):
    # markers that transformers' own common test mixins use (tests/test_transformers_common.py runs them)
    for marker in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                   "torch_compile_test"):
        config.addinivalue_line("markers", f"{marker}: used by transformers' common tests")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
