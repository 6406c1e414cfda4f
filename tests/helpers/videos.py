"""Writes small real mp4 files with PyAV (libx264 is bundled in the wheel) for the processing tests.

Every frame carries its own index: bit `b` of the index is a 16x16 block at the top of the frame (white = 1), so a
test can read back exactly which frames a decoder returned. Below that strip, coloured shapes move across a gradient.
"""

import struct
from pathlib import Path

import av
import numpy as np


BITS = 10  # frame indices up to 1023; frames must be at least 16 * BITS = 160 pixels wide
BLOCK = 16
RAW = dict(do_resize=False, do_rescale=False, do_normalize=False)
"""Video processor arguments that keep the decoded pixel values (0-255), so that `read_index` reads the frames."""


def frame_image(index: int, width: int, height: int) -> np.ndarray:
    """RGB frame `index`: index bits on the top strip, moving red square and blue bar below."""
    yy, xx = np.mgrid[0:height, 0:width]
    img = np.stack([xx * 200 // width, yy * 200 // height, np.full_like(xx, 90)], -1).astype(np.uint8)
    img[:BLOCK] = 0
    for b in range(BITS):
        if (index >> b) & 1:
            img[:BLOCK, b * BLOCK : (b + 1) * BLOCK] = 255
    x = (7 * index) % max(1, width - 24)
    img[BLOCK + 8 : BLOCK + 32, x : x + 24] = (230, 30, 30)
    y = BLOCK + (5 * index) % max(1, height - BLOCK - 12)
    img[y : y + 12, width // 2 : width // 2 + 40] = (30, 30, 230)
    return img


def write_video(
    path: Path,
    num_frames: int,
    fps: int = 25,
    width: int = 192,
    height: int = 160,
    gray: bool = False,
    bframes: int = 0,
) -> Path:
    """Writes an H.264 mp4 (yuv420p, or 8-bit `gray` pixels when `gray=True`) whose frames encode their index.

    `bframes > 0` uses B-frames (with B-pyramid, so some are reference frames and some are not) and a 12-frame GOP.
    """
    assert width >= BITS * BLOCK, "too narrow to hold the index bits"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "gray" if gray else "yuv420p"
        stream.options = {"crf": "12", "preset": "ultrafast"}
        if bframes:
            stream.options = {"crf": "12", "preset": "veryfast", "bf": str(bframes), "g": "12"}
        for i in range(num_frames):
            img = frame_image(i, width, height)
            if gray:
                frame = av.VideoFrame.from_ndarray(img.mean(-1).astype(np.uint8), format="gray")
            else:
                frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def read_index(frame: np.ndarray) -> int:
    """Reads the index written by `frame_image` from an (H, W, C) or (H, W) frame with values in [0, 255]."""
    frame = np.asarray(frame, dtype=np.float32)
    if frame.ndim == 3:
        frame = frame.mean(-1)
    centre = BLOCK // 2
    return sum(int(frame[centre, b * BLOCK + centre] > 127) << b for b in range(BITS))


def mp4_boxes(path: Path) -> list[tuple[bytes, int, int]]:
    """Top-level MP4 boxes as (type, offset, size)."""
    data = Path(path).read_bytes()
    boxes, offset = [], 0
    while offset + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[offset : offset + 8])
        boxes.append((kind, offset, size))
        if size < 8:
            break
        offset += size
    return boxes


def zero_media_data(src: Path, dst: Path) -> Path:
    """Copies an mp4 with its `mdat` payload zeroed: a valid header and index, but no decodable frame."""
    data = bytearray(Path(src).read_bytes())
    for kind, offset, size in mp4_boxes(src):
        if kind == b"mdat":
            data[offset + 8 : offset + size] = bytes(size - 8)
    Path(dst).write_bytes(bytes(data))
    return dst


def write_test_videos(folder: Path) -> dict[str, Path]:
    """Real H.264 mp4s of different lengths, frame rates and sizes, one grayscale, one with B-frames, plus broken
    files: `truncated` (moov atom cut off), `empty` (0 bytes), `text` (not a video), `no_frames` (zeroed media data)."""
    folder = Path(folder)
    v = {
        "long": write_video(folder / "long.mp4", 90, fps=30, width=320, height=240),
        "small": write_video(folder / "small.mp4", 50, fps=25, width=176, height=144),
        "short": write_video(folder / "short.mp4", 5, fps=10, width=192, height=160),
        "gray": write_video(folder / "gray.mp4", 40, fps=24, width=208, height=160, gray=True),
        "bframes": write_video(folder / "bframes.mp4", 60, fps=30, width=192, height=160, bframes=3),
    }
    data = v["long"].read_bytes()
    (folder / "truncated.mp4").write_bytes(data[: len(data) // 2])  # moov atom is at the end: cut off
    v["truncated"] = folder / "truncated.mp4"
    (folder / "empty.mp4").write_bytes(b"")
    v["empty"] = folder / "empty.mp4"
    (folder / "notes.mp4").write_text("these are meeting notes, not a video\n" * 50)
    v["text"] = folder / "notes.mp4"
    v["no_frames"] = zero_media_data(v["small"], folder / "no_frames.mp4")
    return v


def uniform(total: int, n: int) -> list[int]:
    """Segment midpoints, written out independently of the implementation."""
    return [int((i + 0.5) * total / n) for i in range(n)]


def random_clip(t: int = 6, h: int = 40, w: int = 48, seed: int = 0) -> np.ndarray:
    """A `(t, h, w, 3)` uint8 clip of uniform noise."""
    return np.random.default_rng(seed).integers(0, 256, size=(t, h, w, 3), dtype=np.uint8)


def write_noise_video(path: Path, seed: int, frames: int = 4, size: int = 32, fps: int = 8) -> Path:
    """A small H.264 mp4 of coarse random colour blocks (8x8 pixels), different for every ``seed``: a collection of
    these gives a tiny model distinct embeddings."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "10", "preset": "ultrafast"}
        for _ in range(frames):
            blocks = rng.integers(0, 256, size=(size // 8, size // 8, 3), dtype=np.uint8)
            image = np.ascontiguousarray(blocks.repeat(8, axis=0).repeat(8, axis=1))
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


# ---------------------------------------------------------------------------------------------- files that are not
# videos, each named by the failure code (`testa_search.encoding.FAILURE_CODES`) the encode loop must give it


def write_text_named_mp4(path: Path) -> Path:
    """A text file named like a video (what a mis-named download or a notes file looks like)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("these are meeting notes, not a video\n" * 50)
    return Path(path)


def write_truncated_mp4(good: Path, path: Path, fraction: float = 0.5) -> Path:
    """The first ``fraction`` of a good mp4's bytes (an interrupted download: the `moov` box, written last, is lost
    and the `mdat` box runs past the end of the file)."""
    data = Path(good).read_bytes()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data[: int(len(data) * fraction)])
    return Path(path)


def write_truncated_faststart_mp4(good: Path, path: Path, fraction: float = 0.6) -> Path:
    """A good mp4 remuxed with its index first (``+faststart``) and cut to its first ``fraction`` of bytes: the index
    survives, the last frames' data does not, so a decoder finds fewer frames than the index declares."""
    faststart = Path(path).with_name(Path(path).stem + ".faststart.mp4")
    with av.open(str(good)) as inp, av.open(str(faststart), "w", options={"movflags": "+faststart"}) as out:
        stream = out.add_stream_from_template(inp.streams.video[0])
        for packet in inp.demux(inp.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                out.mux(packet)
    return write_truncated_mp4(faststart, path, fraction)


def write_empty_mp4(path: Path) -> Path:
    """A 0-byte file named .mp4."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(b"")
    return Path(path)


def write_bad_videos(folder: Path, good: Path, prefix: str = "") -> dict[str, Path]:
    """One file of each kind that cannot be read, in ``folder``, keyed by the failure code it must get: a text file
    named .mp4 (``not_a_video``), a truncated mp4 (``truncated``), an empty file (``empty``) and an mp4 whose media
    data is zeroed, so that no frame decodes (``no_frames``). ``good`` is the mp4 the broken ones are made from."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "not_a_video": write_text_named_mp4(folder / f"{prefix}notes.mp4"),
        "truncated": write_truncated_mp4(good, folder / f"{prefix}truncated.mp4"),
        "empty": write_empty_mp4(folder / f"{prefix}empty.mp4"),
        "no_frames": zero_media_data(good, folder / f"{prefix}no_frames.mp4"),
    }


LONG_BITS, LONG_BLOCK = 14, 8  # frame indices up to 16383 in 8-pixel blocks: 112 pixels wide


def write_long_video(path: Path, num_frames: int, fps: int = 2, width: int = 112, height: int = 16) -> Path:
    """A small, long H.264 mp4 (e.g. an hour at 2 fps, 112x16) whose frames carry their index in `LONG_BITS` 8-pixel
    blocks (white = 1); `read_long_index` reads it back. Everything else is black, so it encodes fast and small."""
    assert width >= LONG_BITS * LONG_BLOCK and num_frames < 2**LONG_BITS
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "18", "preset": "ultrafast", "g": str(10 * fps)}
        img = np.zeros((height, width, 3), dtype=np.uint8)
        for i in range(num_frames):
            img[:LONG_BLOCK] = 0
            for b in range(LONG_BITS):
                if (i >> b) & 1:
                    img[:LONG_BLOCK, b * LONG_BLOCK : (b + 1) * LONG_BLOCK] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def read_long_index(frame: np.ndarray) -> int:
    """The index written by `write_long_video` into an (H, W, 3) frame with values in [0, 255]."""
    gray = np.asarray(frame, dtype=np.float32).mean(-1)
    centre = LONG_BLOCK // 2
    return sum(int(gray[centre, b * LONG_BLOCK + centre] > 127) << b for b in range(LONG_BITS))


def write_long_vfr_video(path: Path, times_ms: list[int], width: int = 112, height: int = 16) -> Path:
    """A variable-frame-rate H.264 mp4 (millisecond timestamps `times_ms`, increasing) whose frames carry their index
    as `write_long_video`'s do (`read_long_index`)."""
    from fractions import Fraction

    assert width >= LONG_BITS * LONG_BLOCK and len(times_ms) < 2**LONG_BITS
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = stream.codec_context.time_base = Fraction(1, 1000)
        stream.options = {"crf": "18", "preset": "ultrafast"}
        img = np.zeros((height, width, 3), dtype=np.uint8)
        for i, pts in enumerate(times_ms):
            img[:LONG_BLOCK] = 0
            for b in range(LONG_BITS):
                if (i >> b) & 1:
                    img[:LONG_BLOCK, b * LONG_BLOCK : (b + 1) * LONG_BLOCK] = 255
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts, frame.time_base = pts, Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


class CountingContainer:
    """Wraps a PyAV container and counts the packets demuxed, the frames decoded and the seeks."""

    def __init__(self, container, counts):
        self._container, self._counts = container, counts

    def __getattr__(self, name):
        return getattr(self._container, name)

    def __enter__(self):
        self._container.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._container.__exit__(*exc_info)

    def demux(self, *args, **kwargs):
        for packet in self._container.demux(*args, **kwargs):
            self._counts["packets"] += packet.size > 0
            yield packet

    def decode(self, *args, **kwargs):
        for frame in self._container.decode(*args, **kwargs):
            self._counts["frames"] += 1
            yield frame

    def seek(self, *args, **kwargs):
        self._counts["seeks"] += 1
        return self._container.seek(*args, **kwargs)
