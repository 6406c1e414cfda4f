"""Video decoding with decord or PyAV: the readers, and the crash-isolation helper process that runs them.

`video_decoding` uses this module in two ways:

* **Run by path** (`python video_decoding_worker.py`), it is the decoder helper process. It reads requests from stdin
  and writes replies to its original stdout, both as length-prefixed pickles; decoded frames follow their header as raw
  bytes. One helper serves any number of videos and both backends, so its start-up cost is paid once per process. If
  a decoder segfaults, aborts or hangs, only the helper dies (or is killed after the time limit); the caller gets an
  exception and starts a new helper for the next video.
* **Imported**, it provides the same readers for in-process decoding (`isolate_decoder=False`, or where no helper
  process can be started).

Requests and replies:

    ("open", backend, source, num_threads) -> ("metadata", {"total_num_frames", "fps", "width", "height"})
    ("read", unique_sorted_indices)        -> ("frames", shape, dtype_str) + raw bytes
                                           or ("truncated", frames_decoded, ffmpeg_error)  (PyAV; reader kept open)
    ("close",)                             -> ("closed",)
    any request that fails                 -> ("error", exception_type_name, message, is_final_reason)

This file is Hub remote code, exported next to `video_decoding.py`: it has no package imports at all (it must
run as a plain script), and decord and PyAV are optional, imported lazily inside `try` blocks.
"""

import os
import pickle
import struct
import sys


BACKENDS = ("decord", "pyav")


class DecodeFailure(Exception):
    """The video cannot be decoded; the message is the final, human-readable reason, `code` the stable word for it
    (`indexing.FAILURE_CODES`: ``"no_frames"``, or ``"unreadable"`` for any other reason)."""

    def __init__(self, reason: str, code: str = "unreadable") -> None:
        super().__init__(reason)
        self.code = code


class TruncatedVideo(Exception):
    """Fewer frames could be decoded than the container declares (PyAV): `decoded` frames are there."""

    def __init__(self, decoded: int, error: str | None) -> None:
        super().__init__(decoded, error)
        self.decoded = decoded
        self.error = error


def import_decord():
    """Imports decord (optional; inside `try`, so that loading the remote code does not require it)."""
    try:
        import decord
    except ImportError as exc:
        raise ImportError(f"video_backend='decord' needs decord: `pip install decord` ({exc})") from exc
    return decord


def import_av():
    """Imports PyAV (optional; inside `try`, so that loading the remote code does not require it)."""
    try:
        import av
    except ImportError as exc:
        raise ImportError(f"video_backend='pyav' needs PyAV: `pip install av` ({exc})") from exc
    return av


# ----------------------------------------------------------------------------------------------------------------------
# decord
# ----------------------------------------------------------------------------------------------------------------------


class DecordReader:
    """Opens a video with decord, reports its metadata, then reads the requested frames."""

    backend = "decord"

    def __init__(self, source: str, num_threads: int | None) -> None:
        decord = import_decord()
        self.reader = decord.VideoReader(source, ctx=decord.cpu(0), num_threads=int(num_threads or 0))
        total = len(self.reader)
        fps = float(self.reader.get_avg_fps() or 0.0)
        self.metadata = {"total_num_frames": int(total), "fps": fps if fps > 0 else None, "width": None, "height": None}

    def read(self, unique_indices):
        import numpy as np

        return np.ascontiguousarray(self.reader.get_batch([int(i) for i in unique_indices]).asnumpy())


# ----------------------------------------------------------------------------------------------------------------------
# PyAV
# ----------------------------------------------------------------------------------------------------------------------


def pyav_open(source: str, num_threads: int | None):
    """Opens `source` with PyAV; returns `(container, first video stream)` or raises `DecodeFailure`."""
    av = import_av()
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


