"""The builders on hand-written fixtures with the exact structure of each dataset's public release (keys, nesting,
types and the odd cases of the real files), videos named as each download tool names them, some left out.

Expected paragraphs, timestamps and counts are worked out by hand here, never read back from the builder.
"""

import csv
import json
import os
import pickle

import pytest

from processing.builders import AnnotationError, build


def touch(path):
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\x00")
    return str(path)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def report_of(out):
    with open(os.path.join(out, "build_report.json"), encoding="utf-8") as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------------------------
# DiDeMo: LocalizingMoments data/{split}_data.json


def didemo_record(annotation_id, video, description, times, segments=6):
    """One entry of the release, with all its fields and types (dl_link is a Flickr URL of the photo id)."""
    photo_id = video.split("_")[1]
    return {"num_segments": segments, "description": description,
            "dl_link": f"https://www.flickr.com/video_download.gne?id={photo_id}", "times": times, "video": video,
            "annotation_id": annotation_id}


# Names as in the release: extensions .mov / .avi / bare "."; the pair A.mov / A.mp4 differ only by extension (same
# user, photo id and secret) and split the video's descriptions between them; records are not contiguous.
A_MOV, A_MP4 = "11@N00_100_aaa.mov", "11@N00_100_aaa.mp4"
B_AVI = "22@N01_200_bbb.avi"
C_DOT = "33@N02_300_ccc."
D_MPG = "44@N03_400_ddd.mpg"
DIDEMO_TEST = [
    didemo_record(1, A_MOV, "the dog rolls over.", [[2, 2], [2, 3], [2, 2], [3, 3]]),
    didemo_record(2, B_AVI, "a man waves ", [[0, 0], [0, 0], [0, 1], [0, 0]], segments=5),
    didemo_record(3, A_MP4, "The dog sits (first)", [[0, 0], [0, 0], [0, 0], [0, 0]]),
    didemo_record(4, C_DOT, "camera pans left", [[1, 1], [1, 1], [1, 1], [1, 1]]),
    didemo_record(5, A_MOV, "dog runs away", [[4, 5], [5, 5], [5, 5], [4, 5]]),
    didemo_record(6, B_AVI, "man sits", [[3, 3], [2, 3], [3, 3], [3, 4]]),
    didemo_record(7, D_MPG, "nobody", [[0, 0], [0, 0], [0, 0], [0, 0]]),
    didemo_record(8, B_AVI, "man stands up", [[1, 1], [1, 2], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1]]),
]


@pytest.fixture
def didemo_release(tmp_path):
    ann, vids = tmp_path / "LocalizingMoments" / "data", tmp_path / "videos"
    ann.mkdir(parents=True)
    (ann / "test_data.json").write_text(json.dumps(DIDEMO_TEST))
    touch(vids / (A_MP4 + ".mp4"))  # download_videos_AWS.py: <name>.mp4, here under the second name of the pair
    touch(vids / B_AVI)  # download_videos.py (Flickr): the name itself
    touch(vids / (C_DOT + ".mp4"))  # AWS script on a name ending in a bare dot: "...ccc..mp4"
    return tmp_path / "LocalizingMoments", vids  # D (.mpg) is missing on purpose


