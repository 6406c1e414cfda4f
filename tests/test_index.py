"""`python -m train.index` / `accelerate launch -m train.index` and `python -m train.search`: real processes (1 and 2,
through `accelerate launch` on CPU), a tiny retrieval model and 200 generated mp4 files.

References: a one-process index of the same videos (embeddings to 1e-6, the same ranking for every query), the
journals (every video encoded exactly once over a killed run and its resume), and the pipeline's own `search`."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers.pipelines import INDEX_COMMAND as PLAIN
from helpers.pipelines import INDEX_LAUNCH_2 as LAUNCH_2
from helpers.pipelines import build_qa, index_collection, save_folder, tiny_processor, write_bad_files
from helpers.videos import write_noise_video

from modeling_testa import TestaForVideoTextRetrieval, TestaProcessor, VideoTextRetrievalPipeline
from testa_search.index import VideoIndex
from testa_search.store.video_store import journaled_count

NUM_VIDEOS = 200
QUERIES = ["a red square on a blue screen", "green and yellow blocks", "first dark then bright", "a cat"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def collection(tmp_path_factory):
    return index_collection(tmp_path_factory.mktemp("index"), NUM_VIDEOS)


def run(command: list[str], *args, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*command, *map(str, args)], env=ENV, capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def common(root: Path, model: Path, store: Path, *extra) -> list:
    return ["--model", model, "--videos", root / "videos", "--store", store, "--token-dtype", "float32",
            "--num-workers", "0", *extra]


@pytest.fixture(scope="module")
def one_process_store(collection):
    root, model = collection
    run(PLAIN, *common(root, model, root / "single", "--shard-size", "64"))
    return root / "single"


def rankings(model: Path, store: Path) -> tuple[list, torch.Tensor]:
    pipe = VideoTextRetrievalPipeline(model=TestaForVideoTextRetrieval.from_pretrained(model),
                                      processor=TestaProcessor.from_pretrained(model), device="cpu")
    index = VideoIndex.load(store)
    results = pipe.search(QUERIES, index, top_k=None)
    return [[item["video"] for item in ranked] for ranked in results], index.embeddings


def encoded_indices(store: Path) -> list[int]:
    indices = []
    for journal in sorted(store.glob("journal-*.jsonl")):
        for line in journal.read_text().splitlines()[1:]:
            entry = json.loads(line)
            indices += entry.get("encoded", [])
    return sorted(indices)


def test_two_processes_give_the_index_of_one(collection, one_process_store):
    root, model = collection
    store = root / "two"
    result = run(LAUNCH_2, *common(root, model, store, "--shard-size", "16"))
    assert f"Indexed {NUM_VIDEOS} videos" in result.stdout and "on 2 process(es)" in result.stdout
    assert "waiting for decoding" in result.stdout and "encoding" in result.stdout
    single_order, single_embeddings = rankings(model, one_process_store)
    order, embeddings = rankings(model, store)
    torch.testing.assert_close(embeddings, single_embeddings, rtol=0, atol=1e-6)
    assert order == single_order
    report = json.loads((store / "index_report.json").read_text())
    assert report["processes"] == 2 and report["encoded_this_run"] == NUM_VIDEOS and report["failed"] == 0
    assert encoded_indices(store) == list(range(NUM_VIDEOS))


def test_a_killed_run_resumes_without_encoding_any_video_twice(collection, one_process_store):
    root, model = collection
    store = root / "killed"
    command = [*LAUNCH_2, *map(str, common(root, model, store, "--shard-size", "16", "--batch-size", "1"))]
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while (not store.is_dir() or journaled_count(store) < 20) and time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    # the launcher and both workers, mid-batch (torch's elastic agent starts the workers in sessions of their own)
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for member in tree:
        member.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=30)
    process.wait()
    done_before = journaled_count(store)
    assert 20 <= done_before < NUM_VIDEOS and not (store / "video_store.json").exists()

    result = run(LAUNCH_2, *common(root, model, store, "--shard-size", "16", "--batch-size", "1"))
    assert "resuming" in result.stdout
    report = json.loads((store / "index_report.json").read_text())
    assert report["already_in_store"] == done_before and report["encoded_this_run"] == NUM_VIDEOS - done_before
    assert encoded_indices(store) == list(range(NUM_VIDEOS))  # each video journaled exactly once, over both runs
    single_order, single_embeddings = rankings(model, one_process_store)
    order, embeddings = rankings(model, store)
    torch.testing.assert_close(embeddings, single_embeddings, rtol=0, atol=1e-6)
    assert order == single_order


def test_a_resume_with_other_settings_is_refused_and_changes_nothing(collection, one_process_store):
    root, model = collection
    before = {p.name: p.stat().st_mtime_ns for p in one_process_store.iterdir()}
    result = run(PLAIN, *common(root, model, one_process_store, "--shard-size", "64", "--num-frames", "3",
                                "--precision", "int8"), check=False)
    assert result.returncode != 0
    message = result.stderr
    assert "built with other settings" in message and "num_frames: the index has 4, this build 3" in message
    assert "precision: the index has 'fp32', this build 'int8'" in message
    assert "Traceback" not in message
    assert {p.name: p.stat().st_mtime_ns for p in one_process_store.iterdir()} == before


def test_bad_videos_are_reported_not_fatal_and_bad_arguments_are_named(collection, tmp_path):
    root, model = collection
    videos = tmp_path / "mixed"
    for i in range(3):
        write_noise_video(videos / f"good{i}.mp4", seed=100 + i)
    bad = write_bad_files(videos / "bad", str(videos / "good0.mp4"))
    (videos / "readme.txt").write_text("not a video")
    store = tmp_path / "store"
    result = run(PLAIN, "--model", model, "--videos", videos, "--store", store, "--num-workers", "0")
    report = json.loads((store / "index_report.json").read_text())
    assert report["videos"] == 3 + len(bad) and report["failed"] == len(bad)
    assert {Path(f["video"]).name for f in report["failures"]} == {Path(p).name for p in bad.values()}
    assert all(f["reason"] for f in report["failures"])
    assert report["skipped_files"] == [str((videos / "readme.txt").resolve())]
    assert "could not be decoded" in result.stdout and "readme.txt" in result.stdout
    index = VideoIndex.load(store)
    assert int(index.store.valid.sum()) == 3

    as_file = tmp_path / "a_file"
    as_file.write_text("x")
    result = run(PLAIN, "--model", model, "--videos", videos, "--store", as_file, check=False)
    assert result.returncode != 0 and "is a file" in result.stderr and as_file.read_text() == "x"

    qa = save_folder(build_qa(), tiny_processor(), tmp_path / "qa")
    result = run(PLAIN, "--model", qa, "--videos", videos, "--store", tmp_path / "s2", check=False)
    assert result.returncode != 0 and "not a retrieval model" in result.stderr
    assert "TestaForVideoTextRetrieval" in result.stderr and "Traceback" not in result.stderr

    result = run(PLAIN, "--model", model, "--videos", tmp_path / "nowhere", "--store", tmp_path / "s3", check=False)
    assert result.returncode != 0 and "nowhere" in result.stderr and "does not exist" in result.stderr


def test_search_command_equals_the_pipeline_search(collection, one_process_store):
    root, model = collection
    result = run([sys.executable, "-m", "train.search"], "--store", one_process_store, "--top-k", "5", "--json",
                 *QUERIES[:2])
    printed = json.loads(result.stdout)
    pipe = VideoTextRetrievalPipeline(model=TestaForVideoTextRetrieval.from_pretrained(model),
                                      processor=TestaProcessor.from_pretrained(model), device="cpu")
    expected = pipe.search(QUERIES[:2], VideoIndex.load(one_process_store), top_k=5)
    assert [[r["video"] for r in ranked] for ranked in printed] == [[r["video"] for r in ranked] for ranked in expected]
    for got, want in zip(printed, expected):
        assert [r["score"] for r in got] == pytest.approx([r["score"] for r in want], abs=1e-6)
        assert all(r["reranked"] for r in got)  # the pipeline re-ranks at least top_k candidates


def test_a_resumed_writer_cuts_what_a_torn_batch_left_and_continues(tmp_path):
    """A kill between the data and the journal line: the data files hold more than the journal says, and the last
    journal line is torn. The resumed writer keeps exactly the journaled videos; the finished store equals the
    tensors given (float32 tokens: bit for bit)."""
    from testa_search.store.video_store import VideoStoreWriter, VideoTokenStore, finalize_store

    generator = torch.Generator().manual_seed(0)
    tokens, sizes = torch.randn(6, 5, 4, generator=generator), torch.rand(6, 5, generator=generator) + 1
    embeddings = torch.randn(6, 3, generator=generator)
    writer = VideoStoreWriter(tmp_path, 0, 0, 6, token_dtype=torch.float32)
    writer.add_batch([0, 1], tokens[:2], sizes[:2], embeddings[:2])
    writer.add_failure(2, "broken.mp4", "ValueError: no frames")
    writer.add_batch([3], tokens[3:4], sizes[3:4], embeddings[3:4])
    writer.abort()
    with open(tmp_path / "tokens-00000.bin", "ab") as handle:  # a batch written, but never journaled
        handle.write(tokens[4:5].numpy().tobytes())
    with open(tmp_path / "journal-00000.jsonl", "a") as handle:
        handle.write('{"encoded": [4], "num_tok')

    resumed = VideoStoreWriter(tmp_path, 0, 0, 6, token_dtype=torch.float32, resume=True)
    assert resumed.done == {0, 1, 2, 3}
    resumed.add_batch([5, 4], tokens[[5, 4]], sizes[[5, 4]], embeddings[[5, 4]])
    with pytest.raises(ValueError, match="already added"):
        resumed.add_batch([0], tokens[:1], sizes[:1], embeddings[:1])
    resumed.close()
    finalize_store(tmp_path, [f"v{i}" for i in range(6)], 1)
    store = VideoTokenStore(tmp_path)
    valid = [0, 1, 3, 4, 5]
    assert store.valid.tolist() == [True, True, False, True, True, True]
    assert torch.equal(store.read_tokens(torch.tensor(valid)), tokens[valid])
    assert torch.equal(store.read_token_sizes(torch.tensor(valid)), sizes[valid])
    assert torch.equal(store.embeddings[valid], embeddings[valid])
    assert store.failures == [{"index": 2, "video": "broken.mp4", "reason": "ValueError: no frames"}]

    other = VideoStoreWriter(tmp_path / "x", 1, 0, 2, token_dtype=torch.float32)
    other.abort()
    with pytest.raises(ValueError, match="another shard or token dtype"):
        VideoStoreWriter(tmp_path / "x", 1, 0, 2, token_dtype=torch.float16, resume=True)


def test_a_store_grown_in_two_appends_on_two_processes_equals_one_built_at_once(collection, one_process_store,
                                                                                tmp_path):
    """Every other video first (from a list file), then the whole folder: the second run encodes only the 100 new
    videos, each once; the store's order differs from the one-process store's, its embeddings by name and its
    rankings do not. An append with other settings is refused first and changes nothing."""
    root, model = collection
    store = root / "grown"
    videos = sorted(str(p.resolve()) for p in (root / "videos").glob("*.mp4"))
    listing = tmp_path / "half.txt"
    listing.write_text("\n".join(videos[::2]) + "\n")
    run(LAUNCH_2, "--model", model, "--videos", listing, "--store", store, "--token-dtype", "float32",
        "--num-workers", "0", "--shard-size", "16")
    first = json.loads((store / "index_report.json").read_text())
    assert first["videos"] == first["added_this_run"] == first["encoded_this_run"] == NUM_VIDEOS // 2

    before = {p.name: p.stat().st_mtime_ns for p in store.iterdir()}
    refused = run(PLAIN, *common(root, model, store, "--shard-size", "16", "--precision", "int8"), check=False)
    assert refused.returncode != 0 and "precision: the index has 'fp32', this build 'int8'" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert {p.name: p.stat().st_mtime_ns for p in store.iterdir()} == before

    result = run(LAUNCH_2, *common(root, model, store, "--shard-size", "16"))
    assert f"of the {NUM_VIDEOS} given videos, {NUM_VIDEOS // 2} are new and {NUM_VIDEOS // 2} were planned before" \
        in result.stdout
    assert f"({NUM_VIDEOS // 2} added, {NUM_VIDEOS // 2} already indexed, 0 failed this run" in result.stdout
    report = json.loads((store / "index_report.json").read_text())
    assert report["videos"] == NUM_VIDEOS and report["added_this_run"] == report["encoded_this_run"] == NUM_VIDEOS // 2
    assert report["already_in_store"] == NUM_VIDEOS // 2 and report["processes"] == 2
    assert encoded_indices(store) == list(range(NUM_VIDEOS))  # each video journaled exactly once, over both runs
    grown, single = VideoIndex.load(store), VideoIndex.load(one_process_store)
    assert grown.videos[: NUM_VIDEOS // 2] == videos[::2] and sorted(grown.videos) == single.videos
    row = {name: i for i, name in enumerate(grown.videos)}
    torch.testing.assert_close(grown.embeddings[[row[name] for name in single.videos]], single.embeddings,
                               rtol=0, atol=1e-6)
    assert rankings(model, store)[0] == rankings(model, one_process_store)[0]

    again = run(PLAIN, *common(root, model, store, "--shard-size", "16"))  # nothing new: nothing encoded
    assert f"({0} added, {NUM_VIDEOS} already indexed, 0 failed this run" in again.stdout
    assert json.loads((store / "index_report.json").read_text())["encoded_this_run"] == 0


def test_a_folder_with_five_percent_bad_files_in_process(collection, tmp_path, monkeypatch, capsys):
    """76 good videos and one of each kind of bad file (5%), indexed by `train.index.main` in this process: every
    good video encoded once (the encoder's calls are counted), every bad file listed with its reason code, and the
    embeddings those of the pipeline's own encode of the good videos."""
    from helpers.videos import write_bad_videos, write_video

    from testa_search.store.video_store import store_metadata
    from testa_search.cli.index import main

    root, model = collection
    folder = tmp_path / "mixed"
    good = [str(write_noise_video(folder / f"good{i:02d}.mp4", seed=300 + i).resolve()) for i in range(76)]
    source = write_video(tmp_path / "source.mp4", 30, width=176, height=144)
    bad = {code: str(path.resolve()) for code, path in write_bad_videos(folder, source, prefix="bad_").items()}
    encoded = []
    encode = TestaForVideoTextRetrieval.get_video_tokens

    def counting(self, pixel_values, *args, **kwargs):
        encoded.append(int(pixel_values.shape[0]))
        return encode(self, pixel_values, *args, **kwargs)

    monkeypatch.setattr(TestaForVideoTextRetrieval, "get_video_tokens", counting)
    store = tmp_path / "store"
    report = main(["--model", str(model), "--videos", str(folder), "--store", str(store), "--num-workers", "0",
                   "--token-dtype", "float32", "--shard-size", "32"])
    assert sum(encoded) == len(good)
    assert report["videos"] == 80 and report["failed"] == len(bad) == 4
    assert {f["video"]: f["code"] for f in report["failures"]} == {p: c for c, p in bad.items()}
    printed = capsys.readouterr().out
    assert all(f"  failed: {path}: {code}: " in printed for code, path in bad.items())
    metadata = store_metadata(store)
    assert metadata["failures"] == report["failures"] and metadata["videos"] == sorted(good + list(bad.values()))
    index = VideoIndex.load(store)
    assert sorted(f.video for f in index.failures) == sorted(bad.values())
    monkeypatch.undo()
    pipe = VideoTextRetrievalPipeline(model=TestaForVideoTextRetrieval.from_pretrained(model),
                                      processor=TestaProcessor.from_pretrained(model), device="cpu")
    reference = pipe.encode_videos(good, batch_size=8)
    rows = [index.videos.index(path) for path in good]
    torch.testing.assert_close(index.embeddings[rows], reference.embeddings, rtol=0, atol=1e-6)
    hits = pipe.search(QUERIES, index, top_k=None)
    assert not {hit["video"] for ranked in hits for hit in ranked} & set(bad.values())


def test_bad_stores_and_empty_folders_get_one_message_and_nothing_is_written(collection, tmp_path):
    from testa_search.cli.index import main

    root, model = collection
    empty = tmp_path / "no_videos"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(SystemExit, match=r"holds no video .*skipped 1 other files"):
        main(["--model", str(model), "--videos", str(empty), "--store", str(tmp_path / "s1")])
    assert not (tmp_path / "s1").exists()

    not_a_store = tmp_path / "photos"
    not_a_store.mkdir()
    (not_a_store / "a.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(SystemExit, match="holds files that are not a video store"):
        main(["--model", str(model), "--videos", str(root / "videos"), "--store", str(not_a_store)])
    assert [p.name for p in not_a_store.iterdir()] == ["a.jpg"]

    # a store the pipeline built is grown by train.index (one build, one settings file): with other settings it is
    # refused, and nothing in it changes
    pipe = VideoTextRetrievalPipeline(model=TestaForVideoTextRetrieval.from_pretrained(model),
                                      processor=TestaProcessor.from_pretrained(model), device="cpu")
    shared = tmp_path / "shared"
    pipe.encode_videos(sorted(str(p) for p in (root / "videos").glob("*.mp4"))[:3], store_dir=shared)
    before = {p.name: p.stat().st_mtime_ns for p in shared.iterdir()}
    with pytest.raises(SystemExit, match="num_frames: the index has 4, this build 3"):
        main(["--model", str(model), "--videos", str(root / "videos"), "--store", str(shared), "--num-frames", "3"])
    assert {p.name: p.stat().st_mtime_ns for p in shared.iterdir()} == before
    report = main(["--model", str(model), "--videos", str(root / "videos"), "--store", str(shared),
                   "--num-workers", "0"])
    assert report["already_in_store"] == 3 and report["added_this_run"] == NUM_VIDEOS - 3


def test_a_folder_where_no_video_can_be_read_publishes_no_store(collection, tmp_path):
    """Every file bad: one message with the reasons, and no finalised store (it would hold 0-d embeddings)."""
    from helpers.videos import write_bad_videos, write_video

    from testa_search.store.video_store import is_video_store
    from testa_search.cli.index import main

    _, model = collection
    folder = tmp_path / "all_bad"
    source = write_video(tmp_path / "source.mp4", 30, width=176, height=144)
    bad = write_bad_videos(folder, source, prefix="bad_")
    store = tmp_path / "store"
    with pytest.raises(SystemExit, match=rf"None of the {len(bad)} videos could be read.*\n  .*bad_"):
        main(["--model", str(model), "--videos", str(folder), "--store", str(store), "--num-workers", "0"])
    assert not is_video_store(store)


def test_an_index_saved_as_a_store_is_grown_from_its_own_rows_and_never_saved_over_a_store(collection, tmp_path):
    """`VideoIndex.save(as_store=True)` into a folder holding a store is refused and the store keeps its rows; saved
    into a new folder, the store records its settings and `train.index` grows it from its own rows, encoding only
    what it lacks."""
    from testa_search.cli.index import main

    root, model = collection
    videos = sorted(str(p.resolve()) for p in (root / "videos").glob("*.mp4"))[:6]
    lists = {}
    for name, chosen in (("old", videos[:3]), ("other", videos[3:5]), ("grown", videos[3:6])):
        lists[name] = tmp_path / f"{name}.txt"
        lists[name].write_text("\n".join(chosen) + "\n")
    store, other = tmp_path / "store", tmp_path / "other"
    for listing, folder in ((lists["old"], store), (lists["other"], other)):
        main(["--model", str(model), "--videos", str(listing), "--store", str(folder), "--num-workers", "0",
              "--token-dtype", "float32"])
    before = {p.name: p.stat().st_mtime_ns for p in store.iterdir()}
    with pytest.raises(ValueError, match="holds a video store"):
        VideoIndex.load(other).save(store, as_store=True)
    assert {p.name: p.stat().st_mtime_ns for p in store.iterdir()} == before
    assert VideoIndex.load(store).videos == videos[:3]
    saved = tmp_path / "saved"
    VideoIndex.load(other).save(saved, as_store=True)
    assert VideoIndex.load(saved).videos == videos[3:5]
    report = main(["--model", str(model), "--videos", str(lists["grown"]), "--store", str(saved),
                   "--num-workers", "0", "--token-dtype", "float32"])
    assert report["already_in_store"] == 2 and report["added_this_run"] == 1
    grown = VideoIndex.load(saved)
    assert grown.videos == videos[3:6]
    reference = VideoIndex.load(other)
    torch.testing.assert_close(grown.embeddings[:2], reference.embeddings, rtol=0, atol=1e-6)