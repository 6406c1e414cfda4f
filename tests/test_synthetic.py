"""The synthetic long-form dataset: determinism, durations, captions that need the whole timeline, QA answers that
follow from the captions, pixels that match the captions, and loading with `datasets`."""

import json
import os
import re
from collections import defaultdict
from pathlib import Path

import av
import numpy as np
import pytest

from processing import load_split
from processing.synthetic import ACTION_ANSWERS, ACTIONS, COLOURS, NUMBER_WORDS, SHAPES, main, make_specs

NUM_VIDEOS = 16
VOCAB = Path(__file__).resolve().parents[1] / "modeling_testa" / "vocab.txt"


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    summary = main(["--output-dir", str(out), "--num-videos", str(NUM_VIDEOS), "--seed", "3", "--no-progress"])
    assert summary["videos"] == {"train": 8, "val": 4, "test": 4}
    return out


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def decode(path):
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    return frames, fps


def all_rows(directory, prefix=""):
    return {s: read_jsonl(Path(directory) / f"{prefix}{s}.jsonl") for s in ("train", "val", "test")}


def metadata(directory):
    return {v["video_id"]: v for v in json.loads((Path(directory) / "metadata.json").read_text())["videos"]}


def test_schema_and_relative_paths(dataset_dir):
    for split, rows in all_rows(dataset_dir).items():
        assert rows, split
        for row in rows:
            assert list(row) == ["video", "text", "video_id"]
            assert row["video"] == f"videos/{row['video_id']}.mp4"  # relative to the dataset directory
            assert (dataset_dir / row["video"]).is_file()
    for split, rows in all_rows(dataset_dir, "qa_").items():
        assert len(rows) == 4 * len(all_rows(dataset_dir)[split])
        assert all(list(r) == ["video", "question", "answer", "video_id"] for r in rows)


def test_deterministic(dataset_dir, tmp_path):
    main(["--output-dir", str(tmp_path), "--num-videos", str(NUM_VIDEOS), "--seed", "3", "--no-progress",
          "--num-workers", "2"])
    for name in ("train.jsonl", "val.jsonl", "test.jsonl", "qa_train.jsonl", "qa_val.jsonl", "qa_test.jsonl",
                 "metadata.json", "README.md"):
        assert (tmp_path / name).read_bytes() == (dataset_dir / name).read_bytes(), name
    for video_id in metadata(dataset_dir):
        a, _ = decode(dataset_dir / "videos" / f"{video_id}.mp4")
        b, _ = decode(tmp_path / "videos" / f"{video_id}.mp4")
        assert np.array_equal(a, b), video_id
    # another seed gives other captions
    other = [r["text"] for r in make_specs_texts(seed=4)]
    assert other != [r["text"] for r in make_specs_texts(seed=3)]


def make_specs_texts(seed):
    from processing.synthetic import paragraph

    return [{"text": paragraph(s.events)} for s in make_specs(NUM_VIDEOS, seed=seed)]


def test_durations_and_frame_counts(dataset_dir):
    for video_id, video in metadata(dataset_dir).items():
        frames, fps = decode(dataset_dir / video["video"])
        assert fps == video["fps"] == 2
        assert frames.shape == (video["num_frames"], 96, 96, 3)
        assert 30.0 <= len(frames) / fps <= 120.0, video_id
        events = video["events"]
        assert 3 <= len(events) <= 6
        assert events[0]["start"] == 0 and events[-1]["end"] == video["num_frames"]
        assert all(a["end"] == b["start"] for a, b in zip(events, events[1:]))
        # every event spans more than 1/8 of the video: 8 uniformly spread frames see every event
        assert min(e["end"] - e["start"] for e in events) > video["num_frames"] / 8, video_id


def test_captions_need_the_whole_timeline(dataset_dir):
    meta = metadata(dataset_dir)
    rows = [r for split in all_rows(dataset_dir).values() for r in split]
    texts = [r["text"] for r in rows]
    assert len(set(texts)) == len(texts)  # no two paragraphs identical
    sentences = {r["video_id"]: re.findall(r"[^.]+\.", r["text"]) for r in rows}
    for video_id, s in sentences.items():
        assert len(s) == len(meta[video_id]["events"])
    # families: same split, shared first (or last) sentences, different paragraphs
    families = defaultdict(list)
    for video_id, video in meta.items():
        families[video["family"]].append(video_id)
    shared_first = shared_last = 0
    for members in families.values():
        assert len({meta[m]["split"] for m in members}) == 1
        firsts = {sentences[m][0] for m in members}
        lasts = {sentences[m][-1] for m in members}
        if meta[members[0]]["shared"] == "prefix":
            assert len(firsts) == 1
            shared_first += 1
        else:
            assert len(lasts) == 1
            shared_last += 1
    assert shared_first and shared_last
    # so in the test split several videos share their opening sentence: its first sentence alone cannot retrieve it
    test_firsts = [sentences[r["video_id"]][0] for r in all_rows(dataset_dir)["test"]]
    test_lasts = [sentences[r["video_id"]][-1] for r in all_rows(dataset_dir)["test"]]
    assert len(set(test_firsts)) < len(test_firsts) or len(set(test_lasts)) < len(test_lasts)


def test_vocabulary_is_whole_bert_tokens(dataset_dir):
    vocab = set(VOCAB.read_text(encoding="utf-8").split("\n"))
    words = set()
    for split in all_rows(dataset_dir).values():
        for r in split:
            words |= set(re.findall(r"[a-z]+|[.,?]", r["text"]))
    for split in all_rows(dataset_dir, "qa_").values():
        for r in split:
            words |= set(re.findall(r"[a-z]+|[.,?]", r["question"] + " " + r["answer"]))
    assert words and words <= vocab, words - vocab