def test_didemo_release_paragraphs_in_time_order(didemo_release, tmp_path):
    ann, vids = didemo_release
    out = tmp_path / "out"
    reports = build("didemo", str(ann), str(vids), str(out), splits=["test"], allow_missing=True, progress=False)
    rows = read_jsonl(out / "test.jsonl")
    # A: start = 5 * mean(first), end = 5 * (mean(last) + 1):
    #   #1 firsts 2,2,2,3 -> 5*2.25 = 11.25, lasts 2,3,2,3 -> 5*3.5 = 17.5
    #   #3 all 0 -> 0, 5;   #5 firsts 4,5,5,4 -> 22.5, lasts all 5 -> 30
    # time order #3, #1, #5; DiDeMo text stays raw (stripped sentences joined by single spaces)
    assert rows[0] == {
        "video": str(vids / (A_MP4 + ".mp4")), "video_id": "11@N00_100_aaa",
        "text": "The dog sits (first) the dog rolls over. dog runs away",
        "sentences": ["The dog sits (first)", "the dog rolls over.", "dog runs away"],
        "timestamps": [[0.0, 5.0], [11.25, 17.5], [22.5, 30.0]], "video_names": [A_MOV, A_MP4],
    }
    # B: #2 firsts 0,0,0,0 -> 0, lasts 0,0,1,0 -> 5*1.25 = 6.25; #6 firsts 3,2,3,3 -> 13.75, lasts 3,3,3,4 -> 21.25;
    #    #8 (7 annotators) firsts all 1 -> 5, lasts 1,2,1,1,1,1,1 -> 5*(8/7+1)
    assert rows[1] == {
        "video": str(vids / B_AVI), "video_id": "22@N01_200_bbb",
        "text": "a man waves man stands up man sits",
        "sentences": ["a man waves", "man stands up", "man sits"],
        "timestamps": [[0.0, 6.25], [5.0, 5 * (8 / 7 + 1)], [13.75, 21.25]], "video_names": [B_AVI],
    }
    assert rows[2]["video"] == str(vids / (C_DOT + ".mp4")) and rows[2]["video_id"] == "33@N02_300_ccc"
    assert len(rows) == 3
    report = reports["test"]
    assert (report.format, report.rows, report.videos, report.missing_videos, report.missing_rows) == \
        ("release", 3, 4, 1, 1)
    assert report.missing_examples == [{"video_id": "44@N03_400_ddd", "rows": 1, "path": str(vids / (D_MPG + ".mp4"))}]
    # A and B are not in time order in the file; C and D have one sentence
    assert report.details["videos_with_several_names"] == 1 and report.details["sentences_reordered"] == 2
    assert report_of(out)["splits"]["test"]["details"]["several_names_examples"] == [[A_MOV, A_MP4]]


def test_didemo_release_file_order_and_flickr_names(didemo_release, tmp_path):
    ann, vids = didemo_release
    touch(vids / D_MPG)  # now every video is there
    out = tmp_path / "out"
    build("didemo", str(ann), str(vids), str(out), splits=["test"], sentence_order="file", progress=False)
    rows = {row["video_id"]: row for row in read_jsonl(out / "test.jsonl")}
    assert rows["11@N00_100_aaa"]["text"] == "the dog rolls over. The dog sits (first) dog runs away"
    assert rows["11@N00_100_aaa"]["timestamps"] == [[11.25, 17.5], [0.0, 5.0], [22.5, 30.0]]
    assert rows["22@N01_200_bbb"]["text"] == "a man waves man sits man stands up"
    assert rows["44@N03_400_ddd"]["video"] == str(vids / D_MPG)
    assert report_of(out)["splits"]["test"]["details"]["sentences_reordered"] == 0


def test_didemo_compressed_stem_names(tmp_path):
    """Converted / compressed copies are named <stem>.mp4 (TESTA's didemo_30fps_224_trimed30)."""
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    ann.mkdir()
    (ann / "val_data.json").write_text(json.dumps([didemo_record(9, C_DOT, "x", [[0, 0]]),
                                                   didemo_record(10, B_AVI, "y", [[0, 0]])]))
    touch(vids / "33@N02_300_ccc.mp4")
    touch(vids / "22@N01_200_bbb.mp4")
    build("didemo", str(ann), str(vids), str(out), splits=["val"], progress=False)
    assert [r["video"] for r in read_jsonl(out / "val.jsonl")] == [str(vids / "33@N02_300_ccc.mp4"),
                                                                    str(vids / "22@N01_200_bbb.mp4")]


@pytest.mark.parametrize("times, shown", [([[0, 6]], "[0, 6]"), ([[3, 2]], "[3, 2]"), ([], "got a list of 0")])
def test_didemo_bad_times_name_the_entry_and_field(tmp_path, times, shown):
    ann, vids = tmp_path / "ann", tmp_path / "videos"
    ann.mkdir()
    vids.mkdir()
    (ann / "val_data.json").write_text(json.dumps([didemo_record(1, B_AVI, "ok", [[0, 0]]),
                                                   didemo_record(2, B_AVI, "bad", times)]))
    with pytest.raises(AnnotationError, match=r"val_data.json: entry 1 .*'times'") as error:
        build("didemo", str(ann), str(vids), str(tmp_path / "out"), splits=["val"], progress=False)
    assert shown in str(error.value)
    assert not (tmp_path / "out").exists()


