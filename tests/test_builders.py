"""Every builder on a tiny fixture in its dataset's format, with exact expected rows; the build's guarantees (missing
videos reported once per video, failing loudly, nothing half-written, one-line errors); the video compressor.

The fixtures that reproduce each public release in detail are in ``test_builders_releases.py``."""

import csv
import json
import os
import pickle

import pytest

from processing import builders, load_split
from processing.builders import AnnotationError, MediaError, OptionError, build, pre_caption, pre_question


def touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\x00")
    return path


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_pre_caption_matches_the_original():
    # lower-case; !"()*#~ become spaces; runs of 2+ spaces collapse; '.', ',', ':' and "'" are kept
    assert pre_caption('A (Man)  Plays* "Guitar"! It\'s loud: yes.', 50) == "a man plays guitar it's loud: yes."
    assert pre_caption("one two three four", 2) == "one two"
    assert pre_caption("  ~padded~  \n") == "padded"


def test_pre_question_matches_the_original():
    assert pre_question("What Is He Doing?.") == "what is he doing?"
    assert pre_question("a b c d", 3) == "a b c"


def test_queryd(tmp_path):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    ann.mkdir()
    captions = {
        "video-aaa": [["A", "man", "walks", "."], ["He", "(slowly)", "sits", "down", "."]],
        "video-bbb": [["Dogs", "run"]],
        "video-ccc": [["a", "cat"]],
    }
    with open(ann / "raw_captions_combined_filtered.pkl", "wb") as f:
        pickle.dump(captions, f)
    (ann / "exists_train_list.txt").write_text("video-aaa\nvideo-bbb\n")
    (ann / "exists_test_list.txt").write_text("video-ccc\n")
    touch(str(vids / "video-aaa"))  # QuerYD videos have no extension
    touch(str(vids / "video-bbb.mp4"))
    reports = build("queryd", str(ann), str(vids), str(out), splits=["train", "test"], allow_missing=True,
                    progress=False)
    # no times file: the sentences stay in file order, and the report says so
    assert read_jsonl(out / "train.jsonl") == [
        {"video": str(vids / "video-aaa"), "text": "a man walks . he slowly sits down .", "video_id": "video-aaa",
         "sentences": ["A man walks .", "He (slowly) sits down ."]},
        {"video": str(vids / "video-bbb.mp4"), "text": "dogs run", "video_id": "video-bbb", "sentences": ["Dogs run"]},
    ]
    assert reports["train"].details["sentence_order"] == "file (no times file)"
    # the test video is missing: reported once, listed with its rows, dropped; the split is empty -> allowed here
    assert read_jsonl(out / "test.jsonl") == []
    assert reports["test"].missing_videos == 1 and reports["test"].missing_examples == [
        {"video_id": "video-ccc", "rows": 1, "path": str(vids / "video-ccc")}]
    assert (out / "missing_test.tsv").read_text().splitlines()[1] == f"video-ccc\t1\t{vids / 'video-ccc'}"
    assert json.loads((out / "build_report.json").read_text())["splits"]["test"]["missing_videos"] == 1


def test_queryd_word_limit_is_128_words(tmp_path):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    ann.mkdir()
    with open(ann / "raw_captions_combined_filtered.pkl", "wb") as f:
        pickle.dump({"v": [[f"w{i}" for i in range(100)], [f"x{i}" for i in range(100)]]}, f)
    (ann / "exists_train_list.txt").write_text("v\n")
    touch(str(vids / "v"))
    build("queryd", str(ann), str(vids), str(out), splits=["train"], progress=False)
    words = read_jsonl(out / "train.jsonl")[0]["text"].split(" ")
    assert len(words) == 128 and words[-1] == "x27"