SENTENCE = re.compile(r"(first,|then|finally,) an? (\w+) (\w+) (.+)\.$")
PHRASES = {v: k for k, v in ACTIONS.items() if "{" not in v}


def parse_paragraph(text):
    """Events (colour, shape, action answer) recovered from the caption text alone."""
    events = []
    for sentence in re.findall(r"[^.]+\.", text):
        lead, colour, shape, phrase = SENTENCE.match(sentence.strip()).groups()
        if phrase.startswith("turns "):
            action = f"turns {phrase.split()[1]}"
        else:
            action = ACTION_ANSWERS[PHRASES[phrase]]
        events.append((colour, shape, action))
    return events


def answer_from_caption(question, events):
    names = [f"the {c} {s}" for c, s, _ in events]
    if question == "how many events happen in the video?":
        return NUMBER_WORDS[len(events)]
    if question == "what shape appears first?":
        return events[0][1]
    if question == "what shape appears last?":
        return events[-1][1]
    if question == "what colour is the last shape?":
        return events[-1][0]
    if question == "which shape moves last?":
        return [e for e in events if e[2].startswith("moves")][-1][1]
    m = re.fullmatch(r"what shape appears (after|before) (the \w+ \w+)\?", question)
    if m:
        i = names.index(m.group(2))
        return events[i + 1 if m.group(1) == "after" else i - 1][1]
    m = re.fullmatch(r"what colour is the shape after (the \w+ \w+)\?", question)
    if m:
        return events[names.index(m.group(1)) + 1][0]
    m = re.fullmatch(r"what does (the \w+ \w+) do\?", question)
    if m:
        return events[names.index(m.group(1))][2]
    m = re.fullmatch(r"what colour does (the \w+ \w+) turn\?", question)
    if m:
        return events[names.index(m.group(1))][2].split()[1]
    raise AssertionError(f"unexpected question {question!r}")


def test_qa_answers_follow_from_the_captions(dataset_dir):
    texts = {r["video_id"]: r["text"] for split in all_rows(dataset_dir).values() for r in split}
    kinds = set()
    for split in all_rows(dataset_dir, "qa_").values():
        for qa in split:
            events = parse_paragraph(texts[qa["video_id"]])
            assert answer_from_caption(qa["question"], events) == qa["answer"], qa
            kinds.add(re.sub(r"the \w+ \w+", "X", qa["question"]))
    assert len(kinds) >= 6  # several kinds of temporal questions


def test_pixels_match_the_captions(dataset_dir):
    """The shape's colour, and the direction of motion / size change, are visible in the decoded frames."""
    palette = np.array(list(COLOURS.values()), dtype=np.float32)
    names = list(COLOURS)
    for video_id, video in list(metadata(dataset_dir).items())[:6]:
        frames, _ = decode(dataset_dir / video["video"])
        for e in video["events"]:
            early, late = e["start"] + 1, e["end"] - 2

            def stats(t):
                pixels = frames[t].astype(np.float32)
                mask = np.abs(pixels - np.array([20, 20, 28])).sum(-1) > 60
                assert mask.sum() > 10, (video_id, e, t)
                colour = names[int(np.argmin(((palette - pixels[mask].mean(0)) ** 2).sum(-1)))]
                ys, xs = np.nonzero(mask)
                return colour, xs.mean(), ys.mean(), mask.sum()

            c0, x0, y0, a0 = stats(early)
            c1, x1, y1, a1 = stats(late)
            assert c0 == e["colour"], (video_id, e)
            assert c1 == (e["to_colour"] if e["action"] == "turns" else e["colour"]), (video_id, e)
            if e["action"] == "moves_right":
                assert x1 > x0 + 20
            elif e["action"] == "moves_left":
                assert x1 < x0 - 20
            elif e["action"] == "moves_down":
                assert y1 > y0 + 20
            elif e["action"] == "moves_up":
                assert y1 < y0 - 20
            elif e["action"] == "grows":
                assert a1 > 3 * a0
            elif e["action"] == "shrinks":
                assert a0 > 3 * a1
            else:
                assert abs(x1 - x0) < 2 and abs(y1 - y0) < 2


def test_loads_with_datasets(dataset_dir):
    import datasets

    stream = datasets.load_dataset("json", data_files=str(dataset_dir / "train.jsonl"), split="train",
                                   streaming=True)
    assert [r["video_id"] for r in stream] == [r["video_id"] for r in read_jsonl(dataset_dir / "train.jsonl")]
    qa = datasets.load_dataset("json", data_files=str(dataset_dir / "qa_test.jsonl"), split="train")
    assert qa.column_names == ["video", "question", "answer", "video_id"]
    # the dataset card's configs: load_dataset(DIR) is retrieval, load_dataset(DIR, "qa") is QA
    card = datasets.load_dataset(str(dataset_dir))
    assert {k: v.num_rows for k, v in card.items()} == {"train": 8, "validation": 4, "test": 4}
    assert datasets.load_dataset(str(dataset_dir), "qa", split="validation").num_rows == 16
    # load_split resolves the relative paths, also when streaming
    for streaming in (False, True):
        rows = list(load_split(str(dataset_dir), "val", streaming=streaming))
        assert len(rows) == 4
        assert all(os.path.isabs(r["video"]) and os.path.isfile(r["video"]) for r in rows)


def test_argument_errors():
    with pytest.raises(ValueError, match="max_events"):
        make_specs(8, max_events=7)
    with pytest.raises(ValueError, match="cannot be split"):
        make_specs(2, family_size=1, val_fraction=0.5, test_fraction=0.5)
    assert set(SHAPES) and len(make_specs(5, family_size=2)) == 5
