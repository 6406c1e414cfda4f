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
