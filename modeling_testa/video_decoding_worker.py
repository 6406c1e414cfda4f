"""Video decoding with decord or PyAV: the readers, and the request handler of the decoder helper process.

`video_decoding` uses this module in two ways:

* **As the decoder helper's handler.** The helper process is `worker_process.py` run by path with this file's path:
  it loads this file by path and answers requests with `handler()` (length-prefixed pickles on its stdin and stdout;
  frames follow their message as raw bytes). One helper serves any number of videos and both backends. If a decoder
  segfaults, aborts or hangs, only the helper dies (or is killed once it stops making progress); the caller raises an
  exception naming the file and starts a new helper for the next video.
* **Imported**, it provides the same readers for in-process decoding (`isolate_decoder=False`, or where no helper
  process can be started).

A reader (`open_reader`) reports the video's metadata, including every frame's presentation time (`frame_times`, in
seconds from the first frame, read from the container's timestamps, so variable-frame-rate files are timed right),
then streams the frames asked for (`frames`), in order, each once, as they are decoded: nothing is held but the frame
being sent. PyAV skips decoding non-reference frames that are not asked for (FFmpeg ``skip_frame``) and **seeks** to
the keyframe before the next frame asked for when that keyframe lies ahead, so sparse frames of a long video cost
the GOPs that hold them, not the whole file. Decord seeks by itself.

Requests and replies:

    ("open", backend, source, num_threads)  -> ("metadata", {"total_num_frames", "fps", "width", "height",
                                                             "frame_times"})
    ("stream", sorted_unique_indices)       -> ("progress", frames_reached, seconds_reached)  (every PROGRESS_EVERY s)
                                               ("frame", index, shape, dtype_str) + raw bytes (one per frame found)
                                               ("end", frames_reached, ffmpeg_error_or_None)
    ("close",)                              -> ("closed",)
    any request that fails                  -> ("error", exception_type_name, message, code_or_None)

`frames_reached` is one more than the last frame index the decoder got to: frames asked for at or past it were not
decodable (a file whose data ends early). This file is Hub remote code, exported next to `video_decoding.py`: it has
no package imports at all (it is loaded by path in the helper), and decord and PyAV are optional, imported lazily.
"""

import bisect
import itertools
import time
from dataclasses import dataclass

PROGRESS_EVERY = 0.5
"""Seconds between the helper's progress messages while it decodes (what the caller's stall limit watches)."""


class DecodeFailure(Exception):
    """The video cannot be decoded; the message is the final, human-readable reason, `code` the stable word for it
    (`testa_search.encoding.FAILURE_CODES`: ``"no_frames"``, or ``"unreadable"`` for any other reason)."""

    def __init__(self, reason: str, code: str = "unreadable") -> None:
        super().__init__(reason)
        self.code = code


class TruncatedVideo(Exception):
    """Fewer frames could be decoded than the container declares: `decoded` frames are there."""

    def __init__(self, decoded: int, error: str | None) -> None:
        super().__init__(decoded, error)
        self.decoded = decoded
        self.error = error


def no_progress(frames_reached: int, seconds_reached: float | None) -> None:
    """The progress callback of a caller that does not watch progress."""


# ----------------------------------------------------------------------------------------------------------------------
# decord
# ----------------------------------------------------------------------------------------------------------------------


class DecordReader:
    """Opens a video with decord, reports its metadata, then streams the requested frames (decord seeks to the
    keyframe before a frame that is far ahead by itself)."""

    backend = "decord"

    def __init__(self, source: str, num_threads: int | None, progress=no_progress) -> None:
        decord = DECODERS["decord"].load()
        self.reader = decord.VideoReader(source, ctx=decord.cpu(0), num_threads=int(num_threads or 0))
        total = len(self.reader)
        fps = float(self.reader.get_avg_fps() or 0.0)
        times = None
        if total:
            starts = self.reader.get_frame_timestamp(range(total))[:, 0]
            times = [float(t - starts[0]) for t in starts]
        self.metadata = {"total_num_frames": int(total), "fps": fps if fps > 0 else None, "width": None,
                         "height": None, "frame_times": times}
        self.reached, self.error = 0, None

    def frames(self, wanted, progress=no_progress):
        """Yields ``(index, RGB frame)`` for the sorted, unique `wanted` indices, in order. Stops at the first frame
        decord cannot decode (`error` says why, `reached` how far it got)."""
        import numpy as np

        times = self.metadata["frame_times"]
        self.reached, self.error = 0, None
        for index in wanted:
            try:
                frame = np.ascontiguousarray(self.reader.get_batch([int(index)]).asnumpy()[0])
            except Exception as exc:  # DECORDError: the data ends or is damaged here
                self.error = str(exc)
                return
            self.reached = int(index) + 1
            progress(self.reached, times[int(index)] if times else None)
            yield int(index), frame