def pyav_probe(source: str) -> dict:
    """Stream metadata plus a demux pass (no decoding): packet count and the sorted packet timestamps."""
    av = import_av()
    container, stream = pyav_open(source, 1)
    with container:
        rate = stream.average_rate or stream.guessed_rate
        info = {
            "declared_frames": int(stream.frames or 0),
            "fps": float(rate) if rate else None,
            "width": stream.codec_context.width,
            "height": stream.codec_context.height,
        }
        pts = []
        packets = 0
        try:
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue  # the flush packet at the end
                packets += 1
                if pts is not None:
                    if packet.pts is None or getattr(packet, "is_discard", False):
                        pts = None  # no timestamp mapping: decode every frame instead of skipping
                    else:
                        pts.append(int(packet.pts))
        except av.FFmpegError:
            pts = None
    info["packets"] = packets
    info["sorted_pts"] = sorted(pts) if pts is not None and len(set(pts)) == len(pts) else None
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


def pyav_collect(source: str, wanted, num_threads: int | None):
    """Decodes every frame in order up to the last wanted index.

    Returns `({index: RGB frame}, number of frames decoded, FFmpeg error or None)`; frame `i` is the i-th frame the
    decoder outputs (presentation order), as with decord.
    """
    av = import_av()
    wanted_set = {int(i) for i in wanted}
    last = max(wanted_set)
    frames = {}
    decoded = 0
    error = None
    to_rgb = RGBConverter(av)
    container, stream = pyav_open(source, num_threads)
    with container:
        try:
            for frame in container.decode(stream):
                if decoded in wanted_set:
                    frames[decoded] = to_rgb(frame)
                decoded += 1
                if decoded > last:
                    break
        except av.FFmpegError as exc:
            error = str(exc)
    return frames, decoded, error


def pyav_collect_skipping(source: str, wanted, sorted_pts, num_threads: int | None):
    """Like `pyav_collect`, but skips decoding non-reference frames that are not wanted (FFmpeg `skip_frame`).

    Frames are identified by their presentation timestamp: frame `i` is the one with the i-th smallest pts, which is
    what `pyav_collect` counts when every packet yields one frame (the caller checks that the packet count equals the
    frame count and that timestamps are unique). Non-reference frames (most B-frames) are never used to decode other
    frames, so skipping them leaves every decoded frame bit-identical. Returns `None` (the caller then decodes every
    frame) if any wanted frame was not produced.
    """
    av = import_av()
    wanted_pts = {sorted_pts[int(i)]: int(i) for i in set(int(i) for i in wanted)}
    frames = {}
    to_rgb = RGBConverter(av)
    container, stream = pyav_open(source, num_threads)
    context = stream.codec_context
    with container:
        try:
            for packet in container.demux(stream):
                if packet.pts is not None:
                    context.skip_frame = "DEFAULT" if packet.pts in wanted_pts else "NONREF"
                for frame in packet.decode():
                    index = wanted_pts.get(frame.pts)
                    if index is not None and index not in frames:
                        frames[index] = to_rgb(frame)
                if len(frames) == len(wanted_pts):
                    break
        except av.FFmpegError:
            return None
    return frames if len(frames) == len(wanted_pts) else None


class PyAVReader:
    """Probes a video with PyAV (metadata, packet timestamps), then decodes the requested frames.

    If the container declares more frames than can be decoded (a truncated file), `read` raises `TruncatedVideo`
    once, with the number of frames that are there; the caller samples again over those and reads again. A second
    shortfall raises `DecodeFailure`.
    """

    backend = "pyav"

    def __init__(self, source: str, num_threads: int | None) -> None:
        self.source = source
        self.num_threads = num_threads
        probe = pyav_probe(source)
        self.total = probe["declared_frames"] or probe["packets"]
        self.sorted_pts = probe["sorted_pts"]
        self.truncated = False
        self.metadata = {
            "total_num_frames": self.total,
            "fps": probe["fps"],
            "width": probe["width"],
            "height": probe["height"],
        }

    def read(self, unique_indices):
        import numpy as np

        wanted = [int(i) for i in unique_indices]
        frames = None
        if self.sorted_pts is not None and len(self.sorted_pts) == self.total:
            frames = pyav_collect_skipping(self.source, wanted, self.sorted_pts, self.num_threads)
        if frames is None:
            frames, decoded, error = pyav_collect(self.source, wanted, self.num_threads)
            if decoded <= max(wanted):
                ffmpeg = f" (FFmpeg: {error})" if error else ""
                if self.truncated:
                    raise DecodeFailure(f"decoding is not reproducible{ffmpeg}")
                if decoded == 0:
                    raise DecodeFailure(f"the video stream contains no decodable frames{ffmpeg}", code="no_frames")
                self.truncated, self.sorted_pts, self.total = True, None, decoded
                raise TruncatedVideo(decoded, error)
        return np.stack([frames[i] for i in wanted])


