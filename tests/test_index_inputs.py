"""`train.index`'s inputs mean what a user thinks, and a failure is never a permanent verdict (issue 52).

Through the command (`train.index.main`, in this process): a list of relative paths is read relative to the current
directory (as `ls videos/*.mp4 > list.txt` writes it); only a file named as a list (or `--videos-from`) is read as
one; a list whose lines all miss and a run that indexes nothing write nothing; a video that failed is tried again by
the next run; `--remove` takes rows out of a store, and the store stays whole (its damage checks pass on every open).
References: the pipeline's own encode of the same videos (embeddings and tokens by name, to 1e-6) and the folder's
files before and after a refusal."""

import shutil
from pathlib import Path

import pytest
import torch
from helpers.pipelines import index_collection
from helpers.videos import write_noise_video

from modeling_testa import TestaForVideoTextRetrieval, TestaProcessor, VideoTextRetrievalPipeline
from testa_search.index import VideoIndex
from testa_search.store.video_store import store_metadata
from testa_search.cli.index import main

COMMON = ["--num-workers", "0", "--token-dtype", "float32"]


@pytest.fixture(scope="module")
def collection(tmp_path_factory):
    return index_collection(tmp_path_factory.mktemp("inputs"), 5)


@pytest.fixture(scope="module")
def reference(collection):
    """Every video of the collection encoded by the pipeline, by absolute path: (embeddings, tokens)."""
    root, model = collection
    pipe = VideoTextRetrievalPipeline(model=TestaForVideoTextRetrieval.from_pretrained(model),
                                      processor=TestaProcessor.from_pretrained(model), device="cpu")
    videos = sorted(str(p.resolve()) for p in (root / "videos").glob("*.mp4"))
    index = pipe.encode_videos(videos, token_dtype=torch.float32)
    return {video: (index.embeddings[i], index.tokens[i]) for i, video in enumerate(videos)}


def index_main(model: Path, *args) -> dict:
    return main(["--model", str(model), *map(str, args), *COMMON])


def assert_store_holds(store: Path, reference: dict, videos: list[str]) -> None:
    """The store opens (every damage check passes) and holds exactly `videos`, encoded as the pipeline encodes
    them."""
    index = VideoIndex.load(store)
    assert sorted(index.videos) == sorted(videos) and not index.failures
    rows = [index.videos.index(video) for video in videos]
    torch.testing.assert_close(index.embeddings[rows], torch.stack([reference[v][0] for v in videos]),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(index.tokens[rows], torch.stack([reference[v][1] for v in videos]),
                               rtol=0, atol=1e-6)


def test_a_list_of_relative_paths_is_read_from_the_current_directory(collection, reference, tmp_path, monkeypatch):
    root, model = collection
    monkeypatch.chdir(root)
    (tmp_path / "lists").mkdir()
    listing = tmp_path / "lists" / "subset.txt"  # the list lives elsewhere; its lines are relative to here
    listing.write_text("videos/clip000.mp4\nvideos/clip001.mp4\n\n# a comment\nvideos/clip002.mp4\n")
    report = index_main(model, "--videos", listing, "--store", tmp_path / "store")
    assert report["failed"] == 0 and report["videos"] == 3
    assert_store_holds(tmp_path / "store", reference, [str(root / "videos" / f"clip00{i}.mp4") for i in range(3)])


def test_only_a_list_is_read_as_a_list_and_a_list_that_misses_writes_nothing(collection, tmp_path, monkeypatch):
    root, model = collection
    monkeypatch.chdir(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("# Videos\n\nSome notes.\n")
    with pytest.raises(SystemExit, match=r"'README.md' is not something to index: give a folder of videos, a video "
                                         r"file, a list of paths \(.txt, .lst, or any file with --videos-from\)"):
        index_main(model, "--videos", "README.md", "--store", "store")
    assert not (tmp_path / "store").exists()

    missing = tmp_path / "missing.lst"
    missing.write_text("clips/a.mp4\nclips/b.mp4\n")
    with pytest.raises(SystemExit, match=r"none of the 2 paths listed in 'missing.lst' exists \(relative paths are "
                                         r"relative to the current directory, .*'clips/a.mp4', 'clips/b.mp4'"):
        index_main(model, "--videos", "missing.lst", "--store", "store")
    assert not (tmp_path / "store").exists()

    notes = tmp_path / "notes.md"  # any name, said to be a list
    notes.write_text(str(root / "videos" / "clip003.mp4") + "\n")
    report = index_main(model, "--videos-from", notes, "--store", "store")
    assert report["videos"] == 1 and report["failed"] == 0


def test_a_run_that_indexes_nothing_writes_nothing_and_says_why(collection, tmp_path):
    root, model = collection
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "empty.mp4").write_bytes(b"")
    (folder / "text.mp4").write_text("not a video")
    with pytest.raises(SystemExit) as refused:
        index_main(model, "--videos", folder, "--store", tmp_path / "store")
    message = str(refused.value)
    assert "None of the 2 videos could be read; nothing was written:" in message
    assert f"{folder / 'empty.mp4'}: empty" in message and f"{folder / 'text.mp4'}: " in message
    assert not (tmp_path / "store").exists()  # no half-written folder (shards, journals, plan)


def test_a_video_that_failed_is_tried_again_by_the_next_run(collection, reference, tmp_path, capsys):
    root, model = collection
    videos = [str(root / "videos" / f"clip00{i}.mp4") for i in range(3)]
    late = tmp_path / "late" / "clip.mp4"  # not there yet: copied in after the first run
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join([*videos, str(late)]) + "\n")
    store = tmp_path / "store"
    first = index_main(model, "--videos", listing, "--store", store, "--shard-size", "2")
    assert first["failed"] == 1 and first["failures"][0]["video"] == str(late)
    assert "(3 added, 0 already indexed, 1 failed this run;" in capsys.readouterr().out

    late.parent.mkdir()
    shutil.copy(videos[0].replace("clip000", "clip004"), late)
    second = index_main(model, "--videos", listing, "--store", store, "--shard-size", "2")
    printed = capsys.readouterr().out
    assert "Trying again 1 rows that could not be read before." in printed
    assert "(1 added, 3 already indexed, 0 failed this run; 0 in the store" in printed
    assert second["failed"] == 0 and second["videos"] == 4 and second["encoded_this_run"] == 1
    reference = {**reference, str(late): reference[videos[0].replace("clip000", "clip004")]}
    assert_store_holds(store, reference, [*videos, str(late)])


