"""Parity with the released TESTA code: ``frame_matching="original"`` and converted checkpoints.

The reference is ``released_reference.py``, an independent float64 re-statement of the released encoder (loops over
positions and tokens, the released ``[CLS, (position, frame)]`` layout). ``benchmarks/parity_with_released.py`` runs
the released code itself against this library; its numbers are in docs/parity.md.
"""

import json

import pytest
import torch
from helpers.models import ENC
from helpers.released_reference import released_encoder
from helpers.original_checkpoints import GRID, HEADS, TEXT_OVERRIDES, original_config, original_state

from modeling_testa.aggregation import geometry_matching, mode
from modeling_testa.convert_original_testa import convert_original_testa
from modeling_testa.convert_original_testa import main as original_main


# ------------------------------------------------------------------------------------------------------ mode


def test_mode_is_cpu_torch_mode_with_ties_and_the_minimum_of_distinct_values():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.long):
        x = torch.randint(0, 4, (5, 7, 6), generator=g).to(dtype)  # many ties
        for dim in (0, 1, -1):
            torch.testing.assert_close(mode(x, dim), torch.mode(x, dim).values)
    distinct = torch.randn(4, 9, 3, generator=g)
    torch.testing.assert_close(mode(distinct, 1), distinct.min(dim=1).values)
    assert mode(torch.tensor([3.0, 1.0, 1.0, 3.0, 2.0])) == 1.0  # two values twice each: the smaller wins


# -------------------------------------------------------------------------------------- frame rule, by hand


def _unit(angle_degrees: float) -> list[float]:
    angle = torch.tensor(angle_degrees, dtype=torch.float64).deg2rad()
    return [float(angle.cos()), float(angle.sin())]


def test_original_frame_rule_differs_from_the_mean_vote_on_a_hand_worked_case():
    """Four frames (A = 0, 2; B = 1, 3) seen at three patch positions; one frame pair merges (r = 1).

    Every token is a direction in the plane (degrees below), so cosines are easy to work out:

    * frame 0 is 5 and 10 degrees from frame 1 at positions 0 and 1 (cosine 0.996, 0.985) but 80 degrees at
      position 2 (0.174); frame 3 is farther everywhere. Best similarities: 0.996, 0.985, 0.174.
    * frame 2 is 50, 48 and 52 degrees from frame 3 (0.643, 0.669, 0.616) and farther from frame 1.

    The values are distinct, so ``torch.mode`` is their minimum:

    * "original": frame 0 scores 0.174, frame 2 scores 0.616, so frame 2 merges into frame 3.
    * "vote": frame 0 scores the mean similarity to frame 1, 0.718 > 0.643, so frame 0 merges into frame 1.
    """
    frame_keys = {  # position -> directions of [frame 0, frame 1, frame 2, frame 3]
        0: [0, 5, 100, 150],
        1: [0, 10, 102, 150],
        2: [0, 80, 200, 252],
    }
    metric = torch.tensor([[_unit(a) for a in angles] for angles in frame_keys.values()])  # (P=3, T=4, C=2)
    original = geometry_matching(metric[None], 1, vote_dim=-3, vote="original")
    voted = geometry_matching(metric[None], 1, vote_dim=-3, vote="vote")
    # Output order is [unmerged A, B]: slot 0 is the kept A frame, slots 1 and 2 are frames 1 and 3.
    assert original.sources.tolist() == [[2]] and original.targets.tolist() == [[2]]  # frame 2 -> frame 3
    assert original.kept.tolist() == [[0, 1, 3]]
    assert voted.sources.tolist() == [[0]] and voted.targets.tolist() == [[1]]  # frame 0 -> frame 1
    assert voted.kept.tolist() == [[2, 1, 3]]


# ------------------------------------------------------------------------------------- converted checkpoints

FRAMES = 8
SCHEDULE = [2, 3, 1, 2]  # the released interleaved testa_r: block 0 merges 2 frames and 3 patches, block 1 1 and 2
FRAMES_OUT, PATCHES_OUT = 8 - 2 - 1, 16 - 3 - 2


