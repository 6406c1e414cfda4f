"""What a saved folder ships is the model (issue 50): counted from real `save_pretrained` folders.

A retrieval, pre-training or QA folder carries the model, its processors and the pipelines' `__call__` paths, at most
22 Python files and 9,000 lines; the vision model alone at most 10 files and 4,000 lines. The search system and the
runtimes (packages `testa_search`, `testa_runtimes`) are never in a folder: the pipelines import them at call time.
"""

from pathlib import Path

import pytest

from modeling_testa import TestaForPreTraining, TestaForVideoQA, TestaForVideoTextRetrieval, TestaVisionModel

from helpers.models import tiny_config, tiny_vision_config


REPO = Path(__file__).resolve().parents[1]
NEVER_SHIPPED = {p.name for d in ("testa_search", "testa_runtimes") for p in (REPO / d).rglob("*.py")}
NEVER_SHIPPED |= {"flops.py", "patching.py", "hub.py", "process_start.py", "visualization.py", "visualize.py",
                  "convert_blip_to_testa.py", "convert_original_testa.py", "grounding.py", "cross_encoder.py"}


def _python_files(folder: Path) -> tuple[int, int, set[str]]:
    files = sorted(folder.glob("*.py"))
    return len(files), sum(len(f.read_text(encoding="utf-8").splitlines()) for f in files), {f.name for f in files}


@pytest.mark.parametrize("head", [TestaForVideoTextRetrieval, TestaForPreTraining, TestaForVideoQA])
def test_a_saved_head_ships_at_most_22_files_and_9000_lines(tmp_path, head):
    head(tiny_config()).save_pretrained(tmp_path)
    count, lines, names = _python_files(tmp_path)
    assert {"modeling_testa.py", "pipeline_testa.py", "processing_testa.py", "video_processing_testa.py"} <= names
    assert count <= 22 and lines <= 9000, (count, lines, sorted(names))
    assert not names & NEVER_SHIPPED, sorted(names & NEVER_SHIPPED)
    # a name of a moved module in a shipped folder would be a stale copy: every file is one of the package's
    assert names <= {p.name for p in (REPO / "modeling_testa").glob("*.py")}


def test_the_vision_model_alone_ships_at_most_10_files_and_4000_lines(tmp_path):
    TestaVisionModel(tiny_vision_config()).save_pretrained(tmp_path)
    count, lines, names = _python_files(tmp_path)
    assert "modeling_testa_vision.py" in names
    assert count <= 10 and lines <= 4000, (count, lines, sorted(names))
    # no processor, decoder or pipeline code comes in with the encoder
    assert not names & {"processing_testa.py", "video_decoding.py", "pipeline_testa.py", "worker_process.py"}, names
