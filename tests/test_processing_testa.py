"""Tests of TestaProcessor: the BERT-uncased + [DEC]/[ENC] tokenizer, task text lengths, caption cleaning, saving,
Auto* registration and loading as Hub remote code where `modeling_testa` cannot be imported."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers.videos import read_index, write_video

import modeling_testa
from modeling_testa import TestaConfig, TestaProcessor, TestaVideoProcessor, build_testa_tokenizer, pre_caption
from modeling_testa.processing_testa import TASK_TEXT_SETTINGS, VOCAB_FILE


@pytest.fixture(scope="module")
def processor():
    return TestaProcessor()


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("proc") / "clip.mp4", 30, fps=15, width=176, height=144)


def test_shipped_vocab_is_bert_base_uncased():
    lines = VOCAB_FILE.read_text(encoding="utf-8").split("\n")
    lines = lines[:-1] if lines[-1] == "" else lines
    assert len(lines) == 30522
    # token id = line number - 1
    assert (lines[0], lines[100], lines[101], lines[102], lines[103], lines[1996], lines[2678]) == (
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "video")


def test_tokenizer_ids_and_special_tokens(processor):
    tok = processor.tokenizer
    assert len(tok) == 30524
    ids = tok.convert_tokens_to_ids(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "video", "[DEC]", "[ENC]"])
    assert ids == [0, 100, 101, 102, 103, 1996, 2678, 30522, 30523]
    assert tok.bos_token == "[DEC]" and tok.bos_token_id == 30522 == processor.dec_token_id
    assert tok.enc_token_id == 30523 == processor.enc_token_id
    assert tok.cls_token_id == 101 and tok.sep_token_id == 102 and tok.pad_token_id == 0


def test_tokenizes_like_bert_uncased(processor):
    tok = processor.tokenizer
    assert tok("The VIDEO")["input_ids"] == [101, 1996, 2678, 102]  # lower-cased
    assert tok.tokenize("I have a new GPU!") == ["i", "have", "a", "new", "gp", "##u", "!"]  # WordPiece
    assert tok.tokenize("Café") == ["cafe"]  # accents stripped
    assert tok.tokenize("a man [ENC] runs") == ["a", "man", "[ENC]", "runs"]  # special tokens are atomic
    assert tok.decode(tok("Hello, World!")["input_ids"], skip_special_tokens=True) == "hello, world!"


def test_build_tokenizer_uses_the_given_vocab_file(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s"]) + "\n")
    tok = build_testa_tokenizer(vocab)
    assert len(tok) == 10 and tok.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [8, 9]
    assert tok("Hello worlds")["input_ids"] == [2, 5, 6, 7, 3]
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        build_testa_tokenizer(tmp_path / "nope.txt")


def test_processor_outputs(processor, video):
    out = processor(text=["A man runs.", "Two dogs play in the snow"], videos=[video, video], num_frames=4)
    assert set(out.keys()) == {"input_ids", "attention_mask", "pixel_values"}  # no token_type_ids
    assert out["input_ids"].shape == out["attention_mask"].shape == (2, 8)  # padded to the longest
    assert out["input_ids"][0].tolist()[:2] == [101, 1037] and out["attention_mask"][0].sum() == 6
    assert out["pixel_values"].shape == (2, 4, 3, 224, 224) and out["pixel_values"].dtype == torch.float32
    assert set(processor(text="hi").keys()) == {"input_ids", "attention_mask"}
    only_video = processor(videos=video, num_frames=3, return_metadata=True, do_resize=False, do_rescale=False,
                           do_normalize=False)
    assert set(only_video.keys()) == {"pixel_values", "video_metadata"}
    assert only_video["video_metadata"][0].frames_indices == [5, 15, 25]
    assert [read_index(f.permute(1, 2, 0).numpy()) for f in only_video["pixel_values"][0]] == [5, 15, 25]
    assert processor.model_input_names == ["input_ids", "attention_mask", "pixel_values"]


@pytest.mark.parametrize("task,length", [("queryd", 128), ("didemo", 64), ("activitynet", 64),
                                         ("condensed_movies", 32), ("pretrain", 30)])
def test_task_text_lengths(processor, task, length):
    long_paragraph = " ".join(["word"] * 300)
    out = processor(text=[long_paragraph, "short"], task=task)
    assert out["input_ids"].shape == (2, length)  # truncated and padded to the task's max_length
    assert out["input_ids"][0, -1] == 102 and out["attention_mask"][1].sum() == 3
    assert TASK_TEXT_SETTINGS[task]["max_length"] == length
    # explicit arguments win over the task's
    assert processor(text=long_paragraph, task=task, max_length=16)["input_ids"].shape == (1, 16)
    assert processor(text="short", task=task, padding="longest")["input_ids"].shape == (1, 3)


def test_default_text_settings(processor):
    assert processor(text=" ".join(["word"] * 300))["input_ids"].shape == (1, 64)
    assert processor(text=["a b", "a b c d"])["input_ids"].shape == (2, 6)
    assert processor(text="a b c", task="activitynet_qa")["input_ids"].shape == (1, 5)  # VQA questions: longest


def test_pre_caption_matches_the_original_rules():
    assert pre_caption('A man (in red) said: "Hi!"  ~ #1\n') == "a man in red said: hi 1"
    assert pre_caption("Keep dots. And; colons:") == "keep dots. and; colons:"  # TESTA keeps . ; :
    assert pre_caption("one two three four", max_words=2) == "one two"
    assert pre_caption("  Multiple\n\n   spaces*here  ") == "multiple spaces here"


def test_clean_text_option(processor):
    raw = 'THE (red) car!!! ' + " ".join(["w"] * 80)
    cleaned = processor(text=raw, clean_text=True, task="activitynet")
    expected = processor(text=pre_caption(raw, 50), task="activitynet")
    assert torch.equal(cleaned["input_ids"], expected["input_ids"])
    assert cleaned["attention_mask"].sum() == 2 + 50  # 50 words kept; "(" ")" "!" removed
    assert not torch.equal(cleaned["input_ids"], processor(text=raw, task="activitynet")["input_ids"])


def test_bad_processor_input(processor):
    with pytest.raises(ValueError, match="text.*videos"):
        processor()
    with pytest.raises(ValueError, match="empty list"):
        processor(text=[])
    with pytest.raises(ValueError, match="empty list"):
        processor(videos=[])
    with pytest.raises(ValueError, match="list of strings"):
        processor(text=[1, 2])
    with pytest.raises(ValueError, match="Unknown task"):
        processor(text="a", task="msrvtt")


def test_registration():
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING

    assert PROCESSOR_MAPPING[TestaConfig] is TestaProcessor
    assert TestaVideoProcessor in dict(VIDEO_PROCESSOR_MAPPING[TestaConfig]).values()
    assert TestaProcessor._auto_class == "AutoProcessor"
    assert TestaVideoProcessor._auto_class == "AutoVideoProcessor"


def test_save_load_and_remote_code(tmp_path, processor, video):
    from transformers import AutoProcessor

    folder = tmp_path / "testa-processor"
    custom = TestaProcessor(video_processor=TestaVideoProcessor(num_frames=6, resize_mode="shortest_edge"))
    custom.save_pretrained(folder)
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["processing_testa.py", "processor_config.json", "saved_tokenizer.py", "tokenizer.json",
                     "tokenizer_config.json", "video_decoding.py", "video_decoding_worker.py", "video_inputs.py",
                     "video_processing_testa.py", "worker_process.py"]
    config = json.loads((folder / "processor_config.json").read_text())
    assert config["auto_map"] == {"AutoProcessor": "processing_testa.TestaProcessor"}
    assert config["video_processor"]["auto_map"]["AutoVideoProcessor"] == "video_processing_testa.TestaVideoProcessor"
    assert config["video_processor"]["num_frames"] == 6

    text = ["A dog (catches) a frisbee!", "the video"]
    expected = custom(text=text, videos=[video, video], task="didemo", clean_text=True)
    loaded_processors = [TestaProcessor.from_pretrained(folder), AutoProcessor.from_pretrained(folder, trust_remote_code=True)]
    for loaded in loaded_processors:
        assert len(loaded.tokenizer) == 30524 and loaded.enc_token_id == 30523 and loaded.dec_token_id == 30522
        assert loaded.video_processor.num_frames == 6
        got = loaded(text=text, videos=[video, video], task="didemo", clean_text=True)
        for key in ("input_ids", "attention_mask", "pixel_values"):
            assert torch.equal(got[key], expected[key]), key

    # Hub-style remote code: a fresh interpreter outside the repo, where `modeling_testa` cannot be imported
    np.save(tmp_path / "expected_ids.npy", expected["input_ids"].numpy())
    torch.save(expected["pixel_values"], tmp_path / "expected_pixels.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["modeling_testa"] = None  # not importable here (run outside the repository: not on the path either)
        try:
            import modeling_testa
            raise SystemExit("modeling_testa must not be importable here")
        except ImportError:
            pass
        import numpy as np, torch
        from transformers import AutoProcessor, AutoVideoProcessor
        proc = AutoProcessor.from_pretrained({str(folder)!r}, trust_remote_code=True)
        assert type(proc).__module__.startswith("transformers_modules"), type(proc).__module__
        assert type(proc.video_processor).__module__.startswith("transformers_modules")
        out = proc(text={text!r}, videos=[{str(video)!r}] * 2, task="didemo", clean_text=True)
        assert np.array_equal(out["input_ids"].numpy(), np.load({str(tmp_path / "expected_ids.npy")!r}))
        assert torch.equal(out["pixel_values"], torch.load({str(tmp_path / "expected_pixels.pt")!r}))
        vp = AutoVideoProcessor.from_pretrained({str(folder)!r}, trust_remote_code=True)
        assert type(vp).__name__ == "TestaVideoProcessor" and vp.num_frames == 6
        print("REMOTE-OK", type(proc).__module__)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "REMOTE-OK transformers_modules" in result.stdout


def test_package_exports():
    for name in ("TestaProcessor", "TestaVideoProcessor", "build_testa_tokenizer", "pre_caption", "decode_video",
                 "VideoDecodingError", "sample_frame_indices"):
        assert name in modeling_testa.__all__ and hasattr(modeling_testa, name)


def test_saved_task_and_clean_text_apply_unless_a_call_says_otherwise(tmp_path):
    """Issue #24: `task`/`clean_text` of a call default to None, so the processor's saved settings apply."""
    folder = tmp_path / "settings"
    TestaProcessor(task="condensed_movies", clean_text=True).save_pretrained(folder)
    config = json.loads((folder / "processor_config.json").read_text())
    assert config["task"] == "condensed_movies" and config["clean_text"] is True
    loaded = TestaProcessor.from_pretrained(folder)
    raw = "The (red) CAR stops!"
    out = loaded(text=raw)
    # cleaned ("the red car stops") and padded to Condensed Movies' 32 tokens
    assert out["input_ids"].shape == (1, 32) and out["attention_mask"].sum() == 6
    tokens = loaded.tokenizer.convert_ids_to_tokens(out["input_ids"][0, :6].tolist())
    assert tokens == ["[CLS]", "the", "red", "car", "stops", "[SEP]"]
    assert out["input_ids"][0, 6:].tolist() == [0] * 26
    raw_out = loaded(text=raw, clean_text=False, task="activitynet_qa")  # explicit arguments win: kept, longest
    assert loaded.tokenizer.convert_ids_to_tokens(raw_out["input_ids"][0].tolist()) == [
        "[CLS]", "the", "(", "red", ")", "car", "stops", "!", "[SEP]"]
    assert TestaProcessor()(text=raw)["input_ids"].shape == (1, 9)  # defaults: no cleaning, longest
    with pytest.raises(ValueError, match="Unknown task='msrvtt'"):
        TestaProcessor(task="msrvtt")
    with pytest.raises(ValueError, match="`clean_text` must be True or False"):
        TestaProcessor(clean_text="yes")


def test_save_and_load_keeps_to_dict_exactly(tmp_path):
    """Issue #24: `auto_map` (export metadata) is written to the saved files but is no setting, so saving does not
    change `to_dict` and the loaded processor has the same `to_dict` as the saved one."""
    from transformers import AutoProcessor

    processor = TestaProcessor(video_processor=TestaVideoProcessor(num_frames=6, fps=None), task="didemo")
    before = processor.to_dict()
    assert "auto_map" not in before and "auto_map" not in before["video_processor"]
    processor.save_pretrained(tmp_path)
    assert processor.to_dict() == before
    for loaded in (TestaProcessor.from_pretrained(tmp_path), AutoProcessor.from_pretrained(tmp_path,
                                                                                           trust_remote_code=True)):
        assert loaded.to_dict() == before
        assert loaded.video_processor.to_dict() == processor.video_processor.to_dict()
    config = json.loads((tmp_path / "processor_config.json").read_text())
    assert config["auto_map"] == {"AutoProcessor": "processing_testa.TestaProcessor"}
    assert config["video_processor"]["auto_map"] == {"AutoVideoProcessor": "video_processing_testa.TestaVideoProcessor"}
