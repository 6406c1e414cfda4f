"""TESTA video search: a Gradio app (and Hugging Face Space) on the library's pipelines.

    python app/app.py --model FOLDER_OR_HUB_ID --videos DIR [--qa-model FOLDER_OR_HUB_ID] [--window SECONDS]
        [--host 127.0.0.1] [--port N]
    python app/app.py --model M --index STORE [--milvus FILE_OR_URI [--collection C] [--milvus-token TOKEN]]

Index a folder (or uploaded videos), search it by sentence or paragraph, see which frames and patches TESTA merged
for a result and where the query's words land (grounding), classify a video zero-shot, ask a question about it, and
change R_T/R_S live to see what the merging saves (``--allow-settings``: one model serves every visitor, so only
the operator may let a page change it). Each visitor has a `Session` of their own (their indexing, uploads, failures
and results); the served collection is shared and read-only. The ``--videos`` folder is indexed in the background
(`IndexingJob`): the page answers at once, its Index box shows the videos (and moments) done and the failures so far,
and a search runs on what is indexed so far. With a window (``--window`` or the page's "Moments" field), every
video is indexed as windows of that many seconds (one after another) and a result is a moment: its start and end, a
thumbnail from inside it, a strip of its frames, and the video playing from its start. Every step calls the library
by its packages' public names (``from modeling_testa import ...``, ``from testa_search import ...``): the retrieval,
zero-shot and QA pipelines, `visualize_aggregation`, `ground_phrases` / `draw_grounding`, `count_encoder_gmac`,
`set_aggregation`, `moment_frames`, `moment_label` and `open_index`.

API names (stable, for `gradio_client`): ``/index``, ``/search``, ``/visualize``, ``/classify``, ``/answer``,
``/aggregation``, ``/moment``; see `app/README.md`. Analytics are off and the server binds 127.0.0.1 unless
``--host`` (or ``GRADIO_SERVER_NAME``, as Spaces set it) says otherwise.
"""

import argparse
import dataclasses
import functools
import hashlib
import os
import re
import sys
import tempfile
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from modeling_testa import VIDEO_SUFFIXES, find_video_files, format_time, is_video_file_name  # noqa: E402
from testa_search import (  # noqa: E402
    EncodingStats, Failure, IndexEntry, NoReadableVideoError, moment_frames, moment_label, open_index, window_entries,
)

THEME = gr.themes.Default(font=[gr.themes.LocalFont("Source Sans Pro", weights=(400, 700)), "ui-sans-serif",
                                "sans-serif"])  # gradio 6.31's bundled SemiBold file is a broken subset
EXAMPLES = ["first the screen is red. a blue square flashes. finally the screen is green.",
            "a yellow square flashes on a white screen.",
            "first the screen is orange. then the screen is white."]


@dataclass
class Session:
    """One visitor's own part of the app (a `gr.State`: one per page load or `gradio_client.Client`): the index they
    built (None: they search the served collection), what their last indexing said, their indexing job, their last
    search's results and their folder filter. The served collection (`AppState.served`) is a `Session` too, written
    only by the start-up indexing (or a script calling `index_videos` without a session) and only read by visitors: a
    visitor's indexing grows a copy of it (`snapshot`), so no visitor's uploads or failures reach another one."""

    index: Any = None
    indexed: list[str] = field(default_factory=list)
    indexed_folder: str | None = None  # the folder the index was built from (indexing it again grows the index)
    index_status: str = ""  # what the last indexing said (shown in the Index box)
    job: Any = None  # the last `IndexingJob` (one runs at a time)
    hits: list[dict] = field(default_factory=list)  # the last search's results, for /moment
    folder_filter: str = ""  # search only the videos under this folder ("": all)

    @property
    def indexing(self) -> bool:
        return self.job is not None and self.job.running


@dataclass
class AppState:
    """What the app holds for every visitor: the pipelines (None with the reason when a model could not be loaded),
    the served collection, and the page's defaults. What a visitor builds lives in their `Session`."""

    retrieval: Any = None
    classifier: Any = None
    qa: Any = None
    model_error: str | None = None
    qa_error: str | None = None
    videos_dir: str | None = None
    rerank: bool = True  # the page's default for re-ranking
    window: float = 0.0  # seconds per indexed window (moments); 0 indexes whole videos
    allow_settings: bool = False  # whether a visitor may change R_T/R_S (for everyone: there is one model)
    allow_folders: bool = False  # whether a visitor may name any folder or video file of the server
    served: Session = field(default_factory=Session)  # the collection every visitor searches until they index
    thumbnails: dict[tuple, str] = field(default_factory=dict)  # (video, start, end) -> PNG of a frame of it
    lock: threading.Lock = field(default_factory=threading.Lock)  # one index change at a time
    jobs: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # every indexing job, for `stop_indexing`
    output_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="testa-app-"))

    def require_model(self) -> Any:
        if self.retrieval is None:
            raise gr.Error(f"No retrieval model is loaded: {self.model_error}")
        return self.retrieval

    def searched(self, session: Session | None) -> Session:
        """The collection a visitor's requests use: their own once they have indexed (or are indexing), else the
        served one. `session` None: the served one."""
        if session is not None and (session.index is not None or session.indexing):
            return session
        return self.served


def load_state(model: str, videos_dir: str | None, qa_model: str | None, precision: str | None = None,
               backend: str = "torch") -> AppState:
    """Loads the pipelines; a model that cannot be loaded is reported on the page, not fatal. ``precision`` and
    ``backend`` pick the video encoder's runtime (`optimize_for_inference`); an exported engine runs in a worker
    process of its own, so that a crash of the engine cannot take the app down."""
    from transformers import pipeline

    from testa_runtimes import isolated_by_default

    state = AppState(videos_dir=videos_dir)
    try:
        runtime = {} if precision is None else {"precision": precision, "backend": backend,
                                                "isolate": isolated_by_default(backend)}
        state.retrieval = pipeline("video-text-retrieval", model=model, trust_remote_code=True, **runtime)
        state.classifier = pipeline("zero-shot-video-classification", model=state.retrieval.model,
                                    processor=state.retrieval.processor, trust_remote_code=True)
    except (OSError, ValueError, TypeError, KeyError) as error:
        state.model_error = f"--model {model!r} could not be loaded ({type(error).__name__}: {error})"
    if qa_model:
        try:
            state.qa = pipeline("video-question-answering", model=qa_model, trust_remote_code=True)
        except (OSError, ValueError, TypeError, KeyError) as error:
            state.qa_error = f"--qa-model {qa_model!r} could not be loaded ({type(error).__name__}: {error})"
    else:
        state.qa_error = "no VideoQA model: start the app with --qa-model FOLDER_OR_HUB_ID"
    return state


