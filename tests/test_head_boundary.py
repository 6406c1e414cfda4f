"""The heads own what they compute: outside the heads' files, no code reads a head's text decoder, matching head or
temperature (`.text_decoder`, `.itm_head`, `.temp`); it calls the heads' public methods instead (`generate`,
`generate_from_question`, `answer_log_likelihoods`, `itm_logits`, `logit_scale`, `device`).

The boundary: the heads' files are `modeling_testa/modeling_testa.py` (the heads) and `modeling_testa/contrastive.py`
(their contrastive training component). Everything else that uses a model is checked: the rest of the package
(ranking, cross-encoder, pipelines, indexing, inference, converters, ...), `train/`, `app/`, `benchmarks/` and
`processing/`. The tests are not: they inspect the modules on purpose (e.g. that weights are tied). State-dict keys
written as strings (``"itm_head.weight"``, in the converters) are names, not reads, and are allowed.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAD_FILES = {REPO / "modeling_testa" / "modeling_testa.py", REPO / "modeling_testa" / "contrastive.py"}
CHECKED_DIRS = ("modeling_testa", "train", "app", "benchmarks", "processing")
HEAD_INTERNALS = ("text_decoder", "itm_head", "temp")


def internal_reads(path: Path) -> list[str]:
    """``file:line .name`` of every attribute access of a head internal in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [f"{path.name}:{node.lineno} .{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in HEAD_INTERNALS]


def checked_files() -> list[Path]:
    files = sorted(p for d in CHECKED_DIRS for p in (REPO / d).rglob("*.py") if ".venv" not in p.parts)
    return [p for p in files if p not in HEAD_FILES]


def test_nothing_outside_the_heads_reads_their_decoder_matching_head_or_temperature():
    files = checked_files()
    assert REPO / "modeling_testa" / "pipeline_testa.py" in files and REPO / "modeling_testa" / "ranking.py" in files
    assert any(p.parent.name == "train" for p in files) and any(p.parent.name == "app" for p in files)
    found = [read for path in files for read in internal_reads(path)]
    assert found == [], "read the heads' public methods instead: " + ", ".join(found)


def test_the_scan_catches_a_planted_read(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def answer(pipe, model, states):\n"
        "    out = model.text_decoder.generate(input_ids=states)\n"
        "    scale = pipe.model.temp.detach()\n"
        "    device = model.itm_head.weight.device\n"
        "    key = 'itm_head.weight'  # a state-dict key: a name, not a read\n"
        "    return out, scale, device, key, model.temperature, model.template\n"
    )
    assert internal_reads(planted) == ["planted.py:2 .text_decoder", "planted.py:3 .temp", "planted.py:4 .itm_head"]
