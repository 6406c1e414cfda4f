"""The demo's short-event task (processing/short_events.py) and the demo's equal-compute check (train/demo.py)."""

import json
import re
import sys
from pathlib import Path

import av
import numpy as np
import pytest

from processing import load_split
from processing.short_events import COLOURS, caption, main, make_videos, seen_flashes

REPO = Path(__file__).resolve().parents[1]
VOCAB = REPO / "modeling_testa" / "vocab.txt"


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("short_events")
    summary = main(["--output-dir", str(out), "--num-videos", "16", "--seed", "2", "--num-workers", "1",
                    "--no-progress"])
    assert summary["videos"] == {"train": 12, "test": 4}
    assert summary["chance_r1"] == 0.25 and summary["scene_only_r1"] == 0.25
    return out


def test_rewriting_a_smaller_dataset_removes_only_its_own_stale_videos(tmp_path):
    """A second, smaller run into the same folder (2 workers: the process pool) leaves exactly its own videos plus
    files that are not generated videos."""
    for count in (8, 4):
        main(["--output-dir", str(tmp_path), "--num-videos", str(count), "--num-workers", "2", "--no-progress"])
        if count == 8:
            (tmp_path / "videos" / "notes.mp4").write_text("not ours")
    rows = [json.loads(line) for split in ("train", "test") for line in (tmp_path / f"{split}.jsonl").open()]
    assert sorted(p.name for p in (tmp_path / "videos").iterdir()) == sorted(
        [Path(row["video"]).name for row in rows] + ["notes.mp4"])
    assert len(rows) == 4


def test_deterministic_and_unique():
    first, second = make_videos(64, seed=4), make_videos(64, seed=4)
    assert [caption(v) for v in first] == [caption(v) for v in second]
    assert [caption(v) for v in make_videos(64, seed=5)] != [caption(v) for v in first]
    signatures = [caption(v) for v in first]
    assert len(set(signatures)) == len(signatures)


def test_events_are_short_and_families_differ_only_in_flashes():
    videos = make_videos(200, seed=1)
    families = {}
    for v in videos:
        assert 96 <= v.num_frames <= 144
        assert v.scenes[0].start == 0 and v.scenes[-1].end == v.num_frames
        assert all(a.end == b.start and a.colour != b.colour for a, b in zip(v.scenes, v.scenes[1:]))
        assert 2 <= len(v.flashes) <= 3
        for scene in v.scenes:
            assert len(scene.flashes) <= 2
            for flash in scene.flashes:
                assert scene.start < flash.start < flash.end < scene.end  # inside, one frame clear of the edges
                length = (flash.end - flash.start) / v.num_frames
                assert length < 1 / 8 and length >= 1 / 20 - 1 / v.num_frames  # short events (rounded to frames)
                assert flash.colour != scene.colour
            assert all(a.end < b.start for a, b in zip(scene.flashes, scene.flashes[1:]))
        families.setdefault(v.family, []).append(v)
    for members in families.values():
        assert len({tuple(s.colour for s in m.scenes) for m in members}) == 1  # same scenes
        assert len({tuple(f.colour for f in m.flashes) + tuple(f.start for f in m.flashes) for m in members}) == len(
            members)
        assert len({m.split for m in members}) == 1


def test_flash_visibility_follows_uniform_sampling():
    """A hand-worked case: 100 frames, uniform sampling of 8 takes frames 6, 18, 31, 43, 56, 68, 81, 93."""
    from processing.short_events import Flash, Scene, ShortEventVideo

    video = ShortEventVideo("v", "test", 0, 4, 64, 100, [
        Scene("red", 0, 50, [Flash("blue", 7, 12), Flash("green", 28, 33)]),
        Scene("white", 50, 100, [Flash("yellow", 60, 70)]),
    ])
    assert seen_flashes(video, 8) == [False, True, True]  # frame 31 is in [28, 33), 68 in [60, 70)
    assert seen_flashes(video, 16) == [True, True, True]  # 16 frames: 3, 9, 15, ..., 9 is in [7, 12)
    share = [np.mean([s for v in make_videos(128, seed=0) for s in seen_flashes(v, t)]) for t in (8, 16, 32)]
    assert share[0] < 0.75 and share[1] > 0.9 and share[2] == 1.0


def test_captions_are_whole_bert_tokens_and_name_every_event(dataset_dir):
    vocab = set(VOCAB.read_text(encoding="utf-8").split("\n"))
    meta = {v["video_id"]: v for v in json.loads((dataset_dir / "metadata.json").read_text())["videos"]}
    for split in ("train", "test"):
        for row in load_split(str(dataset_dir), split):
            words = set(re.findall(r"[a-z]+|[.]", row["text"]))
            assert words <= vocab, words - vocab
            video = meta[row["video_id"]]
            expected = []
            for scene in video["scenes"]:
                expected.append(scene["colour"])
                expected += [f["colour"] for f in scene["flashes"]]
            assert re.findall(r"(\w+) square flashes|screen is (\w+)", row["text"]) and [
                a or b for a, b in re.findall(r"a (\w+) square flashes|screen is (\w+)", row["text"])] == expected