def index_videos(state: AppState, folder: str, uploads: list[str] | None, progress: Any = None,
                 window: float | None = None, session: Session | None = None) -> str:
    """Indexes the folder's videos and the uploads, each video encoded once, and returns what it did; files that
    cannot be read are left out and listed with their reasons. Indexing the folder of the current index again adds
    only the videos it lacks (and the uploads); another folder, or uploads alone, start a new index. With a `window`
    (seconds; default: the app's), every video becomes windows of that length, one after another (the library's
    default stride): moments. Runs in the calling thread (an `IndexingJob`), telling `progress` (a `gr.Progress`) the
    moments or videos done after each step. The index is the visitor's `session`'s (grown from a copy of the
    collection they search; its folder is checked by `check_folder`); without a session it is the served collection
    every visitor searches."""
    return new_indexing_job(state, folder, uploads, window, session=session).run(progress)


def new_indexing_job(state: AppState, folder: str, uploads: list[str] | None, window: float | None,
                     background: bool = False, session: Session | None = None) -> "IndexingJob":
    """The job that indexes the folder's videos and the uploads into `session` (None: the served collection; see
    `index_videos`); refused with the reason (a `gr.Error`) when there is no video to index, the window is negative,
    or an indexing job of the session or of the served collection is running."""
    state.require_model()
    window = state.window if window is None else float(window or 0)
    if window < 0:
        raise gr.Error(f"Moments: the window must be a positive number of seconds (0 for whole videos), got {window}.")
    folder = (folder or "").strip()
    if session is not None:
        check_folder(state, folder)
    paths, others = [], []
    if folder:
        try:
            paths, others = find_video_files(folder)
        except NotADirectoryError as error:
            raise gr.Error(str(error)) from None
    for upload in uploads or []:
        (paths if is_video_file_name(upload) else others).append(str(upload))
    if not paths:
        raise gr.Error(f"No video to index in {folder!r}" + (" or the uploads" if uploads else "") +
                       f" (looked for {', '.join(VIDEO_SUFFIXES)}; {len(others)} other files).")
    target = state.served if session is None else session
    job = IndexingJob(state, folder, paths, others, window, background, target)
    with state.lock:
        for busy in (target, state.served):
            if busy.indexing:
                raise gr.Error(f"{busy.job.describe()} Index again when it has finished.")
        target.job = job
    return job


FOLDERS_OFF = "The app's operator can allow any file or folder of the server with --allow-folders."


def served_folder(state: AppState) -> Path | None:
    """The ``--videos`` folder, resolved (None without one)."""
    return Path(state.videos_dir).expanduser().resolve() if state.videos_dir else None


def inside(path: str, folder: Path | None) -> bool:
    """Whether `path` (resolved: ``..`` and links followed) is `folder` or lies under it."""
    return folder is not None and Path(path).expanduser().resolve().is_relative_to(folder)


def check_folder(state: AppState, folder: str) -> None:
    """Refuses (a `gr.Error`) a visitor's folder other than the served collection's (or one inside it), unless the
    app was started with ``--allow-folders``: without it a visitor would have the app read and index any folder of
    the server. No folder (uploads alone) is always allowed."""
    if state.allow_folders or not folder or inside(folder, served_folder(state)):
        return
    served = f" ({state.videos_dir}, or a folder inside it)" if state.videos_dir else ""
    raise gr.Error(f"Folder {folder!r}: only the served collection's folder{served} may be indexed here; upload "
                   f"videos to add others. {FOLDERS_OFF}")


def check_video(state: AppState, video: str, session: Session | None) -> None:
    """Refuses (a `gr.Error`) a video path a visitor typed that is not a video of the collection they search (the
    served one, or their own: the served videos and their uploads), of their last search's results, or a file of
    the served folder, unless the app was started with ``--allow-folders``: the Visualize, Classify and Ask boxes
    would otherwise decode any file of the server. A script (`session` None) may name any file."""
    if session is None or state.allow_folders:
        return
    video = str(video)
    if (any(str(hit["video"]) == video for hit in session.hits) or video in session.indexed
            or video in state.served.indexed or inside(video, served_folder(state))):
        return
    raise gr.Error(f"{Path(video).name!r} is not a video of this collection: choose a search result, a video of the "
                   f"served folder or one you uploaded and indexed. {FOLDERS_OFF}")


def check_chosen_video(state: AppState, video: str, session: Session | None) -> None:
    """Refuses (a `gr.Error`) an empty choice or a missing file in the Classify and Ask boxes, after `check_video`."""
    if video:
        check_video(state, video, session)
    if not video or not Path(video).is_file():
        raise gr.Error(f"Choose or upload a video (got {video!r}).")


CHUNK_VIDEOS = 16
"""Whole videos encoded per step of an indexing job (a video's moments are one step): the index is published after
each step, so a search sees the videos indexed so far."""


def encode_first_video(retrieval: Any, video: str, options: dict[str, Any]) -> tuple[Any, dict | None]:
    """A new index of one video (`encode_videos` with `options`) and None, or, when the video cannot be read, None
    and its `Failure` as a dict. An index cannot start with failures alone, so `encode_videos` refuses it with a
    `NoReadableVideoError`, whose `failures` say why: the video is decoded once."""
    try:
        return retrieval.encode_videos([video], **options), None
    except NoReadableVideoError as error:
        return None, error.failures[0].as_dict()


def snapshot(index: Any) -> Any:
    """A copy of an in-memory `VideoIndex` that growing the original (`add`) leaves as it is: `add` concatenates into
    new tensors and lists, so the copy shares the tensors and holds its own lists (and no first stage: it is built
    when searched)."""
    return dataclasses.replace(index, videos=list(index.videos), failures=[f.as_dict() for f in index.failures])


def stats_of(index: Any) -> EncodingStats:
    """The `EncodingStats` of the `encode_videos` call that returned `index`."""
    names = ("videos", "seconds", "decode_wait_seconds", "encode_seconds", "num_workers", "failed")
    return EncodingStats(**{name: index.stats.get(name, 0) for name in names})


def speed(stats: EncodingStats, unit: str) -> str:
    """``"12.3 videos/s, 40% of the time waiting for decoding"``, over the videos (moments) encoded: the failed ones
    are left out, as they took no encoding."""
    encoded = stats.videos - stats.failed
    waiting = 100 * stats.decode_wait_seconds / stats.seconds if stats.seconds else 0.0
    rate = encoded / stats.seconds if stats.seconds > 0 else float("inf")
    return f"{rate:.1f} {unit}/s, {waiting:.0f}% of the time waiting for decoding"