def test_didemo_unknown_format_names_the_expected_ones(tmp_path):
    ann, vids = tmp_path / "ann", tmp_path / "videos"
    ann.mkdir()
    vids.mkdir()
    (ann / "train_data.json").write_text(json.dumps({"videos": []}))
    with pytest.raises(AnnotationError, match=r"train_data.json: not a DiDeMo annotation file: expected the "
                                              r"LocalizingMoments release .* an object with keys \['videos'\]"):
        build("didemo", str(ann), str(vids), str(tmp_path / "out"), splits=["train"], progress=False)


def test_didemo_converted_list_of_video_caption(tmp_path):
    """[{video, caption}] files (caption a paragraph or a list of sentences); evaluation keeps one row per video."""
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    ann.mkdir()
    (ann / "val.json").write_text(json.dumps([
        {"video": "11@N00_100_aaa.mp4", "caption": ["A dog. ", " It runs."]},
        {"video": "22@N01_200_bbb.mp4", "caption": "A man."},
        {"video": "11@N00_100_aaa.mp4", "caption": "again"},
    ]))
    touch(vids / "11@N00_100_aaa.mp4")
    touch(vids / "22@N01_200_bbb.mp4")
    reports = build("didemo", str(ann), str(vids), str(out), splits=["val"], progress=False)
    assert read_jsonl(out / "val.jsonl") == [
        {"video": str(vids / "11@N00_100_aaa.mp4"), "text": "A dog. It runs.", "video_id": "11@N00_100_aaa"},
        {"video": str(vids / "22@N01_200_bbb.mp4"), "text": "A man.", "video_id": "22@N01_200_bbb"},
    ]
    assert reports["val"].format == "converted" and reports["val"].duplicates_dropped == 1


# ----------------------------------------------------------------------------------------------------------------
# ActivityNet Captions: captions.zip train.json / val_1.json / val_2.json (also PDVC data/anet/captiondata/)

ANET_VAL_1 = {
    # sentences out of time order, mixed int / float timestamps, the release's leading / double spaces
    "v_uqiMw7tQ1Cc": {"duration": 55.15, "timestamps": [[13.79, 54.32], [0.28, 55.15]],
                      "sentences": ["The coach (in red) helps.", "  A weight lifting tutorial is given!"]},
    "v_D0pVkTEYQg8": {"duration": 120, "timestamps": [[0, 30], [30, 120.5]],
                      "sentences": ["A guy exercises.", " He stops."]},
    "v_rgAALWYnRrg": {"duration": 10.0, "timestamps": [[0, 10]], "sentences": ["Missing video."]},
}
ANET_VAL_2 = {"v_uqiMw7tQ1Cc": {"duration": 55.15, "timestamps": [[0, 4.14]], "sentences": ["Two men talk."]}}
ANET_TRAIN = {"v_QOlSCBRmfWY": {"duration": 82.73, "timestamps": [[0.83, 19.86], [17.37, 60.81]],
                                "sentences": ["A young woman dances.", " She lies down."]}}


@pytest.fixture
def anet_release(tmp_path):
    ann, vids = tmp_path / "captions", tmp_path / "videos"
    ann.mkdir()
    for name, data in (("train.json", ANET_TRAIN), ("val_1.json", ANET_VAL_1), ("val_2.json", ANET_VAL_2)):
        (ann / name).write_text(json.dumps(data))
    touch(vids / "v_uqiMw7tQ1Cc.mp4")  # the ActivityNet crawler's name
    touch(vids / "v_D0pVkTEYQg8.mkv")
    touch(vids / "QOlSCBRmfWY.webm")  # without the v_ prefix
    return ann, vids


