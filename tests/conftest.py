import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # read by gradio at import (tests/test_app.py)

import pytest  # noqa: E402
import torch  # noqa: E402



def pytest_configure(config):
    # markers that transformers' own common test mixins use (tests/test_transformers_common.py runs them)
    for marker in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                   "torch_compile_test"):
        config.addinivalue_line("markers", f"{marker}: used by transformers' common tests")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# tests/test_engines.py runs in its own pytest process (`make test` runs it second). In one process with the rest of
# the suite, the process once died of a segmentation fault in a later test (tests/test_loop.py), and, with the engine
# tests moved last, at interpreter exit after every test had passed: the OpenVINO runtime that ran in-process and
# the state of the other tests do not mix (neither alone crashes; faulthandler printed nothing, so a native library
# had replaced its handler). Alone, or with any one other test file, it passes and exits cleanly. Within a run that
# does include it, it still goes last. tests/test_runtime_agreement.py runs OpenVINO too: it goes with it.
LAST = ("test_engines.py", "test_runtime_agreement.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in LAST)  # stable: the order within each group is kept