ERRNO = re.compile(r"\[Errno -?\d+\]\s*")
PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][^\s'\"\\/:,;()]+){2,}[\\/]?")  # two or more parts: "/tmp/x/a.mp4"


def plain_text(text: str) -> str:
    """`text` for the page: an errno's number dropped (``[Errno 2] ``), and every file path shortened to the file's
    name (an upload's path is a temporary folder of gradio's, which says nothing to the visitor)."""
    return PATH.sub(lambda match: Path(match.group(0).rstrip("/\\")).name or match.group(0), ERRNO.sub("", text))


def plain_reason(failure: Failure) -> str:
    """A failure's first line for the page: its code and a plain reason (`plain_text`)."""
    return plain_text(str(failure).splitlines()[0])


def plain_summary(failures: list[Failure], total: int) -> str:
    """`failure_summary` for the page: file names and plain reasons."""
    lines = [f"  {Path(failure.video).name}: {plain_reason(failure)[:300]}" for failure in failures[:8]]
    more = [f"  ... and {len(failures) - 8} more"] if len(failures) > 8 else []
    return f"{len(failures)} of {total} videos could not be read and were skipped:\n" + "\n".join(lines + more)


@dataclass(frozen=True)
class IndexingProgress:
    """How far an indexing job has got: videos and rows (a video's moments, or 1 for a whole video) done of the
    total, the failures so far (`Failure` records: a whole video, or one moment of it), and whether it finished."""

    videos_done: int = 0
    videos_total: int = 0
    rows_done: int = 0
    rows_total: int = 0
    failures: tuple = ()
    finished: bool = False


class IndexingJob:
    """One indexing run over a list of videos, a step at a time (`CHUNK_VIDEOS` whole videos, or one video's
    moments), into `target` (a visitor's `Session`, or the served collection). After every step the index built so
    far is published to `target` as a `snapshot`, so that a search runs on it while the next step is encoded.
    `progress()` and `describe()` say how far it got; `wait` and
    `wait_for` block until it finishes or gets somewhere."""

    def __init__(self, state: AppState, folder: str, paths: list[str], others: list[str], window: float,
                 background: bool = False, target: Session | None = None):
        self.state, self.folder, self.paths, self.others, self.background = state, folder, paths, others, background
        self.target = state.served if target is None else target
        self.folder_key = str(Path(folder).expanduser().resolve()) if folder else None
        self.moments = {"window": window} if window > 0 else {}  # the stride: the library's default (the window)
        self.changed = threading.Condition()  # notified at every step
        self.current = IndexingProgress(videos_total=len(paths))  # the rows are known once planned (`plan`)
        self.rows_per_video: Counter = Counter(paths)  # planned by `plan`: a video's windows, or 1
        self.status = ""  # the final report, or why the job failed
        self.stopping = threading.Event()  # set by `stop`: the job ends after its current step
        self.thread: threading.Thread | None = None  # the thread of a started job
        state.jobs.add(self)

    # -- watching ----------------------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return not self.progress().finished

    def progress(self) -> IndexingProgress:
        with self.changed:
            return self.current

    def wait_for(self, predicate: Any, timeout: float) -> bool:
        """Blocks until ``predicate(progress())`` holds or the job finishes, at most `timeout` seconds (a bound on a
        stall, not a guess of how long indexing takes); returns whether the predicate holds."""
        with self.changed:
            self.changed.wait_for(lambda: predicate(self.current) or self.current.finished, timeout)
            return bool(predicate(self.current))

    def wait(self, timeout: float) -> bool:
        """Blocks until the job has finished (True), at most `timeout` seconds."""
        return self.wait_for(lambda progress: progress.finished, timeout)

    def describe(self) -> str:
        """The Index box's text: the final report once finished, else how far the job has got."""
        progress = self.progress()
        if progress.finished:
            return self.status
        text = f"Indexing {self.folder or 'the uploads'}: {progress.videos_done} of {progress.videos_total} videos"
        if self.moments:
            text += f" ({progress.rows_done} of {progress.rows_total} moments)" if progress.rows_total else (
                " (planning the moments)")
        text += f" done, {len(progress.failures)} failed so far"
        if progress.failures:
            last = progress.failures[-1]
            text += f" (last: {Path(last.video).name}: {plain_reason(last)[:200]})"
        return text + ". Searches use what is indexed so far."

    # -- running -----------------------------------------------------------------------------------------------------

    def start(self) -> "IndexingJob":
        self.thread = threading.Thread(target=self.run_quietly, name="testa-app-indexing", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        """Asks the job to end after its current step (it then fails with the reason "the app is closing")."""
        self.stopping.set()

    def run_quietly(self) -> None:
        """`run`, for a thread: what it did, or why it failed, goes to the log (and the page's Index box)."""
        try:
            self.run()
        except Exception:  # noqa: BLE001 - `run` left the reason in `status`
            print(self.status, file=sys.stderr, flush=True)
        else:
            print(self.status, flush=True)

    def run(self, progress: Any = None) -> str:
        """Indexes every video, step by step, and returns the report (also left in `status` and the target's
        `index_status`); raises `gr.Error` when no video could be indexed, and the encoder's own error."""
        succeeded = False
        try:
            self.status = self.index(progress)
            succeeded = True
        except Exception as error:
            reason = error.message if isinstance(error, gr.Error) else f"{type(error).__name__}: {error}"
            self.status = f"The start-up index of {self.folder} failed: {reason}" if self.background else reason
            raise
        finally:
            with self.changed:
                if succeeded or self.background:  # a failed click keeps the last index and its status
                    self.target.index_status = self.status
                self.current = dataclasses.replace(self.current, finished=True)
                self.changed.notify_all()
        return self.status

    def index(self, progress: Any) -> str:
        with self.state.lock:  # the collection the target searches now: its own, or the served one (never grown)
            source = self.target if self.target.index is not None else self.state.served
            base = source.index
            grow = (base is not None and self.folder_key is not None and self.folder_key == source.indexed_folder
                    and base.info.get("window", 0) == self.moments.get("window", 0))
        known = set(base.names) | {failure.video for failure in base.failures} if grow else set()
        todo = [path for path in self.paths if path not in known]
        self.plan(todo)
        building = snapshot(base) if grow else None
        early: list[dict] = []  # failures before the index exists (a step is then one video, until one is indexed)
        stats: list[EncodingStats] = []
        done = 0
        while done < len(todo):
            if self.stopping.is_set():  # the app is closing (`stop_indexing`): no new step
                raise gr.Error(f"Indexing stopped after {done} of {len(todo)} videos: the app is closing.")
            size = 1 if self.moments or building is None else CHUNK_VIDEOS
            step = todo[done:done + size]
            if progress is not None:
                current = self.progress()
                progress((current.rows_done, current.rows_total), desc=f"Encoding {len(todo)} videos",
                         unit="moments" if self.moments else "videos")
            building, failure = self.encode_step(building, step)
            early += [failure] if failure else []
            if building is not None:
                stats.append(stats_of(building))
                if early:  # the failures met before the index existed join it
                    building = dataclasses.replace(building, failures=[*early, *snapshot(building).failures])
                    early = []
                self.publish(building)
            done += len(step)
            self.advance(step, building, failure)
        if building is None:
            failures = [Failure.from_dict(failure) for failure in early]
            raise gr.Error("No video could be indexed: " + plain_summary(failures, len(todo)))
        return self.report(building, len(base) if grow else 0, stats)

    def plan(self, todo: list[str]) -> None:
        """The rows each video to index will give (its windows, planned from its duration; nothing decoded)."""
        if self.moments:
            rows = window_entries([IndexEntry(video) for video in todo], self.moments["window"],
                                  self.moments["window"])  # as encoded: stride = window, the library's default
            self.rows_per_video = Counter(str(row.video) for row in rows)
        else:
            self.rows_per_video = Counter(todo)
        with self.changed:
            self.current = IndexingProgress(videos_total=len(todo), rows_total=sum(self.rows_per_video.values()))
            self.changed.notify_all()

    def encode_step(self, building: Any, videos: list[str]) -> tuple[Any, dict | None]:
        """Encodes `videos` into `building` (grown in place; None: a new index) and returns it, or (before the first
        video is indexed) None and the failure of the step's one video, as a dict (`encode_first_video`)."""
        retrieval = self.state.require_model()
        options = {"batch_size": 8, "progress_bar": False, **self.moments}
        if building is not None:
            return retrieval.encode_videos(videos, index=building, **options), None
        return encode_first_video(retrieval, videos[0], options)

    def publish(self, building: Any) -> None:
        """Hands the index built so far to the target (a `snapshot`: the next step grows `building` only)."""
        published = snapshot(building)
        with self.state.lock:
            self.target.index, self.target.indexed = published, [str(video) for video in published.videos]
            self.target.indexed_folder = self.folder_key

    def advance(self, step: list[str], building: Any, failure: dict | None) -> None:
        """Counts the step's videos, rows and failures as done."""
        videos = set(step)
        failed = [Failure.from_dict(failure)] if failure else [
            f for f in building.failures if f.video in videos] if building is not None else []
        with self.changed:
            current = self.current
            self.current = dataclasses.replace(
                current, videos_done=current.videos_done + len(step),
                rows_done=current.rows_done + sum(self.rows_per_video[video] for video in step),
                failures=current.failures + tuple(failed))
            self.changed.notify_all()

    def report(self, index: Any, before: int, stats: list[EncodingStats]) -> str:
        """What the job did: videos (moments) indexed, new ones, speed, and every file left out with the reason."""
        requested = set(self.paths)
        failed = [(failure.video, plain_reason(failure)) for failure in index.failures if failure.video in requested]
        head = f"Indexed {len(index)} videos"
        if self.moments:
            head = (f"Indexed {len(set(index.names))} videos as {len(index)} moments (windows of "
                    f"{index.info['window']:g} s every {index.info['stride']:g} s)")
        if before:
            head += f" ({len(index) - before} new, {before} already indexed)" if not self.moments else (
                f" ({len(index) - before} new moments, {before} already indexed)")
        total = functools.reduce(EncodingStats.merged, stats) if stats else None
        if total is not None and total.videos > total.failed:
            head += f": {speed(total, 'moments' if self.moments else 'videos')}."
        else:
            head += ": nothing new to encode." if not failed or total is None else ": nothing could be encoded."
        lines = [head]
        lines += [f"Not a video, skipped: {Path(other).name}" for other in self.others]
        lines += [f"Could not be decoded, skipped: {Path(video).name}: {reason[:300]}" for video, reason in failed]
        return "\n".join(lines)


def search_videos(state: AppState, query: str, top_k: float, rerank: bool = True, session: Session | None = None
                  ) -> tuple[list, list[list], str]:
    """Ranked videos of the collection `session` searches (`AppState.searched`): gallery items (a picture of a frame
    from the middle of each moment or video), table rows (rank, video, score, re-ranked; start and end for moments)
    and the best video's path. With ``rerank`` the matching head re-scores the model's ``k_test`` nearest videos;
    otherwise the cosine ranks. While an indexing job runs, the search runs on what is indexed so far and the page
    says so."""
    retrieval = state.require_model()
    if not query or not query.strip():
        raise gr.Error("Type a sentence or a paragraph to search for.")
    own = state.served if session is None else session
    with state.lock:
        collection = state.searched(own)
        index, job = collection.index, collection.job
    running = job is not None and job.running
    if index is None:
        raise gr.Error(f"{job.describe()} Nothing is indexed yet: search again in a moment." if running else
                       "Index a folder first.")
    if running:
        progress = job.progress()
        gr.Warning(f"Indexing is still running: searched the {len(index)} rows indexed so far ({progress.videos_done} "
                   f"of {progress.videos_total} videos done).")
    folder_filter = own.folder_filter.strip()
    filters = {"folder": folder_filter} if folder_filter else None
    try:
        hits = retrieval.search(query.strip(), index, top_k=max(1, int(top_k)), rerank=None if rerank else False,
                                filters=filters)
    except ValueError as error:  # e.g. an index encoded before R_T/R_S changed: the settings check names the change
        raise gr.Error(f"{plain_text(str(error))} Index again.") from None
    if not hits:
        raise gr.Error(f"No indexed video lies under {folder_filter!r}.")
    own.hits = hits
    gallery = [(moment_thumbnail(state, hit), f"{Path(hit['video']).name}  {hit['score']:.3f}" + moment_label(hit))
               for hit in hits]
    rows = [[rank, Path(hit["video"]).name, round(float(hit["score"]), 4), bool(hit["reranked"])]
            for rank, hit in enumerate(hits, 1)]
    if any(hit.get("start") is not None for hit in hits):  # moments: two more columns
        rows = [row + [format_time(hit.get("start")), format_time(hit.get("end"))] for row, hit in zip(rows, hits)]
        import pandas as pd  # a gradio dependency; a DataFrame's columns become the table's headers

        return gallery, pd.DataFrame(rows, columns=MOMENT_HEADERS), hits[0]["video"]
    return gallery, rows, hits[0]["video"]


THUMBNAIL_SIZE = (320, 180)  # the largest thumbnail (a frame is scaled down to fit, keeping its aspect)


def moment_thumbnail(state: AppState, hit: dict) -> str:
    """The gallery's picture of a result: a PNG of the frame at the middle of its moment (`moment_frames`), or of
    the whole video (`decode_video`, one frame), cached per result, so that a tile shows a picture at once rather
    than a player that waits for its video; a frame that cannot be decoded: the video itself (the strip says why)."""
    from PIL import Image

    video, start, end = hit["video"], hit.get("start"), hit.get("end")
    key = (str(video), None if start is None else float(start), None if end is None else float(end))
    if key not in state.thumbnails:
        try:
            frame = (spread_frames(video, 1)[0] if start is None else moment_frames(video, start, end, num_frames=1))[0]
        except (ValueError, OSError):
            return video
        picture = Image.fromarray(frame)
        picture.thumbnail(THUMBNAIL_SIZE)
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
        span = "whole" if start is None else f"{start:.0f}_{end:.0f}"
        path = Path(state.output_dir) / f"thumbnail_{Path(video).stem}_{span}_{digest}.png"
        picture.save(path)
        state.thumbnails[key] = str(path)
    return state.thumbnails[key]


def spread_frames(video: str, count: int) -> tuple[Any, Any]:
    """`count` frames spread over a whole video (`(count, H, W, 3)` uint8; one frame: the middle one) and its
    metadata, only those frames decoded."""
    from modeling_testa import decode_video, sample_frame_indices

    return decode_video(video, lambda metadata: sample_frame_indices(metadata.total_num_frames, count))


HEADERS = ["rank", "video", "score", "re-ranked"]
MOMENT_HEADERS = HEADERS + ["start", "end"]


def show_moment(state: AppState, rank: float, session: Session | None = None
                ) -> tuple[str | None, str | None, float, str]:
    """The moment of the result at `rank` (1-based) of the session's last search: a strip of its frames (PNG), the
    video, the second to play it from, and a caption. A whole-video result shows frames of the whole video, played
    from 0."""
    from PIL import Image

    hits = (state.served if session is None else session).hits
    if not hits:
        raise gr.Error("Search first.")
    rank = int(rank or 1)
    if not 1 <= rank <= len(hits):
        raise gr.Error(f"Rank {rank} is not among the {len(hits)} results.")
    hit = hits[rank - 1]
    video, start, end = hit["video"], hit.get("start"), hit.get("end")
    try:
        if start is None:  # a whole video: frames spread over all of it
            frames, metadata = spread_frames(video, MOMENT_FRAMES)
            start, end = 0.0, metadata.duration or 0.0
        else:
            frames = moment_frames(video, start, end, num_frames=MOMENT_FRAMES)
    except (ValueError, OSError) as error:
        raise gr.Error(f"Could not show {Path(video).name} {moment_label(hit)}: {plain_text(str(error))}") from None
    height = 96
    width = max(1, round(frames.shape[2] * height / frames.shape[1]))
    strip = Image.new("RGB", (len(frames) * (width + 4), height), "white")
    for i, frame in enumerate(frames):
        strip.paste(Image.fromarray(frame).resize((width, height)), (i * (width + 4), 0))
    path = Path(state.output_dir) / f"moment_{rank}_{Path(video).stem}_{start:.0f}_{end:.0f}.png"
    strip.save(path)
    caption = f"**{Path(video).name}** from {format_time(start)} to {format_time(end)} (rank {rank})"
    return str(path), video, float(start), caption


def best_moment(state: AppState, session: Session | None = None, rank: float = 1
                ) -> tuple[str | None, str | None, float, str]:
    """After a search (the best result) or a click on a tile (its `rank`): that result's moment when the results
    are moments (`show_moment`); an empty moment panel for whole videos (the moment widgets are hidden then)."""
    hits = (state.served if session is None else session).hits
    if hits and hits[0].get("start") is not None:
        return show_moment(state, rank, session)
    return None, None, 0.0, ""


MOMENT_FRAMES = 6
# Plays the moment's video from its start: waits (up to 10 s) until the player holds the moment's video (`file`, the
# player's value: a new video replaces the old one's element source asynchronously), then seeks once it can.
PLAY_FROM_START = """(start, file) => {
  const served = url => {
    try { return decodeURIComponent(String(url).split('file=').pop()); } catch (e) { return String(url); }
  };
  const wanted = file && file.url ? served(file.url) : null;
  const deadline = Date.now() + 10000;
  const seek = () => {
    const video = document.querySelector('#moment-video video');
    const holds = video && video.currentSrc && (wanted === null || served(video.currentSrc) === wanted);
    if (!holds) { if (Date.now() < deadline) setTimeout(seek, 100); return; }
    const go = () => { video.currentTime = start; video.dataset.momentStart = String(start); };
    if (video.readyState >= 1) go(); else video.addEventListener('loadedmetadata', go, {once: true});
  };
  seek();
  return [];
}"""


def visualize_result(state: AppState, video: str, query: str, session: Session | None = None
                     ) -> tuple[str, str | None, str]:
    """The merge picture of ``video`` and, with a query, the grounding of its words. A visitor's `session` may name
    only the collection's videos (`check_video`)."""
    from modeling_testa import draw_grounding, ground_phrases, visualize_aggregation

    retrieval = state.require_model()
    if not video:
        raise gr.Error("Choose a result (search first).")
    check_video(state, video, session)
    if not Path(video).is_file():
        raise gr.Error(f"{video!r} does not exist.")
    out = Path(state.output_dir)
    try:
        merges = visualize_aggregation(retrieval.model, retrieval.processor, video)
    except (ValueError, OSError) as error:
        raise gr.Error(f"Could not draw {Path(video).name}: {plain_text(str(error))}") from None
    merge_path = out / f"merges_{Path(video).stem}.png"
    merges.save(merge_path)
    frames = merges.info.get("frame_groups", [])
    caption = (f"{Path(video).name}: {len(frames)} input frames, {len(set(g for g in frames if g >= 0))} frames "
               "after the last block")
    grounding_path = None
    words = [w for w in (query or "").replace(".", " ").split() if len(w) > 2][:6]
    if words:
        grounding = ground_phrases(retrieval.model, retrieval.processor, video, words)
        grounding_path = out / f"grounding_{Path(video).stem}.png"
        draw_grounding(grounding).save(grounding_path)
        grounding_path = str(grounding_path)
    return str(merge_path), grounding_path, caption


def classify_video(state: AppState, video: str, labels: str, session: Session | None = None) -> dict[str, float]:
    """Zero-shot labels -> scores for one video (of the collection, for a visitor's `session`: `check_video`)."""
    state.require_model()
    names = [label.strip() for label in (labels or "").split(",") if label.strip()]
    if len(names) < 2:
        raise gr.Error("Give at least two labels, separated by commas.")
    check_chosen_video(state, video, session)
    try:
        result = state.classifier(video, candidate_labels=names)
    except (ValueError, OSError) as error:
        raise gr.Error(f"Could not classify {Path(video).name}: {plain_text(str(error))}") from None
    return {item["label"]: float(item["score"]) for item in result}


def answer_question(state: AppState, video: str, question: str, session: Session | None = None) -> str:
    """The VideoQA model's answer about ``video`` (of the collection, for a visitor's `session`: `check_video`)."""
    if state.qa is None:
        raise gr.Error(state.qa_error)
    if not question or not question.strip():
        raise gr.Error("Type a question.")
    check_chosen_video(state, video, session)
    try:
        result = state.qa(video=video, question=question.strip())
    except (ValueError, OSError) as error:
        raise gr.Error(f"Could not answer about {Path(video).name}: {plain_text(str(error))}") from None
    return str(result[0]["answer"])


def model_panel(state: AppState) -> str:
    """Frames, R_T/R_S, tokens and GMAC against the same encoder without aggregation."""
    from modeling_testa import TestaVisionConfig, count_encoder_gmac

    if state.retrieval is None:
        return f"**No model loaded.** {state.model_error}"
    vision = state.retrieval.model.config.vision_config
    plain = TestaVisionConfig(**{**vision.to_dict(), "temporal_reduction": 0, "spatial_reduction": 0})
    gmac, tokens = count_encoder_gmac(vision)
    gmac_plain, tokens_plain = count_encoder_gmac(plain)
    return (f"{vision.num_frames} frames of {vision.image_size} px, {vision.num_hidden_layers} blocks; "
            f"R_T {vision.temporal_reduction_per_layer}, R_S {vision.spatial_reduction_per_layer}\n\n"
            f"Video tokens: {tokens} (without aggregation {tokens_plain}); encoder: {gmac:.4g} GMAC per video "
            f"(without aggregation {gmac_plain:.4g}: {gmac_plain / gmac:.2f}x)")


def change_aggregation(state: AppState, temporal: float, spatial: float, session: Session | None = None) -> str:
    """Sets R_T/R_S on the model (`set_aggregation`) and re-indexes the served collection and `session`'s own index
    with them. There is one model, so the change is every visitor's: a page may make it only when the app was
    started with ``--allow-settings`` (`AppState.allow_settings`; a script, `session` None, always may); another
    visitor's own index, encoded with the old settings, is then refused by their next search, naming the change.
    Refused while an indexing job runs (its videos would be encoded with two settings)."""
    retrieval = state.require_model()
    if session is not None and not state.allow_settings:
        raise gr.Error("Changing R_T/R_S is off: there is one model for every visitor, so a change would be "
                       "everyone's. The app's operator can allow it with --allow-settings.")
    for busy in (state.served, session):
        if busy is not None and busy.indexing:
            raise gr.Error(f"{busy.job.describe()} Change R_T/R_S when it has finished.")
    try:
        retrieval.model.set_aggregation(temporal_reduction=int(temporal), spatial_reduction=int(spatial))
    except ValueError as error:
        raise gr.Error(f"R_T={int(temporal)}, R_S={int(spatial)}: {error}") from None
    panel = model_panel(state)
    own = [session] if session is not None and session is not state.served else []
    for collection in [c for c in (state.served, *own) if c.indexed]:
        with state.lock:
            panel += "\n\n" + reindex(retrieval, collection)
    return panel


def reindex(retrieval: Any, collection: Session) -> str:
    """Encodes `collection`'s videos again with the model's current settings (an index of moments as moments, each
    video once; known bad files are not decoded again) and says how fast."""
    failures = list(collection.index.failures)
    info = collection.index.info
    moments = {"window": info["window"], "stride": info["stride"]} if info.get("window") else {}
    videos = list(dict.fromkeys(collection.indexed))
    collection.index = retrieval.encode_videos(videos, batch_size=8, progress_bar=False, **moments)
    collection.index.failures += [failure for failure in failures if failure not in collection.index.failures]
    rate = speed(stats_of(collection.index), "moments" if moments else "videos").split(",")[0]
    return f"Re-indexed {len(videos)} videos with these settings: {rate}."


def chosen_rank(event: gr.SelectData) -> int:
    """The 1-based rank of the gallery result a user clicked."""
    return int(event.index) + 1 if isinstance(event.index, int) else 1


def chosen_video(session: Session, event: gr.SelectData) -> str | None:
    """The path of the video of the gallery result a user clicked (a tile is a picture of it: its video is the
    session's last search's result at that rank)."""
    value = event.value if isinstance(event.value, dict) else {}
    if isinstance(value.get("video"), dict):
        return value["video"].get("path")
    rank = chosen_rank(event)
    return session.hits[rank - 1]["video"] if 1 <= rank <= len(session.hits) else None


POLL_SECONDS = 1.0  # how often an open page refreshes the Index box while an indexing job runs

# Every listener that uses the model or the index shares one queue: a search never sees a half-grown index or a
# model whose R_T/R_S is being changed (gradio's concurrency limit is per listener unless they share an id).
ONE_MODEL = {"concurrency_id": "model", "concurrency_limit": 1}


def build_app(state: AppState) -> gr.Blocks:
    """The page. Every visitor gets a `Session` of their own (`gr.State`, made when the page loads or a client
    connects): their indexing, search results and folder filter are theirs; the served collection and the model are
    shared. Each panel is filled when the page loads (the Index box, the Model tab, the moment widgets), so a page
    shows the app as it is then, not as it was when the app started."""
    vision = state.retrieval.model.config.vision_config if state.retrieval is not None else None
    with gr.Blocks(title="TESTA video search", delete_cache=(3600, 3600)) as demo:
        # one Session per visitor: a callable, not the class (gradio would read a dataclass's fields as its value)
        session = gr.State(lambda: Session())
        gr.Markdown("# TESTA video search\nSearch a folder of videos by sentence or paragraph. TESTA merges similar "
                    "frames and patches inside its video encoder; the pictures show what it merged.")
        if state.model_error:
            gr.Markdown(f"**Error:** {state.model_error}")
        with gr.Tab("Search"):
            with gr.Row():
                folder = gr.Textbox(label="Folder", value=state.videos_dir or "", scale=3, info=None if
                                    state.allow_folders else "the served collection's folder, or one inside it "
                                    "(the operator allows others with --allow-folders)")
                uploads = gr.File(label="Or upload videos", file_count="multiple", type="filepath", scale=2)
                window = gr.Number(value=state.window, minimum=0, label="Moments: seconds per window (0: whole videos)",
                                   scale=1)
                index_button = gr.Button("Index", variant="secondary", scale=1)
            status = gr.Textbox(label="Index", interactive=False, lines=2)
            poll = gr.Timer(POLL_SECONDS, active=False)
            query = gr.Textbox(label="Paragraph", lines=2, placeholder="a sentence or a paragraph")
            with gr.Row():
                top_k = gr.Slider(1, 20, value=5, step=1, label="Results")
                rerank = gr.Checkbox(value=state.rerank, label="Re-rank with the matching head")
                search_button = gr.Button("Search", variant="primary")
            folder_filter = gr.Textbox(label="Only videos under this folder (empty: all)", value="")
            gr.Examples(EXAMPLES, inputs=query)
            gallery = gr.Gallery(label="Results", columns=5, height=220)
            table = gr.Dataframe(headers=HEADERS, label="Ranking", interactive=False)
            with gr.Row(visible=False) as moment_row:  # shown only while the searched index holds moments
                moment_rank = gr.Number(value=1, precision=0, label="Moment of result", minimum=1, scale=1)
                moment_button = gr.Button("Show the moment", scale=1)
                moment_caption = gr.Markdown()
            with gr.Row(visible=False) as moment_player_row:
                moment_strip = gr.Image(label="Frames of the moment", type="filepath", height=120, scale=3)
                moment_video = gr.Video(label="The moment", elem_id="moment-video", height=240, scale=2)
            moment_start = gr.Number(visible=False)
            result = gr.Textbox(label="Result to inspect (click a video above to choose another)")
            show_button = gr.Button("What did TESTA merge?")
            caption = gr.Markdown()
            with gr.Row():
                merges = gr.Image(label="Merged frames and patches", type="filepath", height=320)
                grounding = gr.Image(label="Where the query's words land", type="filepath", height=320)
        with gr.Tab("Classify"):
            classify_video_input = gr.Textbox(label="Video path (e.g. a search result)")
            labels = gr.Textbox(label="Labels, comma separated", value="red screen, green screen, blue square")
            classify_button = gr.Button("Classify")
            label_scores = gr.Label(label="Scores")
        with gr.Tab("Ask"):
            qa_video = gr.Textbox(label="Video path (e.g. a search result)")
            question = gr.Textbox(label="Question")
            answer_button = gr.Button("Answer")
            answer = gr.Textbox(label="Answer", interactive=False)
        with gr.Tab("Model"):
            panel = gr.Markdown()
            # bipartite matching merges at most half of the frames (patches) of a block
            temporal = gr.Slider(0, vision.num_frames // 2 if vision else 1, step=1, value=0,
                                 label="R_T (frames merged per block)", interactive=state.allow_settings)
            spatial = gr.Slider(0, vision.num_patches_per_frame // 2 if vision else 1, step=1, value=0,
                                label="R_S (patches merged per frame and block)", interactive=state.allow_settings)
            apply_button = gr.Button("Apply and re-index", interactive=state.allow_settings)
            if not state.allow_settings:
                gr.Markdown("R_T/R_S are the operator's to change (`--allow-settings`): there is one model for "
                            "every visitor.")

        moment_widgets = [moment_row, moment_player_row]

        def on_load(own: Session) -> tuple:  # every panel as the app is now
            temporal_now, spatial_now = current_reductions(state)
            return (index_box(state, own), polling(state, own), model_panel(state), temporal_now, spatial_now,
                    *moment_visibility(state, own))

        demo.load(on_load, session, [status, poll, panel, temporal, spatial, *moment_widgets], api_name=False,
                  show_progress="hidden")
        poll.tick(lambda own: (index_box(state, own), polling(state, own), *moment_visibility(state, own)), session,
                  [status, poll, *moment_widgets], api_name=False, show_progress="hidden")
        index_button.click(
            lambda f, u, w, own, progress=gr.Progress(): index_videos(state, f, u, progress, w, session=own),
            [folder, uploads, window, session], status, api_name="index", **ONE_MODEL).then(
            lambda own: moment_visibility(state, own), session, moment_widgets, api_name=False)
        searched = search_button.click(lambda q, k, r, own: search_videos(state, q, k, r, session=own),
                                       [query, top_k, rerank, session], [gallery, table, result], api_name="search",
                                       **ONE_MODEL)
        moment_outputs = [moment_strip, moment_video, moment_start, moment_caption]
        searched.then(lambda own: moment_visibility(state, own), session, moment_widgets, api_name=False).then(
            lambda own: best_moment(state, own), session, moment_outputs, api_name=False, **ONE_MODEL).then(
            None, [moment_start, moment_video], None, js=PLAY_FROM_START, api_name=False)
        moment_button.click(lambda r, own: show_moment(state, r, own), [moment_rank, session], moment_outputs,
                            api_name="moment", **ONE_MODEL).then(None, [moment_start, moment_video], None,
                                                                 js=PLAY_FROM_START, api_name=False)
        show_button.click(lambda v, q, own: visualize_result(state, v, q, session=own), [result, query, session],
                          [merges, grounding, caption], api_name="visualize", **ONE_MODEL)
        classify_button.click(lambda v, labs, own: classify_video(state, v, labs, session=own),
                              [classify_video_input, labels, session], label_scores, api_name="classify", **ONE_MODEL)
        answer_button.click(lambda v, q, own: answer_question(state, v, q, session=own), [qa_video, question, session],
                            answer, api_name="answer", **ONE_MODEL)
        apply_button.click(lambda t, sp, own: change_aggregation(state, t, sp, session=own),
                           [temporal, spatial, session], panel, api_name="aggregation", **ONE_MODEL)
        folder_filter.change(lambda f, own: setattr(own, "folder_filter", f or ""), [folder_filter, session], None,
                             api_name=False)

        def clicked_video(own: Session, event: gr.SelectData) -> str | None:  # gradio hands event data by annotation
            return chosen_video(own, event)

        gallery.select(clicked_video, session, result, api_name=False)
        gallery.select(chosen_rank, None, moment_rank, api_name=False).then(
            lambda r, own: best_moment(state, own, r), [moment_rank, session], moment_outputs,
            api_name=False, **ONE_MODEL).then(None, [moment_start, moment_video], None, js=PLAY_FROM_START,
                                              api_name=False)
        result.change(lambda v: (v, v), result, [classify_video_input, qa_video], api_name=False)
    demo.queue(default_concurrency_limit=1)  # one model: requests wait their turn, none is dropped
    return demo


def moment_visibility(state: AppState, session: Session) -> tuple:
    """The moment widgets' visibility: shown only while the collection the session searches holds moments."""
    index = state.searched(session).index
    holds_moments = bool(index is not None and (index.info or {}).get("window"))
    return tuple(gr.update(visible=holds_moments) for _ in range(2))


def current_reductions(state: AppState) -> tuple[int, int]:
    """The model's R_T and R_S now (of its first block), for the Model tab's sliders."""
    if state.retrieval is None:
        return 0, 0
    vision = state.retrieval.model.config.vision_config
    return vision.temporal_reduction_per_layer[0], vision.spatial_reduction_per_layer[0]


def startup_index(state: AppState, videos: str | None) -> "IndexingJob | None":
    """Starts indexing the start-up folder into the served collection in a thread of its own and returns the job at
    once (None when there is nothing to index): the page answers meanwhile, its Index box shows the job's progress
    and then what it did (or why it failed), and a search runs on what is indexed so far."""
    if state.retrieval is None or not videos:
        return None
    try:
        return new_indexing_job(state, videos, None, None, background=True).start()
    except gr.Error as error:
        state.served.index_status = f"The start-up index of {videos} failed: {error}"
        print(state.served.index_status, file=sys.stderr)
        return None


def index_box(state: AppState, session: Session | None = None) -> str:
    """The Index box's text for a visitor: their running job's progress or their last indexing's report once they
    have indexed; else the served collection's (its start-up job's progress, or what it did)."""
    own = session if session is not None and (session.indexing or session.index_status) else state.served
    return own.job.describe() if own.indexing else own.index_status


def polling(state: AppState, session: Session | None = None) -> Any:
    """The page's timer that refreshes the Index box: ticking while the served collection's or the visitor's
    indexing job runs, stopped after it."""
    return gr.Timer(active=state.served.indexing or (session is not None and session.indexing))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.environ.get("TESTA_MODEL", "outputs/demo/runs/b/final"),
                        help="a retrieval model folder or Hub id (env TESTA_MODEL)")
    parser.add_argument("--videos", default=os.environ.get("TESTA_VIDEOS"),
                        help="the folder indexed at start (env TESTA_VIDEOS)")
    parser.add_argument("--qa-model", default=os.environ.get("TESTA_QA_MODEL"),
                        help="a VideoQA model folder or Hub id for the Ask tab (env TESTA_QA_MODEL)")
    parser.add_argument("--index", default=None,
                        help="search this index instead of indexing --videos: a store or saved index folder")
    parser.add_argument("--milvus", default=None,
                        help="with --index (a store written by train.index --milvus): search this Milvus file or URI")
    parser.add_argument("--collection", default="videos", help="the Milvus collection (default: videos)")
    parser.add_argument("--milvus-token", default=None,
                        help="with --milvus: the credentials of a secured Milvus server (\"user:password\" or an API "
                             "key); default: env MILVUS_TOKEN, which keeps the secret off the command line")
    parser.add_argument("--window", type=float, default=float(os.environ.get("TESTA_WINDOW", 0)),
                        help="index moments: windows of this many seconds, one after another (0, the default: whole "
                             "videos; env TESTA_WINDOW)")
    parser.add_argument("--no-rerank", action="store_true",
                        help="rank by cosine by default (e.g. a model whose matching head is barely trained)")
    parser.add_argument("--allow-settings", action="store_true",
                        help="let visitors change R_T/R_S on the Model tab: the one model's settings, so the change is "
                             "every visitor's (off by default: visitors are kept apart)")
    parser.add_argument("--allow-folders", action="store_true",
                        help="let visitors index any folder of the server (the Folder box) and name any of its video "
                             "files (Visualize, Classify, Ask); off by default: only the served collection's folder, "
                             "its videos and the visitor's uploads")
    parser.add_argument("--precision", default=os.environ.get("TESTA_PRECISION"),
                        choices=("fp32", "bf16", "int8", "auto"),
                        help="the video encoder's precision (env TESTA_PRECISION; default: the model as saved)")
    parser.add_argument("--backend", default=os.environ.get("TESTA_BACKEND", "torch"),
                        help="the video encoder's runtime with --precision: torch, openvino, onnxruntime, ... "
                             "(env TESTA_BACKEND; an engine runs in a worker process of its own)")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    return parser.parse_args(argv)


def milvus_token(args: argparse.Namespace) -> str | None:
    """The Milvus credentials: ``--milvus-token``, else the environment's ``MILVUS_TOKEN`` (None: no login)."""
    return args.milvus_token or os.environ.get("MILVUS_TOKEN") or None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.milvus and not args.index:
        raise SystemExit("error: --milvus needs --index (the store whose settings and tokens it uses)")
    if args.milvus_token and not args.milvus:
        raise SystemExit("error: --milvus-token needs --milvus (the server it logs in to)")
    state = load_state(args.model, args.videos, args.qa_model, args.precision, args.backend)
    state.rerank = not args.no_rerank
    state.window = args.window
    state.allow_settings = args.allow_settings
    state.allow_folders = args.allow_folders
    if args.index:  # the store, or with --milvus its collection (settings and re-ranking tokens from the store)
        state.served.index = open_index(args.index, args.milvus, args.collection, milvus_token(args))
        state.served.index_status = f"Searching {len(state.served.index)} rows of {args.milvus or args.index}."
        print(state.served.index_status, flush=True)
    elif startup_index(state, args.videos) is not None:
        print(f"Indexing {args.videos} in the background; the page answers meanwhile.", flush=True)
    else:
        print(state.served.index_status, flush=True)
    demo = build_app(state)
    launch_app(demo, args.videos, server_name=args.host, server_port=args.port, prevent_thread_lock=True)
    try:
        print("Serving; Ctrl-C stops the app.", flush=True)
        threading.Event().wait()  # until Ctrl-C
    except KeyboardInterrupt:
        print("Closing: the server, then the indexing.", flush=True)
    finally:  # in order: no new request, then no running encoder when the interpreter shuts down
        demo.close()
        stop_indexing(state)


STOP_SECONDS = 60.0
"""How long closing the app waits for a running indexing step to end."""


def stop_indexing(state: AppState, timeout: float = STOP_SECONDS) -> bool:
    """Ends the app's indexing in order, once the server is closed: every running job is asked to stop after its
    current step, and waited for (at most `timeout` seconds in all). Without this, Ctrl-C during the start-up
    indexing left its thread inside PyTorch while the interpreter shut down, which aborted the process ("terminate
    called without an active exception"). Returns whether every job ended; if one did not, the process exits at once
    (`os._exit`, after flushing its output), as finalising the interpreter under a running encoder would abort."""
    running = [job for job in list(state.jobs) if job.running]
    for job in running:
        job.stop()
    deadline = time.monotonic() + timeout
    for job in running:
        job.wait(max(0.0, deadline - time.monotonic()))
        if job.thread is not None:
            job.thread.join(max(0.0, deadline - time.monotonic()))
    left = [job for job in running if job.running or (job.thread is not None and job.thread.is_alive())]
    if running:
        print("Indexing stopped: the app is closing." if not left else
              f"An indexing step still ran after {timeout:g} s: exiting without waiting for it.", flush=True)
    if left:
        sys.stderr.flush()
        os._exit(1)
    return not left


def launch_app(demo: gr.Blocks, videos: str | None, **options: Any) -> Any:
    """Serves the page (`demo.launch` with these `options`). The videos folder's files are served from where they
    are (gradio's static paths) instead of being copied into gradio's cache, which hashes the whole file each time a
    player or the gallery is handed it: an hour-long video plays without a copy of it."""
    folders = [str(Path(videos).expanduser().resolve())] if videos else []
    gr.set_static_paths(folders)
    return demo.launch(theme=THEME, show_error=True, allowed_paths=folders or None, **options)


if __name__ == "__main__":
    main()
