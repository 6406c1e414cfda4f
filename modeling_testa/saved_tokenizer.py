"""The tokenizer settings of a saved folder, written by the model's and the processor's `save_pretrained` alike:
its own module so that a folder of either ships no code of the other."""

import json
import os
from pathlib import Path


def cap_tokenizer_length(save_directory: str | os.PathLike, limit: int) -> None:
    """Caps `model_max_length` in the folder's `tokenizer_config.json` (when there is one) at `limit`, the text
    encoder's `max_position_embeddings`: generic code (Sentence Transformers' `max_seq_length`) reads it there."""
    path = Path(save_directory) / "tokenizer_config.json"
    if not path.is_file():
        return
    settings = json.loads(path.read_text(encoding="utf-8"))
    current = settings.get("model_max_length")
    if not isinstance(current, (int, float)) or current > limit:
        settings["model_max_length"] = int(limit)
        path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def text_limit_in(save_directory: str | os.PathLike) -> int | None:
    """`text_config.max_position_embeddings` of a TESTA `config.json` already saved in the folder, or None."""
    path = Path(save_directory) / "config.json"
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["text_config"]["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