def test_pixels_match_the_metadata(dataset_dir):
    """Decoded frames: the scene colour at the border, the flash colour in the middle during a flash only."""
    palette = np.array(list(COLOURS.values()), dtype=np.float32)
    names = list(COLOURS)

    def nearest(pixels):
        return names[int(np.argmin(((palette - pixels.reshape(-1, 3).mean(0)) ** 2).sum(-1)))]

    videos = json.loads((dataset_dir / "metadata.json").read_text())["videos"]
    for video in videos[:4]:
        with av.open(str(dataset_dir / video["video"])) as container:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.float32)
        assert len(frames) == video["num_frames"]
        for scene in video["scenes"]:
            flash_frames = {t for f in scene["flashes"] for t in range(f["start"], f["end"])}
            for t in range(scene["start"] + 1, scene["end"] - 1):
                assert nearest(frames[t, :8, :8]) == scene["colour"]
                middle = frames[t, 24:40, 24:40]
                if t in flash_frames:
                    flash = next(f for f in scene["flashes"] if f["start"] <= t < f["end"])
                    assert nearest(middle) == flash["colour"], (video["video_id"], t)
                elif t - 1 not in flash_frames and t + 1 not in flash_frames:
                    assert nearest(middle) == scene["colour"], (video["video_id"], t)
        assert video["seen_by"]["32"] == [True] * sum(len(s["flashes"]) for s in video["scenes"])


def test_dataset_card_states_the_chance_levels(dataset_dir):
    card = (dataset_dir / "README.md").read_text()
    assert "random R@1 = 1/4" in card and "scene-only R@1 = 1/4" in card
    assert re.search(r"T=8: \d+%, T=16: \d+%, T=32: 100%", card)


def test_argument_errors():
    with pytest.raises(ValueError, match="max_flash"):
        make_videos(8, max_flash=0.2)
    with pytest.raises(ValueError, match="two flashes per scene"):
        make_videos(8, num_scenes=1, max_flashes=3)
    with pytest.raises(ValueError, match="num_videos"):
        make_videos(0)


def test_demo_variants_are_at_equal_compute():
    """(b) has 2x the frames of (a) at GMAC within 10% (counted by the FLOP counter), (c) costs about 2x."""
    from train.demo import VARIANTS, check_equal_compute, load_recipe

    recipe = load_recipe()
    costs = check_equal_compute(recipe)
    assert VARIANTS["b"].num_frames == 2 * VARIANTS["a"].num_frames == VARIANTS["c"].num_frames
    assert abs(costs["b"][0] / costs["a"][0] - 1) <= 0.10
    assert costs["c"][0] / costs["a"][0] > 1.9
    assert costs["b"][1] < costs["a"][1] < costs["c"][1]  # tokens after aggregation
    heavier = dict(recipe)
    heavier["model"] = dict(recipe["model"], vision_config=dict(recipe["model"]["vision_config"], hidden_size=512,
                                                                intermediate_size=2048, num_attention_heads=8))
    with pytest.raises(ValueError, match="GMAC of \\(a\\)"):
        check_equal_compute(heavier, tolerance=0.001)


def test_demo_refuses_quick_with_upper_bound(tmp_path):
    """--quick trains (a) and (b) only: asking for (c) too is an error that names both flags, before any work."""
    import subprocess

    result = subprocess.run([sys.executable, str(REPO / "train" / "demo.py"), "--quick", "--upper-bound",
                             "--output-dir", str(tmp_path / "demo")], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert "--quick" in result.stderr and "--upper-bound" in result.stderr
    assert not (tmp_path / "demo_quick").exists()


@pytest.mark.slow
def test_demo_quick_runs_end_to_end(tmp_path):
    """`train/demo.py --quick` (about 2 minutes): data, two training runs, evaluation, the table."""
    import subprocess

    out = tmp_path / "demo"
    subprocess.run([sys.executable, str(REPO / "train" / "demo.py"), "--quick", "--output-dir", str(out)], check=True,
                   cwd=REPO, timeout=900)
    quick = tmp_path / "demo_quick"
    result = json.loads((quick / "demo_results.json").read_text())
    assert set(result["results"]) == {"a", "b"}
    assert "not meaningful" in (quick / "demo_results.md").read_text()
    assert (quick / "runs" / "b" / "final" / "model.safetensors").is_file()