def test_activitynet_release_split_mapping_and_time_order(anet_release, tmp_path):
    ann, vids = anet_release
    out = tmp_path / "out"
    reports = build("activitynet", str(ann), str(vids), str(out), allow_missing=True, progress=False)
    test = read_jsonl(out / "test.jsonl")  # val_1.json, as TESTA evaluates
    # time order: 0.28 before 13.79; pre_caption lower-cases, ()! -> spaces, collapses runs, strips
    assert test[0] == {
        "video": str(vids / "v_uqiMw7tQ1Cc.mp4"), "video_id": "v_uqiMw7tQ1Cc",
        "text": "a weight lifting tutorial is given the coach in red helps.",
        "sentences": ["A weight lifting tutorial is given!", "The coach (in red) helps."],
        "timestamps": [[0.28, 55.15], [13.79, 54.32]], "duration": 55.15,
    }
    assert test[1] == {
        "video": str(vids / "v_D0pVkTEYQg8.mkv"), "video_id": "v_D0pVkTEYQg8", "text": "a guy exercises. he stops.",
        "sentences": ["A guy exercises.", "He stops."], "timestamps": [[0.0, 30.0], [30.0, 120.5]],
        "duration": 120.0,
    }
    assert len(test) == 2
    assert [r["text"] for r in read_jsonl(out / "val.jsonl")] == ["two men talk."]  # val_2.json
    assert read_jsonl(out / "train.jsonl")[0]["video"] == str(vids / "QOlSCBRmfWY.webm")
    assert reports["test"].annotation_files == [str(ann / "val_1.json")]
    assert reports["val"].annotation_files == [str(ann / "val_2.json")]
    assert (reports["test"].videos, reports["test"].missing_videos) == (3, 1)
    assert reports["test"].details["sentences_reordered"] == 1


def test_activitynet_release_file_order(anet_release, tmp_path):
    ann, vids = anet_release
    out = tmp_path / "out"
    build("activitynet", str(ann), str(vids), str(out), splits=["test"], sentence_order="file", allow_missing=True,
          progress=False)
    row = read_jsonl(out / "test.jsonl")[0]
    assert row["text"] == "the coach in red helps. a weight lifting tutorial is given"
    assert row["timestamps"] == [[13.79, 54.32], [0.28, 55.15]]


def test_activitynet_release_validation(tmp_path):
    ann, vids = tmp_path / "ann", tmp_path / "videos"
    ann.mkdir()
    vids.mkdir()
    bad = {"v_a": {"duration": 5, "timestamps": [[0, 1]], "sentences": ["one", "two"]}}
    (ann / "val_1.json").write_text(json.dumps(bad))
    with pytest.raises(AnnotationError, match=r"val_1.json: video 'v_a' 'timestamps' should be a list of one "
                                              r"\[start, end\] per sentence \(2\)"):
        build("activitynet", str(ann), str(vids), str(tmp_path / "out"), splits=["test"], progress=False)
    # PDVC's ActivityNet-Entities paragraph files have no timestamps: named and rejected
    (ann / "val_1.json").write_text(json.dumps({"v_a": "A paragraph.  Another sentence."}))
    with pytest.raises(AnnotationError, match="ActivityNet-Entities paragraph file"):
        build("activitynet", str(ann), str(vids), str(tmp_path / "out"), splits=["test"], progress=False)


# ----------------------------------------------------------------------------------------------------------------
# Condensed Movies: m-bain/CondensedMovies data/metadata/{split,descriptions,clips,durations}.csv