def test_remove_takes_rows_out_of_a_store_and_the_next_run_adds_them_back(collection, reference, tmp_path, capsys):
    root, model = collection
    videos = sorted(str(p) for p in (root / "videos").glob("*.mp4"))
    store = tmp_path / "store"
    index_main(model, "--videos", root / "videos", "--store", store, "--shard-size", "2")  # shards of 2, 2, 1
    report = main(["--store", str(store), "--remove", videos[1], str(tmp_path / "never_indexed.mp4")])
    assert report["removed"] == [videos[1]] and report["not_in_store"] == [str(tmp_path / "never_indexed.mp4")]
    assert "Removed 1 videos from" in capsys.readouterr().out
    kept = [v for v in videos if v != videos[1]]
    assert_store_holds(store, reference, kept)
    assert [shard["stop"] - shard["start"] for shard in store_metadata(store)["shards"]] == [1, 2, 1]
    pipe = VideoTextRetrievalPipeline(model=TestaForVideoTextRetrieval.from_pretrained(model),
                                      processor=TestaProcessor.from_pretrained(model), device="cpu")
    hits = pipe.search("a red square", VideoIndex.load(store), top_k=None, rerank=False)
    assert sorted(hit["video"] for hit in hits) == kept

    again = index_main(model, "--videos", root / "videos", "--store", store)
    assert again["encoded_this_run"] == 1 and again["videos"] == 5
    assert_store_holds(store, reference, videos)
    with pytest.raises(SystemExit, match="would leave no encoded video"):
        main(["--store", str(store), "--remove", *videos])
    assert_store_holds(store, reference, videos)  # refused: nothing changed
    with pytest.raises(SystemExit, match="holds no finished video store"):
        main(["--store", str(tmp_path / "nowhere"), "--remove", videos[0]])


def test_the_pipelines_refuse_an_empty_query_and_a_stride_longer_than_the_window(collection, tmp_path, capsys):
    """As `train.search` refuses an empty query, the pipelines do (naming which one); `stride > window` would leave
    the video between two windows in none, so the pipeline and `train.index` refuse it, naming both."""
    from modeling_testa import ZeroShotVideoClassificationPipeline

    root, model = collection
    processor = TestaProcessor.from_pretrained(model)
    retrieval = TestaForVideoTextRetrieval.from_pretrained(model)
    pipe = VideoTextRetrievalPipeline(model=retrieval, processor=processor, device="cpu")
    video = str(root / "videos" / "clip000.mp4")
    index = pipe.encode_videos([video])
    with pytest.raises(ValueError, match=r"`text` is empty \('  '\); pass words to search for"):
        pipe.search("  ", index)
    with pytest.raises(ValueError, match=r"`text\[1\]` is empty"):
        pipe(text=["a red square", ""], videos=[video])
    classify = ZeroShotVideoClassificationPipeline(model=retrieval, processor=processor, device="cpu")
    with pytest.raises(ValueError, match=r"`candidate_labels\[1\]` is empty"):
        classify(video, candidate_labels=["surfing", " "])
    assert pipe.search("a red square", index, rerank=False)[0]["video"] == video  # words: searched

    with pytest.raises(ValueError, match=r"`stride=20` is longer than `window=10`"):
        pipe.encode_videos([video], window=10, stride=20)
    with pytest.raises(SystemExit):
        index_main(model, "--videos", root / "videos", "--store", tmp_path / "store", "--window", "10",
                   "--stride", "20")
    assert "`stride=20.0` is longer than `window=10.0`" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()