def _videos(seed: int, batch: int = 2) -> torch.Tensor:
    """Slowly changing videos: neighbouring frames are similar, so frame merges are real choices."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, 1, 3, GRID * 8, GRID * 8, generator=g)
    drift = torch.randn(batch, FRAMES, 3, GRID * 8, GRID * 8, generator=g).cumsum(dim=1) * 0.3
    return base + drift


def _released_tokens(state: dict, video: torch.Tensor) -> torch.Tensor:
    vision = {k[len("visual_encoder."):]: v for k, v in state.items() if k.startswith("visual_encoder.")}
    return released_encoder(vision, video, SCHEDULE[0::2], SCHEDULE[1::2], HEADS)


def _in_released_order(tokens: torch.Tensor, frames: int) -> torch.Tensor:
    """Our ``[CLS, (frame, position)]`` output in the released ``[CLS, (position, frame)]`` order."""
    patches = tokens[1:].view(frames, -1, tokens.shape[-1]).transpose(0, 1).reshape(-1, tokens.shape[-1])
    return torch.cat([tokens[:1], patches])


@pytest.fixture(scope="module")
def checkpoint() -> dict:
    state = original_state(seed=3)
    return {"model": state, "config": original_config(testa_r=SCHEDULE, num_frames=FRAMES)}


def _convert(checkpoint: dict, **kwargs):
    model, report = convert_original_testa(checkpoint, text_config=TEXT_OVERRIDES, enc_token_id=ENC, **kwargs)
    return model.vision_model.double(), report


@torch.no_grad()
def test_converted_checkpoint_defaults_to_the_released_rule_and_computes_what_it_computes(checkpoint):
    vision, report = _convert(checkpoint)
    assert vision.config.frame_matching == "original" and report.frame_matching == "original"
    assert "released code's rule" in report.summary()
    compared = 0
    for seed in range(4):
        video = _videos(seed)
        out = vision(video.double())
        assert out.last_hidden_state.shape[1] == 1 + FRAMES_OUT * PATCHES_OUT
        for b in range(video.shape[0]):
            reference = _released_tokens(checkpoint["model"], video[b])
            ours = _in_released_order(out.last_hidden_state[b], FRAMES_OUT)
            torch.testing.assert_close(ours, reference, atol=1e-9, rtol=1e-9)
            compared += 1
    assert compared == 8


@torch.no_grad()
def test_other_frame_rules_do_not_reproduce_the_released_code(checkpoint):
    """The parity test above can fail: with the paper's mean or the mean-score vote, some merged frames differ."""
    differs = {}
    for rule in ("mean", "vote"):
        vision, report = _convert(checkpoint, frame_matching=rule)
        assert "not the released code's rule" in report.summary()
        worst = 0.0
        for seed in range(4):
            video = _videos(seed)
            out = vision(video.double())
            for b in range(video.shape[0]):
                reference = _released_tokens(checkpoint["model"], video[b])
                ours = _in_released_order(out.last_hidden_state[b], FRAMES_OUT)
                worst = max(worst, float((ours - reference).abs().max()))
        differs[rule] = worst
    assert all(worst > 1e-3 for worst in differs.values()), differs


def test_converter_rejects_unknown_frame_rules_and_non_testa_files(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="frame_matching.*'mode'.*original"):
        convert_original_testa(checkpoint, frame_matching="mode")
    image_only = {k: v for k, v in checkpoint["model"].items() if "temporal" not in k and "time_embed" not in k}
    path = tmp_path / "blip_image.pth"
    torch.save({"model": image_only}, path)
    with pytest.raises(ValueError, match=r"blip_image\.pth.*convert_blip_to_testa"):
        convert_original_testa(path)
    torch.save({"model": {"encoder.weight": torch.zeros(2)}}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match=r"other\.pth has no `visual_encoder"):
        convert_original_testa(tmp_path / "other.pth")
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        convert_original_testa(tmp_path / "missing.pth")


def test_converter_cli_writes_the_frame_rule(tmp_path, checkpoint, capsys, monkeypatch):
    path = tmp_path / "testa.pth"
    torch.save(checkpoint, path)
    monkeypatch.setattr(
        "modeling_testa.convert_original_testa.convert_original_testa",
        lambda *a, **k: convert_original_testa(*a, text_config=TEXT_OVERRIDES, enc_token_id=ENC, **k),
    )
    original_main(["--checkpoint", str(path), "--output-dir", str(tmp_path / "default")])
    assert "frame_matching='original'" in capsys.readouterr().out
    original_main(["--checkpoint", str(path), "--output-dir", str(tmp_path / "vote"), "--frame-matching", "vote"])
    assert "frame_matching='vote'" in capsys.readouterr().out
    assert json.loads((tmp_path / "default" / "config.json").read_text())["vision_config"]["frame_matching"] == "original"
    assert json.loads((tmp_path / "vote" / "config.json").read_text())["vision_config"]["frame_matching"] == "vote"
    # ... and the model card says which rule the folder runs.
    assert "the released TESTA code's own rule" in (tmp_path / "default" / "README.md").read_text()
    assert "not the released code's rule" in (tmp_path / "vote" / "README.md").read_text()