# ----------------------------------------------------------------------------------------------------------------------
# PyAV
# ----------------------------------------------------------------------------------------------------------------------


def pyav_open(source: str, num_threads: int | None):
    """Opens `source` with PyAV; returns `(container, first video stream)` or raises `DecodeFailure`."""
    av = DECODERS["pyav"].load()
    # With FFmpeg logging off (PyAV's default), errors only say e.g. "Invalid data found"; capture FFmpeg's own
    # error lines (e.g. "moov atom not found") during the open, without printing them.
    previous_level = av.logging.get_level()
    if previous_level is None:
        av.logging.set_level(av.logging.ERROR)
    try:
        with av.logging.Capture() as ffmpeg_log:
            container = av.open(source, metadata_errors="ignore")
    except av.FFmpegError as exc:
        reason = f"FFmpeg could not open it as a video: {exc}"
        details = [message.strip() for _, _, message in ffmpeg_log if message.strip() and message.strip() not in reason]
        if details:
            reason += f" ({'; '.join(details[-2:])})"
        raise DecodeFailure(reason) from exc
    finally:
        if previous_level is None:
            av.logging.set_level(None)
    if not container.streams.video:
        container.close()
        raise DecodeFailure("the file has no video stream")
    stream = container.streams.video[0]
    if num_threads == 1:
        stream.codec_context.thread_count = 1
    else:
        stream.thread_type = "AUTO"
        stream.codec_context.thread_count = int(num_threads or 0)
    return container, stream


def pyav_probe(source: str, progress=no_progress) -> dict:
    """Stream metadata plus a demux pass (no decoding): the packets in decode order, with their timestamps.

    Returns ``{"declared_frames", "fps", "width", "height", "time_base", "packets", "sorted_pts", "positions",
    "keyframes"}``: `sorted_pts` are the packets' presentation timestamps in presentation order, `positions` each
    packet's position in decode order by its timestamp, `keyframes` the ``(pts, decode position)`` of every keyframe
    packet in decode order (all three None when a packet has no timestamp or two share one: frames are then counted,
    not told apart by timestamp). A file whose data ends early gives the packets that are there."""
    av = DECODERS["pyav"].load()
    container, stream = pyav_open(source, 1)
    with container:
        rate = stream.average_rate or stream.guessed_rate
        info = {
            "declared_frames": int(stream.frames or 0),
            "fps": float(rate) if rate else None,
            "width": stream.codec_context.width,
            "height": stream.codec_context.height,
            "time_base": float(stream.time_base) if stream.time_base else None,
        }
        positions, keyframes = {}, []
        packets, unique = 0, True
        last_said = time.monotonic()
        try:
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue  # the flush packet at the end
                if unique:
                    if packet.pts is None or getattr(packet, "is_discard", False) or packet.pts in positions:
                        unique = False  # no timestamp mapping: decode every frame instead of skipping
                    else:
                        positions[int(packet.pts)] = packets
                        if packet.is_keyframe:
                            keyframes.append((int(packet.pts), packets))
                packets += 1
                if time.monotonic() - last_said > PROGRESS_EVERY:
                    progress(0, None)  # demuxing is progress too (a long file takes seconds)
                    last_said = time.monotonic()
        except av.FFmpegError:
            pass  # the data ends early: the packets read so far are the file's
    info["packets"] = packets
    info["sorted_pts"] = sorted(positions) if unique else None
    info["positions"] = positions if unique else None
    info["keyframes"] = keyframes if unique else None
    return info


class RGBConverter:
    """Converts decoded frames to RGB arrays through one reused `VideoReformatter` (one per decode call; not shared
    between threads).

    ``frame.to_ndarray(format="rgb24")`` sets up a new conversion for every frame; one reformatter keeps its swscale
    state between frames of the same size and format (and reconfigures when they change). Same pixels either way;
    `benchmarks/pyav_conversion.py` measures the difference (large on small, keyframe-dense videos, where conversion
    is a big share of the work). Older PyAV without `av.video.reformatter` falls back to ``to_ndarray``.
    """

    def __init__(self, av) -> None:
        reformatter_class = getattr(getattr(av, "video", None), "reformatter", None)
        self.reformatter = reformatter_class.VideoReformatter() if reformatter_class is not None else None

    def __call__(self, frame):
        if self.reformatter is None:
            return frame.to_ndarray(format="rgb24")
        return self.reformatter.reformat(frame, format="rgb24").to_ndarray()