def write_csv(path, header, rows):
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def test_condensed_movies_public_metadata(tmp_path):
    meta, vids, out = tmp_path / "CondensedMovies" / "data" / "metadata", tmp_path / "videos", tmp_path / "out"
    write_csv(meta / "split.csv", ["imdbid", "split"], [["tt1", "train"], ["tt2", "val"], ["tt3", "test"]])
    write_csv(meta / "descriptions.csv", ["imdbid", "videoid", "description"], [
        ["tt1", "Sv-BxH3SVS8", 'The players sing "One Day More".'],
        ["tt2", "-W8pOz1fsD0", "Javert, conflicted, jumps."],
        ["tt1", "IsZdfna1LKA", "Same text."],
        ["tt1", "abcdefghijk", "Same text."],  # duplicated in train: both dropped, as the authors' loader does
        ["tt3", "zzzzzzzzzzz", "Same text."],  # the same text in another split is kept
        ["tt1", "missingclip", "Not downloaded."],
    ])
    write_csv(meta / "clips.csv", ["videoid", "year", "clip_idx", "clip_tot", "upload_year", "title", "clip_name",
                                   "imdbid"], [
        ["Sv-BxH3SVS8", "2012.0", "6", "10", "2019", "Les Misérables", "One Day More Scene", "tt1"],
        ["-W8pOz1fsD0", "2012.0", "8", "10", "2011", "Les Misérables", "Javert's Suicide Scene", "tt2"],
        ["zzzzzzzzzzz", "1999.0", "1", "2", "2015", "X", "Y", "tt3"],
        ["missingclip", "1999.0", "1", "2", "2016", "X", "Y", "tt1"],
    ])
    write_csv(meta / "durations.csv", ["videoid", "duration"], [["Sv-BxH3SVS8", "83"], ["-W8pOz1fsD0", "119"]])
    touch(vids / "2019" / "Sv-BxH3SVS8.mkv")  # data_prep/download.py: videos/<upload_year>/<videoid>.mkv
    touch(vids / "-W8pOz1fsD0.mkv")  # flat folder
    touch(vids / "2015" / "zzzzzzzzzzz.mp4")
    reports = build("condensed_movies", str(tmp_path / "CondensedMovies"), str(vids), str(out), allow_missing=True,
                    progress=False)
    assert read_jsonl(out / "train.jsonl") == [
        {"video": str(vids / "2019" / "Sv-BxH3SVS8.mkv"), "text": "the players sing one day more .",
         "video_id": "Sv-BxH3SVS8", "duration": 83.0},
    ]
    assert read_jsonl(out / "val.jsonl") == [
        {"video": str(vids / "-W8pOz1fsD0.mkv"), "text": "javert, conflicted, jumps.", "video_id": "-W8pOz1fsD0",
         "duration": 119.0},
    ]
    assert read_jsonl(out / "test.jsonl") == [
        {"video": str(vids / "2015" / "zzzzzzzzzzz.mp4"), "text": "same text.", "video_id": "zzzzzzzzzzz",
         "duration": None},
    ]
    train = reports["train"]
    assert train.format == "metadata" and train.details["duplicate_descriptions_dropped"] == 2
    assert (train.rows, train.videos, train.missing_videos) == (1, 2, 1)
    assert train.missing_examples[0]["path"] == str(vids / "2016" / "missingclip.mkv")


def test_condensed_movies_challenge_csv_is_preferred(tmp_path):
    ann, vids, out = tmp_path / "ann", tmp_path / "videos", tmp_path / "out"
    write_csv(ann / "split.csv", ["imdbid", "split"], [["tt1", "train"]])
    write_csv(ann / "descriptions.csv", ["imdbid", "videoid", "description"], [["tt1", "aaa", "From metadata."]])
    write_csv(ann / "metadata" / "train_val_challf0.csv", ["videoid", "caption", "split", "upload_year"],
              [["aaa", "From the challenge.", "train", "2017"], ["bbb", "Val.", "val", "2017"]])
    touch(vids / "2017" / "aaa.mkv")
    reports = build("condensed_movies", str(ann), str(vids), str(out), splits=["train"], progress=False)
    assert read_jsonl(out / "train.jsonl") == [
        {"video": str(vids / "2017" / "aaa.mkv"), "text": "from the challenge.", "video_id": "aaa"}]
    assert reports["train"].format == "challenge"


# ----------------------------------------------------------------------------------------------------------------
# QuerYD: raw_captions_combined_filtered[-v2].pkl, times_captions_combined_filtered[-v2].pkl, {split}_list.txt