def test_didemo_testa_jsonl_raw_caption_and_eval_dedup(tmp_path):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    ann.mkdir()
    lines = [
        {"clip_name": "111@N00_1", "caption": "The Man (left) waves.  Then he runs!"},
        {"clip_name": "222@N00_2", "caption": "A dog."},
        {"clip_name": "111@N00_1", "caption": "Another paragraph."},
    ]
    for split in ("train", "test"):
        (ann / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    touch(str(vids / "111@N00_1.mp4"))
    touch(str(vids / "222@N00_2.mp4"))
    reports = build("didemo", str(ann), str(vids), str(out), splits=["train", "test"], progress=False)
    v1, v2 = str(vids / "111@N00_1.mp4"), str(vids / "222@N00_2.mp4")
    # the paper feeds DiDeMo paragraphs raw (no pre_caption); train keeps every row
    assert read_jsonl(out / "train.jsonl") == [
        {"video": v1, "text": "The Man (left) waves.  Then he runs!", "video_id": "111@N00_1"},
        {"video": v2, "text": "A dog.", "video_id": "222@N00_2"},
        {"video": v1, "text": "Another paragraph.", "video_id": "111@N00_1"},
    ]
    # evaluation keeps the first row of every clip, as the original eval dataset does
    assert read_jsonl(out / "test.jsonl") == [
        {"video": v1, "text": "The Man (left) waves.  Then he runs!", "video_id": "111@N00_1"},
        {"video": v2, "text": "A dog.", "video_id": "222@N00_2"},
    ]
    assert reports["test"].duplicates_dropped == 1 and reports["train"].duplicates_dropped == 0
    assert reports["test"].format == "testa_jsonl" and reports["train"].videos == 2


def test_activitynet_converted_line0_list_and_test_uses_val(tmp_path):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    ann.mkdir()
    val = [
        {"video": "v_abc.mp4", "caption": ["A woman (in red) dances.", " She stops!"]},
        {"video": "v_def.mp4", "caption": ["Word " * 60]},
    ]
    # TESTA's converted files are JSON lines whose line 0 holds the list
    (ann / "val.json").write_text(json.dumps(val) + "\n")
    touch(str(vids / "v_abc.mp4"))
    touch(str(vids / "v_def.mp4"))
    reports = build("activitynet", str(ann), str(vids), str(out), splits=["test"], progress=False)
    rows = read_jsonl(out / "test.jsonl")
    assert rows[0] == {"video": str(vids / "v_abc.mp4"), "text": "a woman in red dances. she stops",
                       "video_id": "v_abc"}
    assert rows[1]["text"] == " ".join(["word"] * 50)  # default 50 words
    assert len(rows) == 2 and reports["test"].format == "converted"


def test_condensed_movies_challenge_csv_split_filter_and_mkv(tmp_path):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    (ann / "metadata").mkdir(parents=True)
    with open(ann / "metadata" / "train_val_challf0.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["videoid", "caption", "split", "imdbid"])
        w.writerow(["abcDEF123", "Rick tells Ilsa, \"Here's looking at you\".", "train", "tt0034583"])
        w.writerow(["xyz", "Val clip.", "val", "tt1"])
        w.writerow(["nofile", "Missing clip.", "train", "tt2"])
    touch(str(vids / "abcDEF123.mkv"))
    touch(str(vids / "xyz.mkv"))
    reports = build("condensed_movies", str(ann), str(vids), str(out), splits=["train", "val"], missing="keep",
                    progress=False)
    assert read_jsonl(out / "train.jsonl") == [
        {"video": str(vids / "abcDEF123.mkv"), "text": "rick tells ilsa, here's looking at you .",
         "video_id": "abcDEF123"},
        # --missing keep: kept with its expected path, and reported
        {"video": str(vids / "nofile.mkv"), "text": "missing clip.", "video_id": "nofile"},
    ]
    assert reports["train"].missing_videos == 1 and reports["train"].rows == 2
    assert read_jsonl(out / "val.jsonl") == [{"video": str(vids / "xyz.mkv"), "text": "val clip.", "video_id": "xyz"}]


def test_activitynet_qa_join_and_webm_fallback(tmp_path):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    (ann / "annos").mkdir(parents=True)
    questions = [
        {"question_id": "v_aaa_1", "question": "What Is The Man Holding.", "video_name": "aaa"},
        {"question_id": "v_bbb_2", "question": "is it indoors", "video_name": "bbb"},
    ]
    answers = [{"question_id": "v_bbb_2", "answer": "yes", "type": 3},
               {"question_id": "v_aaa_1", "answer": "guitar", "type": 1}]
    (ann / "annos" / "train_q.json").write_text(json.dumps(questions))
    (ann / "annos" / "train_a.json").write_text(json.dumps(answers))
    touch(str(vids / "v_aaa.mp4"))
    touch(str(vids / "v_bbb.webm"))
    build("activitynet_qa", str(ann), str(vids), str(out), splits=["train"], progress=False)
    assert read_jsonl(out / "qa_train.jsonl") == [
        {"video": str(vids / "v_aaa.mp4"), "question": "what is the man holding", "answer": "guitar",
         "video_id": "v_aaa", "question_id": "v_aaa_1"},
        {"video": str(vids / "v_bbb.webm"), "question": "is it indoors", "answer": "yes", "video_id": "v_bbb",
         "question_id": "v_bbb_2"},
    ]
    ds = load_split(str(out), "train", task="qa")
    assert ds[1]["answer"] == "yes" and ds[1]["video"] == str(vids / "v_bbb.webm")


def test_activitynet_qa_missing_answer_names_the_file(tmp_path):
    ann, vids = tmp_path / "ann", tmp_path / "videos"
    ann.mkdir()
    vids.mkdir()
    (ann / "val_q.json").write_text(json.dumps([{"question_id": 7, "question": "q", "video_name": "a"}]))
    (ann / "val_a.json").write_text(json.dumps([]))
    with pytest.raises(AnnotationError, match="val_a.json.*question_id 7"):
        build("activitynet_qa", str(ann), str(vids), str(tmp_path / "out"), splits=["val"], progress=False)


def test_webvid_csv_page_dir_parquet_shards(tmp_path):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    ann.mkdir()
    with open(ann / "results_2M_train.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["videoid", "name", "page_idx", "page_dir", "duration", "contentUrl"])  # the release's columns
        for i in range(5):
            w.writerow([str(1000 + i), f"Clip ({i}) of a Cat!", "27732", "001_050", "PT00H00M10S",
                        f"https://x/{i}.mp4"])
    for i in range(4):
        touch(str(vids / "001_050" / f"{1000 + i}.mp4"))
    reports = build("webvid", str(ann), str(vids), str(out), fmt="parquet", num_shards=2, relative_paths=True,
                    allow_missing=True, progress=False)
    assert reports["train"].rows == 4 and reports["train"].missing_videos == 1
    assert reports["train"].missing_examples[0]["path"] == str(vids / "001_050" / "1004.mp4")
    assert sorted(os.listdir(out)) == ["README.md", "build_report.json", "missing_train.tsv",
                                       "train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    import pyarrow.parquet as pq

    shard0 = pq.read_table(out / "train-00000-of-00002.parquet").to_pylist()
    # round-robin: rows 0 and 2 in shard 0; paths relative to the output directory
    assert shard0 == [
        {"video": "../videos/001_050/1000.mp4", "text": "clip 0 of a cat", "video_id": "1000"},
        {"video": "../videos/001_050/1002.mp4", "text": "clip 2 of a cat", "video_id": "1002"},
    ]
    ds = load_split(str(out), "train")
    assert sorted(ds["video_id"]) == ["1000", "1001", "1002", "1003"]
    assert all(p == str(vids / "001_050" / f"{i}.mp4") for p, i in zip(ds["video"], ds["video_id"]))
    import datasets

    card = datasets.load_dataset(str(out), split="train")  # the dataset card's configs make the directory loadable
    assert card.num_rows == 4


def test_parquet_keeps_sentences_timestamps_and_duration(tmp_path):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    ann.mkdir()
    (ann / "val_1.json").write_text(json.dumps({
        "v_a": {"duration": 12, "timestamps": [[5, 12], [0, 4.5]], "sentences": ["B.", "A."]},
        "v_b": {"duration": 3.5, "timestamps": [[0, 3]], "sentences": ["C."]},
    }))
    touch(str(vids / "v_a.mp4"))
    touch(str(vids / "v_b.mp4"))
    build("activitynet", str(ann), str(vids), str(out), splits=["test"], fmt="parquet", progress=False)
    rows = load_split(str(out), "test").to_list()
    assert rows[0] == {"video": str(vids / "v_a.mp4"), "video_id": "v_a", "text": "a. b.", "sentences": ["A.", "B."],
                       "timestamps": [[0.0, 4.5], [5.0, 12.0]], "duration": 12.0}
    assert rows[1]["timestamps"] == [[0.0, 3.0]] and rows[1]["duration"] == 3.5


def _img2dataset_shard(images, rows):
    """An img2dataset `files` shard 00000: the parquet table and the images of the rows with status success."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"url": u, "key": k, "status": s} for u, k, s in rows]),
                   images / "00000.parquet")
    for _, key, status in rows:
        if status == "success":
            touch(str(images / "00000" / f"{key}.jpg"))


def test_cc3m_tsv_with_img2dataset_layout(tmp_path):
    ann, imgs, out = tmp_path / "ann", tmp_path / "images", tmp_path / "out"
    ann.mkdir()
    (ann / "Train_GCC-training.tsv").write_text(
        "a dog (brown) on grass\thttp://img/a.jpg\n"
        "actor attends the premiere\thttp://img/b.jpg\n"
        "failed download\thttp://img/c.jpg\n"
    )
    _img2dataset_shard(imgs, [("http://img/a.jpg", "000000000", "success"),
                              ("http://img/b.jpg", "000000001", "success"),
                              ("http://img/c.jpg", "000000002", "failed_to_download")])
    reports = build("cc3m", str(ann), str(imgs), str(out), allow_missing=True, progress=False)
    assert read_jsonl(out / "train.jsonl") == [
        {"image": str(imgs / "00000" / "000000000.jpg"), "text": "a dog brown on grass", "image_id": "000000000"},
        {"image": str(imgs / "00000" / "000000001.jpg"), "text": "actor attends the premiere",
         "image_id": "000000001"},
    ]
    assert reports["train"].missing_videos == 1 and reports["train"].missing_examples[0]["path"] == "http://img/c.jpg"


@pytest.mark.parametrize("header", ["caption\turl\n", "url\tcaption\n"])
def test_cc3m_header_line_of_img2dataset_guide(tmp_path, header):
    """img2dataset's CC3M guide adds `caption<TAB>url`: it is not a row, and flat indices do not shift."""
    ann, imgs, out = tmp_path / "ann", tmp_path / "images", tmp_path / "out"
    ann.mkdir()
    first, second = ("first\thttp://u/1\n", "second\thttp://u/2\n") if header.startswith("caption") else \
        ("http://u/1\tfirst\n", "http://u/2\tsecond\n")
    (ann / "Validation_GCC-1.1.0-Validation.tsv").write_text(header + first + second)
    touch(str(imgs / "0.jpg"))
    touch(str(imgs / "1.jpg"))
    build("cc3m", str(ann), str(imgs), str(out), splits=["val"], image_layout="flat", progress=False)
    assert read_jsonl(out / "val.jsonl") == [
        {"image": str(imgs / "0.jpg"), "text": "first", "image_id": "0"},
        {"image": str(imgs / "1.jpg"), "text": "second", "image_id": "1"},
    ]


def test_cc3m_webdataset_shards_are_refused_with_what_to_run(tmp_path):
    ann, imgs, out = tmp_path / "ann", tmp_path / "images", tmp_path / "out"
    ann.mkdir()
    (ann / "Train_GCC-training.tsv").write_text("caption\turl\na cat\thttp://u/1\n")
    _img2dataset_shard(imgs, [])
    (imgs / "00000.tar").write_bytes(b"")  # --output_format webdataset
    with pytest.raises(MediaError, match=r"webdataset shards \(00000.tar, 1 in all\).*--output_format files.*tar -xf"):
        build("cc3m", str(ann), str(imgs), str(out), progress=False)
    assert not out.exists()
    # extracted into a folder of its name, the shard reads as the files layout
    _img2dataset_shard(imgs, [("http://u/1", "000000000", "success")])
    build("cc3m", str(ann), str(imgs), str(out), progress=False)
    assert read_jsonl(out / "train.jsonl")[0]["image"] == str(imgs / "00000" / "000000000.jpg")


def test_cc3m_flat_layout_and_missing_error(tmp_path):
    ann, imgs, out = tmp_path / "ann", tmp_path / "images", tmp_path / "out"
    ann.mkdir()
    (ann / "Validation_GCC-1.1.0-Validation.tsv").write_text("first\thttp://u/1\nsecond\thttp://u/2\n")
    touch(str(imgs / "0.jpg"))
    with pytest.raises(FileNotFoundError, match="1.jpg"):
        build("cc3m", str(ann), str(imgs), str(out), splits=["val"], image_layout="flat", missing="error",
              progress=False)
    with pytest.raises(ValueError, match="has no split"):
        build("cc3m", str(ann), str(imgs), str(out), splits=["test"], progress=False)
    with pytest.raises(FileNotFoundError, match="Train_GCC"):  # requested split without annotations
        build("cc3m", str(ann), str(imgs), str(out), splits=["train"], image_layout="flat", progress=False)
    assert not out.exists()


def test_single_annotation_file_is_one_split(tmp_path):
    imgs, out = tmp_path / "images", tmp_path / "out"
    tsv = tmp_path / "my_captions.tsv"
    tsv.write_text("a red car\thttp://u/0\n")
    touch(str(imgs / "0.jpg"))
    reports = build("cc3m", str(tsv), str(imgs), str(out), image_layout="flat", progress=False)
    assert list(reports) == ["train"]
    assert read_jsonl(out / "train.jsonl") == [{"image": str(imgs / "0.jpg"), "text": "a red car", "image_id": "0"}]


# ----------------------------------------------------------------------------------------------------------------
# failing loudly, losing nothing


def _didemo_jsonl(ann, clips):
    ann.mkdir(parents=True, exist_ok=True)
    for split, names in clips.items():
        (ann / f"{split}.jsonl").write_text("".join(json.dumps({"clip_name": n, "caption": n}) + "\n" for n in names))


def test_wrong_videos_folder_fails_and_writes_nothing(tmp_path, capsys):
    ann, vids, out = tmp_path / "ann", tmp_path / "wrong", tmp_path / "out"
    _didemo_jsonl(ann, {"train": ["a", "b"], "test": ["c"]})
    vids.mkdir()
    status = builders.main(["didemo", "--annotations", str(ann), "--videos", str(vids), "--output-dir", str(out),
                            "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1 and not out.exists()
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "Traceback" not in err
    assert f"train is empty: all 2 videos are missing (e.g. {vids / 'a.mp4'})" in line[0]
    assert "test is empty: all 1 videos are missing" in line[0] and "--allow-missing" in line[0]
    # --allow-missing builds the empty splits, with their missing lists
    assert builders.main(["didemo", "--annotations", str(ann), "--videos", str(vids), "--output-dir", str(out),
                          "--no-progress", "--allow-missing"]) == 0
    assert read_jsonl(out / "train.jsonl") == [] and (out / "missing_train.tsv").exists()


def test_share_of_missing_videos(tmp_path):
    ann, vids = tmp_path / "ann", tmp_path / "videos"
    _didemo_jsonl(ann, {"train": [f"v{i}" for i in range(20)]})
    for i in range(19):  # 1 of 20 videos missing: 5%
        touch(str(vids / f"v{i}.mp4"))
    report = build("didemo", str(ann), str(vids), str(tmp_path / "a"), progress=False)["train"]  # 5% <= 5%
    assert (report.rows, report.videos, report.missing_videos) == (19, 20, 1)
    with pytest.raises(MediaError, match=r"train lost 1 of 20 videos \(5.0% > --max-missing-share 0.04\)"):
        build("didemo", str(ann), str(vids), str(tmp_path / "b"), max_missing_share=0.04, progress=False)
    assert not (tmp_path / "b").exists()
    # --missing keep loses nothing, so the share does not apply
    assert build("didemo", str(ann), str(vids), str(tmp_path / "c"), max_missing_share=0.0, missing="keep",
                 progress=False)["train"].rows == 20


def test_missing_error_and_crash_leave_the_previous_build_untouched(tmp_path, monkeypatch):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    _didemo_jsonl(ann, {"train": ["a", "b"]})
    touch(str(vids / "a.mp4"))
    touch(str(vids / "b.mp4"))
    build("didemo", str(ann), str(vids), str(out), progress=False)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    os.remove(vids / "b.mp4")
    with pytest.raises(MediaError, match=r"didemo train: 1 of 2 videos missing .*b.mp4"):
        build("didemo", str(ann), str(vids), str(out), missing="error", progress=False)

    def crash(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(builders, "write_missing_list", crash)
    with pytest.raises(RuntimeError, match="disk on fire"):
        build("didemo", str(ann), str(vids), str(out), allow_missing=True, progress=False)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["ann", "out", "videos"]  # no staging folder left behind


def test_rebuilding_some_splits_keeps_the_others(tmp_path):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    _didemo_jsonl(ann, {"train": ["a"], "test": ["b"]})
    touch(str(vids / "a.mp4"))
    touch(str(vids / "b.mp4"))
    build("didemo", str(ann), str(vids), str(out), progress=False)
    _didemo_jsonl(ann, {"test": ["b", "c"]})
    touch(str(vids / "c.mp4"))
    build("didemo", str(ann), str(vids), str(out), splits=["test"], progress=False)
    assert [r["video_id"] for r in read_jsonl(out / "train.jsonl")] == ["a"]
    assert [r["video_id"] for r in read_jsonl(out / "test.jsonl")] == ["b", "c"]
    assert sorted(json.loads((out / "build_report.json").read_text())["splits"]) == ["test", "train"]
    assert "path: train.jsonl" in (out / "README.md").read_text()
    # a folder that is not a build is never replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(OptionError, match="not a previous build"):
        build("didemo", str(ann), str(vids), str(other), progress=False)
    assert (other / "notes.txt").read_text() == "mine"


def test_cli_one_line_errors_and_debug(tmp_path, capsys):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    ann.mkdir()
    (ann / "train.jsonl").write_text(json.dumps({"clip_name": "c1"}) + "\n")  # no caption field
    vids.mkdir()
    argv = ["didemo", "--annotations", str(ann), "--videos", str(vids), "--output-dir", str(out), "--splits", "train",
            "--no-progress"]
    assert builders.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {ann / 'train.jsonl'}: entry 0 has no field 'caption'; expected {{clip_name, caption}}, "
                   f"got fields ['clip_name']")
    with pytest.raises(AnnotationError, match="has no field 'caption'"):  # --debug: the exception and its traceback
        builders.main(argv + ["--debug"])
    (ann / "train.jsonl").write_text(json.dumps({"clip_name": "c1", "caption": "Hi."}) + "\n")
    touch(str(vids / "c1.mp4"))
    assert builders.main(argv) == 0
    assert "train: 1 rows, 1 videos (testa_jsonl)" in capsys.readouterr().out
    assert read_jsonl(out / "train.jsonl") == [{"video": str(vids / "c1.mp4"), "text": "Hi.", "video_id": "c1"}]


def test_cli_runs_as_a_module(tmp_path):
    """`python -m processing.builders` exits non-zero with one line on stderr and no traceback."""
    import subprocess
    import sys

    ann, vids = tmp_path / "ann", tmp_path / "videos"
    ann.mkdir()
    vids.mkdir()
    result = subprocess.run([sys.executable, "-m", "processing.builders", "didemo", "--annotations", str(ann),
                             "--videos", str(vids), "--output-dir", str(tmp_path / "out")],
                            capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: didemo: no annotation files for any of the splits ['train', 'val', 'test']")
    assert "train_data.json" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _write_test_video(path, width, height, fps, num_frames, fmt=None):
    import av
    import numpy as np

    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            frame = np.full((height, width, 3), (i * 6) % 250, np.uint8)  # frame i has grey level 6 i
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_compress_videos_pyav(tmp_path):
    import av

    from processing.compress_videos import main as compress_main
    from processing.compress_videos import output_size

    assert output_size(640, 480, 224) == (298, 224) and output_size(480, 640, 224) == (224, 298)
    assert output_size(100, 60, 224) == (100, 60)  # never upscaled
    src, dst = tmp_path / "in", tmp_path / "out"
    (src / "sub").mkdir(parents=True)
    _write_test_video(src / "clip.mkv", 64, 48, 10, 40)  # 4 s at 10 fps
    _write_test_video(src / "sub" / "video-abc", 48, 96, 25, 50, fmt="mp4")  # QuerYD-style name without extension
    (src / "notes.txt").write_text("not a video")
    report = compress_main(["--input-dir", str(src), "--output-dir", str(dst), "--size", "32", "--fps", "5",
                            "--backend", "pyav", "--no-progress"])
    assert (report.done, report.skipped, report.failed) == (2, 0, [])
    with av.open(str(dst / "clip.mp4")) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.width, stream.codec_context.height) == (42, 32)
        assert float(stream.average_rate) == 5 and not container.streams.audio
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 20  # 4 s at 5 fps
    # output frame k shows input frame 2k (10 -> 5 fps)
    levels = [float(f.mean()) for f in frames]
    assert all(abs(level - (12 * k) % 250) < 4 for k, level in enumerate(levels)), levels
    with av.open(str(dst / "sub" / "video-abc")) as container:
        codec = container.streams.video[0].codec_context
        assert (codec.width, codec.height) == (32, 64)
        assert sum(1 for _ in container.decode(video=0)) == 10  # 2 s at 5 fps
    again = compress_main(["--input-dir", str(src), "--output-dir", str(dst), "--size", "32", "--fps", "5",
                           "--backend", "pyav", "--no-progress"])
    assert (again.done, again.skipped) == (0, 2)  # existing outputs are skipped
    (src / "broken.mp4").write_bytes(b"not an mp4")
    broken = compress_main(["--input-dir", str(src), "--output-dir", str(dst), "--backend", "pyav", "--no-progress"])
    assert broken.done == 0 and [p for p, _ in broken.failed] == [str(src / "broken.mp4")]