class PyAVReader:
    """Probes a video with PyAV (metadata, packet timestamps, keyframes), then streams the requested frames.

    With unique packet timestamps, frame `i` is the one with the i-th smallest timestamp (what counting decoded
    frames gives, as decord counts); frames are then told apart by timestamp, which lets the reader skip decoding
    non-reference frames that are not wanted (they are never used to decode other frames, so every decoded frame is
    bit-identical) and, with `seek`, jump to the keyframe before the next wanted frame when that keyframe lies ahead
    of where decoding is. Without unique timestamps every frame is decoded in order and counted.
    """

    backend = "pyav"

    def __init__(self, source: str, num_threads: int | None, progress=no_progress, seek: bool = True) -> None:
        self.source, self.num_threads, self.seek = source, num_threads, seek
        probe = pyav_probe(source, progress)
        self.sorted_pts, self.positions, self.keyframes = probe["sorted_pts"], probe["positions"], probe["keyframes"]
        self.keyframe_positions = [position for _, position in self.keyframes or ()]
        total = probe["declared_frames"] or probe["packets"]
        times = None
        if self.sorted_pts and probe["time_base"]:
            first = self.sorted_pts[0]
            times = [(p - first) * probe["time_base"] for p in self.sorted_pts]
        self.metadata = {"total_num_frames": total, "fps": probe["fps"], "width": probe["width"],
                         "height": probe["height"], "frame_times": times}
        self.reached, self.error, self.seeks = 0, None, 0

    def frames(self, wanted, progress=no_progress):
        """Yields ``(index, RGB frame)`` for the sorted, unique `wanted` indices, in order. Stops where decoding
        stops (`error`: FFmpeg's reason, or None at the end of the data; `reached`: one past the last frame it got
        to)."""
        wanted = [int(i) for i in wanted]
        self.reached, self.error = 0, None
        av = DECODERS["pyav"].load()
        container, stream = pyav_open(self.source, self.num_threads)
        with container:
            try:
                if self.sorted_pts is not None:
                    yield from self._frames_by_timestamp(container, stream, wanted, progress)
                else:
                    yield from self._frames_in_order(container, stream, wanted, progress)
            except av.FFmpegError as exc:
                self.error = str(exc)

    def _frames_in_order(self, container, stream, wanted, progress):
        wanted_set, last = set(wanted), max(wanted, default=-1)
        to_rgb = RGBConverter(DECODERS["pyav"].load())
        for frame in container.decode(stream):
            index = self.reached
            self.reached += 1
            progress(self.reached, float(frame.time) if frame.time is not None else None)
            if index in wanted_set:
                yield index, to_rgb(frame)
            if self.reached > last:
                return

    def keyframe_before(self, pts: int) -> tuple[int, int] | None:
        """The keyframe that decoding the frame shown at `pts` must start from: the last one before that frame's
        packet in decode order that is not shown after it, as ``(pts, decode position)``."""
        k = bisect.bisect_right(self.keyframe_positions, self.positions[pts]) - 1
        while k >= 0 and self.keyframes[k][0] > pts:  # a frame shown before its GOP's keyframe: an earlier GOP
            k -= 1
        return self.keyframes[k] if k >= 0 else None

    def _packets_from(self, container, stream, key: tuple[int, int] | None):
        """The packets from `key` on (from the start for None), by a seek, checked: if the seek lands past the
        keyframe, seeking is turned off and the packets come from the start."""
        if key is not None and key[1] > 0:
            container.seek(key[0], stream=stream, backward=True)
            self.seeks += 1
            packets = container.demux(stream)
            first = next(packets, None)
            if first is None or first.pts is None or self.positions.get(int(first.pts), -1) <= key[1]:
                return packets if first is None else itertools.chain((first,), packets)
            self.seek = False
        container.seek(self.sorted_pts[0], stream=stream, backward=True)
        return container.demux(stream)

    def _frames_by_timestamp(self, container, stream, wanted, progress):
        index_of = {p: i for i, p in enumerate(self.sorted_pts)}
        pending = [i for i in wanted if i < len(self.sorted_pts)]  # past the packets there are: not decodable
        pending_pts = {self.sorted_pts[i] for i in pending}
        times = self.metadata["frame_times"]
        to_rgb = RGBConverter(DECODERS["pyav"].load())
        context = stream.codec_context
        packets, position, k = None, -1, 0
        while k < len(pending):
            target = self.sorted_pts[pending[k]]
            key = self.keyframe_before(target) if self.seek and self.keyframes else None
            if packets is None:
                packets = container.demux(stream) if key is None or key[1] == 0 else \
                    self._packets_from(container, stream, key)
            elif key is not None and key[1] > position + 1:  # the next wanted frame's GOP lies ahead: jump there
                packets = self._packets_from(container, stream, key)
            for packet in packets:
                if packet.pts is not None:
                    position = self.positions.get(int(packet.pts), position)
                    context.skip_frame = "DEFAULT" if packet.pts in pending_pts else "NONREF"
                for frame in packet.decode():
                    index = index_of.get(frame.pts)
                    if index is None:
                        continue
                    self.reached = max(self.reached, index + 1)
                    progress(self.reached, times[index] if times else None)
                    if frame.pts in pending_pts:
                        pending_pts.discard(frame.pts)
                        yield index, to_rgb(frame)
                # done, or passed over (the decoder showed a later frame, so this one will not come): move on
                while k < len(pending) and (self.sorted_pts[pending[k]] not in pending_pts
                                            or pending[k] < self.reached - 1):
                    pending_pts.discard(self.sorted_pts[pending[k]])
                    k += 1
                if k == len(pending) or self.sorted_pts[pending[k]] != target:
                    break  # the target is out: look again whether to jump ahead
            else:
                return  # the end of the data: what is still pending is not decodable


