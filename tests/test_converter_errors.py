"""The converters' command lines stop with one line naming the file and what was expected, as `train.index` does,
not a traceback (issue 52); a file that is not a tensors-only checkpoint never gets torch's advice to load it with
``weights_only=False`` (which would run its code). Through their `main(argv)`, on real files."""

import collections

import pytest
import torch

from modeling_testa.convert_blip_to_testa import main as blip_main
from modeling_testa.convert_original_testa import main as original_main


class NotATensor:  # pickled by reference: `weights_only=True` refuses it
    pass


def one_line_error(command, argv: list) -> str:
    with pytest.raises(SystemExit) as stopped:
        command([str(arg) for arg in argv])
    message = str(stopped.value)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_bad_checkpoints_get_one_line_naming_the_file_and_what_was_expected(tmp_path):
    text = tmp_path / "notes.pth"
    text.write_text("these are my notes, renamed .pth\n")
    objects = tmp_path / "objects.pth"
    torch.save({"model": {"w": torch.zeros(1)}, "extra": NotATensor(), "order": collections.OrderedDict()}, objects)
    expected = {
        text: "is not a PyTorch checkpoint: expected a file written by torch.save (a zip archive or a pickle), but "
              "it begins with b'thes'",
        objects: "cannot be read as tensors and plain values (torch.load with weights_only=True: Unsupported global",
        tmp_path / "nowhere.pth": "does not exist",
    }
    for path, reason in expected.items():
        message = one_line_error(original_main, ["--checkpoint", path, "--output-dir", tmp_path / "out"])
        assert str(path) in message and reason in message, message
        assert "weights_only=False" not in message and "will likely succeed" not in message
    assert not (tmp_path / "out").exists()

    folder = tmp_path / "not_blip"
    folder.mkdir()
    message = one_line_error(blip_main, ["--blip", folder, "--num-frames", "4", "--output-dir", tmp_path / "out"])
    assert f"{str(folder)!r} is not a BLIP checkpoint folder or Hub id (expected a config.json of " in message