def test_queryd_release_with_times(tmp_path):
    root, vids, out = tmp_path / "QuerYD-experts", tmp_path / "videos", tmp_path / "out"
    sym = root / "data" / "QuerYD" / "structured-symlinks"  # the experts tarball layout
    sym.mkdir(parents=True)
    captions = {"video-wkP0rYhSrLQ": [["Later", ",", "he", "leaves", "."], ["A", "man", "(", "Bob", ")", "enters"]],
                "video-0-NBRA1aSXk": [["One", "sentence"]]}
    times = {"video-wkP0rYhSrLQ": [[12.5, 15.0], [3.0, 6.25]], "video-0-NBRA1aSXk": [[0.0, 2.0]]}
    with open(sym / "raw_captions_combined_filtered-v2.pkl", "wb") as f:  # the name as downloaded
        pickle.dump(captions, f)
    with open(sym / "times_captions_combined_filtered-v2.pkl", "wb") as f:
        pickle.dump(times, f)
    (sym / "test_list.txt").write_text("video-wkP0rYhSrLQ\nvideo-0-NBRA1aSXk\n")
    touch(vids / "video-wkP0rYhSrLQ")  # download_queryd.py (pytube) names: video-<id>, no extension
    touch(vids / "video-0-NBRA1aSXk.mp4")
    reports = build("queryd", str(root), str(vids), str(out), splits=["test"], progress=False)
    assert read_jsonl(out / "test.jsonl") == [
        {"video": str(vids / "video-wkP0rYhSrLQ"), "video_id": "video-wkP0rYhSrLQ",
         "text": "a man bob enters later , he leaves .", "sentences": ["A man ( Bob ) enters", "Later , he leaves ."],
         "timestamps": [[3.0, 6.25], [12.5, 15.0]]},
        {"video": str(vids / "video-0-NBRA1aSXk.mp4"), "video_id": "video-0-NBRA1aSXk", "text": "one sentence",
         "sentences": ["One sentence"], "timestamps": [[0.0, 2.0]]},
    ]
    assert reports["test"].details["sentence_order"] == "time"
    assert reports["test"].annotation_files[1].endswith("raw_captions_combined_filtered-v2.pkl")


def test_queryd_times_must_match_the_sentences(tmp_path):
    ann, vids = tmp_path / "ann", tmp_path / "videos"
    ann.mkdir()
    vids.mkdir()
    with open(ann / "raw_captions_combined_filtered.pkl", "wb") as f:
        pickle.dump({"video-a": [["x"], ["y"]]}, f)
    with open(ann / "times_captions_combined_filtered.pkl", "wb") as f:
        pickle.dump({"video-a": [[0.0, 1.0]]}, f)
    (ann / "exists_val_list.txt").write_text("video-a\n")
    with pytest.raises(AnnotationError, match=r"times_captions_combined_filtered.pkl: times of 'video-a' should be 2 "
                                              r"\[start, end\] pairs"):
        build("queryd", str(ann), str(vids), str(tmp_path / "out"), splits=["val"], progress=False)


# ----------------------------------------------------------------------------------------------------------------
# ActivityNet-QA: MILVLG/activitynet-qa dataset/{split}_{q,a}.json


def test_activitynet_qa_release_layout_and_missing_once_per_video(tmp_path):
    repo, vids, out = tmp_path / "activitynet-qa", tmp_path / "videos", tmp_path / "out"
    (repo / "dataset").mkdir(parents=True)
    questions = [{"video_name": "TIEzvhv6xaI", "question": "is the no.3 athlete playing indoor",
                  "question_id": f"v_TIEzvhv6xaI_{i}"} for i in range(3)]
    questions.append({"video_name": "gone", "question": "what is it?", "question_id": "v_gone_0"})
    questions.append({"video_name": "gone", "question": "where?", "question_id": "v_gone_1"})
    answers = [{"answer": "yes", "type": 3, "question_id": q["question_id"]} for q in questions]
    (repo / "dataset" / "val_q.json").write_text(json.dumps(questions))
    (repo / "dataset" / "val_a.json").write_text(json.dumps(answers))
    touch(vids / "v_TIEzvhv6xaI.mp4")
    reports = build("activitynet_qa", str(repo), str(vids), str(out), splits=["val"], allow_missing=True,
                    progress=False)
    rows = read_jsonl(out / "qa_val.jsonl")
    assert [r["question"] for r in rows] == ["is the no3 athlete playing indoor"] * 3
    assert (reports["val"].rows, reports["val"].videos, reports["val"].missing_videos,
            reports["val"].missing_rows) == (3, 2, 1, 2)
    # one line per missing video, with the rows it affects
    assert (out / "missing_qa_val.tsv").read_text().splitlines() == [
        "video_id\trows\texpected_path", f"v_gone\t2\t{vids / 'v_gone.mp4'}"]