@dataclass(frozen=True)
class Decoder:
    """A decoder ``video_backend=`` names. `DECODERS` is the one place decoder names are written (here, not in
    `video_decoding.py`: the helper loads this file alone). `counts_decodable_frames`: its frame count is of the
    frames it indexed as decodable (decord), not the container's; `streams`: it holds one frame at a time whatever
    the consumer's pace (PyAV), where decord decodes ahead into its own buffers (docs/moments.md)."""

    name: str  # the value of video_backend= and of the helper's "open" request
    label: str  # the library as messages name it
    module: str  # what it imports
    package: str  # what `pip install` installs
    reader: type  # reader(source, num_threads, progress)
    counts_decodable_frames: bool
    streams: bool

    def install_hint(self) -> str:
        return f"video_backend={self.name!r} needs {self.label}: `pip install {self.package}`"

    def load(self):
        """Imports the library (optional: imported when used, so that loading the remote code does not need it)."""
        try:
            return __import__(self.module)
        except ImportError as exc:
            raise ImportError(f"{self.install_hint()} ({exc})") from exc


DECODERS = {decoder.name: decoder for decoder in (  # in this order for ``video_backend="auto"``
    Decoder("decord", "decord", "decord", "decord", DecordReader, counts_decodable_frames=True, streams=False),
    Decoder("pyav", "PyAV", "av", "av", PyAVReader, counts_decodable_frames=False, streams=True),
)}
BACKENDS = tuple(DECODERS)


def open_reader(backend: str, source: str, num_threads: int | None, progress=no_progress):
    """The reader of decoder `backend` (`DECODERS`) for `source`."""
    decoder = DECODERS.get(backend)
    if decoder is None:
        raise ValueError(f"Unknown video backend {backend!r}; use one of {BACKENDS}.")
    return decoder.reader(source, num_threads, progress)


# ----------------------------------------------------------------------------------------------------------------------
# The helper's request handler
# ----------------------------------------------------------------------------------------------------------------------


class ProgressReports:
    """Sends ``("progress", frames_reached, seconds_reached)`` at most every `PROGRESS_EVERY` seconds: the helper's
    sign of life for the caller's stall limit, sent from the decoding loop itself (a hung decoder sends none)."""

    def __init__(self, replies) -> None:
        self.replies, self.last = replies, time.monotonic()

    def __call__(self, frames_reached: int, seconds_reached: float | None) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY:
            self.replies.send(("progress", frames_reached, seconds_reached))
            self.last = now


class DecoderHandler:
    """Answers the helper's requests (see the module docstring): one open video at a time."""

    def __init__(self) -> None:
        self.reader = None
        for decoder in DECODERS.values():  # paid at start-up, not inside a request's stall limit
            try:
                decoder.load()
            except ImportError:
                pass  # said when a request asks for it

    def __call__(self, request, replies) -> None:
        try:
            if request[0] == "open":
                self.reader = None
                self.reader = open_reader(request[1], request[2], request[3], ProgressReports(replies))
                replies.send(("metadata", self.reader.metadata))
            elif request[0] == "stream":
                self.stream(request[1], replies)
            else:  # "close"
                self.reader = None
                replies.send(("closed",))
        except Exception:
            self.reader = None
            raise

    def stream(self, wanted, replies) -> None:
        reader = self.reader
        for index, frame in reader.frames(wanted, ProgressReports(replies)):
            replies.send(("frame", index, frame.shape, frame.dtype.str))
            replies.send_bytes(frame)
        replies.send(("end", reader.reached, reader.error))


def handler() -> DecoderHandler:
    """The helper's request handler (`worker_process.main` calls it)."""
    import numpy  # noqa: F401  (fail at start-up, with a clear message, if numpy is missing)

    return DecoderHandler()
