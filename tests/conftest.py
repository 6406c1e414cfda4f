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


# tests/test_engines.py runs last. In a full run (not alone, not after any one other file) the pytest process once
# died of a segmentation fault in a later test (tests/test_loop.py) after the OpenVINO runtime had run in it;
# faulthandler printed nothing, so a native library had replaced its handler. Running the engine tests after every
# other test keeps the rest of the suite out of that process state (see the closing note of issue 31).
LAST = ("test_engines.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in LAST)  # stable: the order within each group is kept