def open_reader(backend: str, source: str, num_threads: int | None):
    """A `DecordReader` or `PyAVReader` for `source`."""
    if backend == "decord":
        return DecordReader(source, num_threads)
    if backend == "pyav":
        return PyAVReader(source, num_threads)
    raise ValueError(f"Unknown video backend {backend!r}; use one of {BACKENDS}.")


# ----------------------------------------------------------------------------------------------------------------------
# The helper process
# ----------------------------------------------------------------------------------------------------------------------


def serve(fd_in: int, fd_out: int) -> None:
    """Answers requests from `fd_in` on `fd_out` until `fd_in` is closed."""

    def read_exact(n):
        buf = bytearray(n)
        view = memoryview(buf)
        while view:
            k = os.readv(fd_in, [view])
            if k == 0:
                raise EOFError  # the parent closed the pipe
            view = view[k:]
        return buf

    def write_all(data):
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd_out, view) :]

    def send(obj):
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        write_all(struct.pack("<Q", len(payload)) + payload)

    send(("ready", os.getpid()))
    reader = None
    while True:
        try:
            (size,) = struct.unpack("<Q", read_exact(8))
            request = pickle.loads(read_exact(size))
        except EOFError:
            return
        try:
            if request[0] == "open":
                reader = None
                reader = open_reader(request[1], request[2], request[3])
                send(("metadata", reader.metadata))
            elif request[0] == "read":
                frames = reader.read(request[1])
                reader = None
                send(("frames", frames.shape, frames.dtype.str))
                write_all(frames)
            else:  # "close"
                reader = None
                send(("closed",))
        except TruncatedVideo as exc:  # the reader stays open for the second read
            send(("truncated", exc.decoded, exc.error))
        except DecodeFailure as exc:
            reader = None
            send(("error", "DecodeFailure", str(exc), True, exc.code))
        except Exception as exc:
            reader = None
            send(("error", type(exc).__name__, str(exc), False, "unreadable"))


def _exit_with_parent() -> None:
    """The helper normally ends when it reads end-of-file on stdin, but a decoder hung inside a call never reads it;
    if the caller is killed meanwhile the helper would run forever. On Linux the kernel kills it with its parent
    (``PR_SET_PDEATHSIG``); elsewhere a daemon thread exits when the parent process is gone."""
    import signal
    import threading
    import time

    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0:  # 1 = PR_SET_PDEATHSIG
                if os.getppid() != parent:  # the parent died before prctl: nothing would signal us
                    os._exit(0)
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def main() -> None:
    _exit_with_parent()
    proto_in, proto_out = 0, os.dup(1)
    os.dup2(2, 1)  # anything written to stdout by C code goes to the log, never into the protocol pipe
    try:
        import numpy  # noqa: F401  (fail at start-up, with a clear message, if numpy is missing)
    except ImportError as exc:
        payload = pickle.dumps(("error", type(exc).__name__, str(exc), True))
        os.write(proto_out, struct.pack("<Q", len(payload)) + payload)
        return
    serve(proto_in, proto_out)


if __name__ == "__main__":
    main()
