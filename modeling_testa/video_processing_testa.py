"""Video processor for TESTA: `TestaVideoProcessor` samples, resizes, rescales and CLIP-normalises video frames.

`TestaVideoProcessor` turns video files, decoded arrays/tensors or lists of PIL frames into the `pixel_values` tensor
`(batch, frames, 3, height, width)` that [`TestaVisionModel`] consumes. Files are decoded by
[`video_decoding.decode_video`] (decord or PyAV, in a crash-isolated helper process); in-memory inputs are checked and
converted by `video_inputs`.

Differences from the original TESTA data pipeline (`data/video_dataset.py`), all deliberate:

* `uniform` sampling takes the **midpoint of each of `num_frames` equal segments of the whole video**. The original's
  `np.arange(0, vlen, vlen / N, dtype=int)` is a floor-stride prefix that never reaches the tail of the video, and
  returns frame 0 `N` times for videos shorter than `N` frames. Here, videos shorter than `num_frames` repeat their
  frames evenly and in order.
* Resizing is done by torchvision (bicubic, antialiased) after decoding. `resize_mode="square"` (the default) resizes
  every frame directly to `crop_size`, not keeping the aspect ratio, like the original's
  `decord.VideoReader(path, width=224, height=224)`; `resize_mode="shortest_edge"` keeps the aspect ratio and
  center-crops.
* Rescaling does not depend on the content: integer frames are divided by 255, and float frames are taken to be in
  [0, 1] unless their maximum exceeds 1 (then they are taken to be in [0, 255]). The original divided by 255 only when
  `max > 1`, so an all-dark uint8 clip was left unscaled.
"""

import json
import os
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from huggingface_hub.dataclasses import validate_typed_dict
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, SizeDict, validate_kwargs
from transformers.processing_utils import Unpack, VideosKwargs
from transformers.video_processing_utils import BaseVideoProcessor
from transformers.video_utils import VideoMetadata

from .video_decoding import (
    FRAME_SAMPLING_STRATEGIES,
    VIDEO_BACKENDS,
    check_frame_indices,
    decode_video,
    frames_for_fps,
    own_decoder_process,  # noqa: F401 (looked up here by the pipelines: the helper of this copy of the code)
    sample_frame_indices,
)
from .video_inputs import flatten_video_inputs, is_path, metadata_per_video, to_rgb, video_to_tensor


RESIZE_MODES = ("square", "shortest_edge")
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
}


class TestaVideoProcessorKwargs(VideosKwargs, total=False):
    """TESTA-specific video-processing keyword arguments (on top of `transformers.processing_utils.VideosKwargs`).

    frame_sampling (`str`): `"uniform"` (evaluation), `"random"` (training) or `"headtail"` (pretraining).
    resize_mode (`str`): `"square"` (resize straight to `crop_size`, like the original) or `"shortest_edge"` (resize
        the shortest edge to `size["shortest_edge"]`, keep the aspect ratio, center-crop to `crop_size`).
    video_backend (`str`): `"auto"`, `"decord"` or `"pyav"`.
    seed (`int`): seed for `"random"`/`"headtail"` sampling in this call; the global torch RNG when unset.
    dtype (`str` or `torch.dtype`): dtype of `pixel_values` (`"float32"`, `"bfloat16"`, `"float16"`, ...).
    isolate_decoder (`bool`): decode (decord or PyAV) in a crash-isolated helper process (POSIX).
    decode_timeout (`float`): seconds before an isolated decode is killed; `None` for no limit.
    decode_threads (`int`): decoder threads per video; `None`/0 lets the decoder choose.
    """

    frame_sampling: Literal["uniform", "random", "headtail"]
    resize_mode: Literal["square", "shortest_edge"]
    video_backend: Literal["auto", "decord", "pyav"]
    seed: int | None
    dtype: str | torch.dtype | None
    isolate_decoder: bool | None
    decode_timeout: int | float | None
    decode_threads: int | None


class TestaVideoProcessor(BaseVideoProcessor):
    r"""
    Video processor for TESTA: decodes videos, samples `num_frames` frames (or `fps` frames per second), resizes,
    rescales and normalises them.

    Inputs accepted by `__call__` (`videos=`): a path (`str` or `pathlib.Path`, also `file://` and http(s) URLs,
    which the decoders open directly); a decoded video as a 4-D `np.ndarray`/`torch.Tensor`, `(frames, height, width,
    channels)` or `(frames, channels, height, width)`, uint8 in [0, 255] or float; a list of frames (PIL images or
    2-D/3-D arrays); or a batch: a list of any of these, or a 5-D array/tensor. Grayscale (1 channel) and RGBA
    (4 channels; alpha dropped) frames are converted to RGB.

    Output: `BatchFeature` with `pixel_values` of shape `(batch, num_frames, 3, crop_size["height"],
    crop_size["width"])` in `dtype` (float32 by default); with `return_metadata=True` also `video_metadata`, one
    `VideoMetadata` per video whose `frames_indices` are the sampled frame indices and `timestamps` the matching times
    in seconds (when the frame rate is known; give it for arrays through `video_metadata=[{"fps": ...}]`).

    Frame count: every video gives exactly `num_frames` frames. A video with fewer frames repeats its frames evenly and
    in order to reach `num_frames` (3 frames -> 8: `[0, 0, 0, 1, 1, 2, 2, 2]`). This is the paper's behaviour (a fixed
    frame count per clip, for which the token-aggregation schedule is set) and differs from transformers' video
    processors, which return what they sampled and refuse `num_frames` above the video's length.

    Sampling by frame rate (`fps=`, as transformers' `BaseVideoProcessor.sample_frames`): a video of `T` frames at
    `video_fps` gives `max(1, int(T / video_fps * fps))` frames, chosen with `frame_sampling` (uniform segment
    midpoints by default), so the frame count follows the video's duration. `num_frames` and `fps` are mutually
    exclusive: passing both in one call, or to the constructor, raises `ValueError`; one given in a call replaces the
    processor's setting of the other (`TestaVideoProcessor(fps=1)` has `num_frames=None`, and
    `processor(video, num_frames=8)` samples 8 frames whatever the processor's `fps`). Files carry their frame rate;
    arrays and lists of frames have none unless given as `video_metadata={"fps": ...}`, and sampling them by `fps`
    without it raises a `ValueError` naming `fps` and `video_metadata`. An `fps` above the video's frame rate raises
    too (it would ask for more frames than the video has). Batches of videos of different durations then have
    different frame counts: pass `return_tensors=None` for a list.

    Args:
        num_frames (`int`, defaults to 32): frames per video (see "Frame count").
        fps (`float`, *optional*): sample this many frames per second of video instead of `num_frames`.
        frame_sampling (`str`, defaults to `"uniform"`): see [`sample_frame_indices`].
        do_sample_frames (`bool`, defaults to `True`): sample `num_frames` frames; when `False`, all frames of a file
            are decoded and arrays are used as given.
        seed (`int`, *optional*): makes `"random"`/`"headtail"` sampling reproducible per call.
        resize_mode (`str`, defaults to `"square"`): `"square"` resizes every frame straight to `crop_size` (aspect
            ratio not kept, no crop), as the original TESTA data pipeline did; `"shortest_edge"` resizes the shortest
            edge to `size["shortest_edge"]` and center-crops to `crop_size`.
        size (`dict`, defaults to `{"shortest_edge": 224}`), crop_size (`dict`, defaults to
            `{"height": 224, "width": 224}`): see `resize_mode`.
        resample (defaults to `PILImageResampling.BICUBIC`): interpolation (antialiased).
        do_rescale (`bool`, defaults to `True`), rescale_factor (`float`, defaults to 1/255): integer frames are
            multiplied by `rescale_factor`; float frames are assumed to be in [0, 1] already unless their maximum is
            above 1.
        do_normalize (`bool`, defaults to `True`), image_mean / image_std (default: OpenAI CLIP mean and std).
        dtype (`str`, defaults to `"float32"`): dtype of `pixel_values`.
        video_backend (`str`, defaults to `"auto"`): `"decord"`, `"pyav"` or `"auto"` (decord when installed, PyAV
            when decord is missing or fails on a file).
        isolate_decoder (`bool`, defaults to `True`), decode_timeout (`float`, defaults to 120), decode_threads
            (`int`, *optional*): see [`decode_video`].
    """

    resample = 3  # PILImageResampling.BICUBIC, as an int (what a saved config holds): importable without Pillow
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    size = {"shortest_edge": 224}
    crop_size = {"height": 224, "width": 224}
    default_to_square = False
    do_resize = True
    do_center_crop = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    do_sample_frames = True
    num_frames = 32
    return_metadata = False
    return_tensors = "pt"
    frame_sampling = "uniform"
    resize_mode = "square"
    video_backend = "auto"
    seed = None
    dtype = "float32"
    isolate_decoder = True
    decode_timeout = 120.0
    decode_threads = None
    valid_kwargs = TestaVideoProcessorKwargs
    model_input_names = ["pixel_values"]

    def __init__(self, **kwargs: Unpack[TestaVideoProcessorKwargs]) -> None:
        # `auto_map` (in a saved config) says which exported file defines this class: it is written again by every
        # save (`to_json_string`) and is no setting of the processor, so that a saved and reloaded processor equals
        # the original (`to_dict`)
        kwargs.pop("auto_map", None)
        if isinstance(kwargs.get("dtype"), torch.dtype):
            kwargs["dtype"] = _dtype_name(kwargs["dtype"])
        _check_one_frame_budget(kwargs.get("num_frames"), kwargs.get("fps"))
        super().__init__(**kwargs)
        if self.fps is not None:
            self.num_frames = None  # sampling by frame rate replaces the class default of 32 frames
        self._check_options(
            frame_sampling=self.frame_sampling,
            resize_mode=self.resize_mode,
            video_backend=self.video_backend,
            num_frames=self.num_frames,
            dtype=self.dtype,
            fps=self.fps,
        )

    @classmethod
    def for_model_input(cls, num_frames: int, image_size: int, **kwargs: Any) -> "TestaVideoProcessor":
        """A processor giving a model's input: ``num_frames`` frames resized to ``image_size`` (``size`` and
        ``crop_size``), the other settings at their defaults or as in ``kwargs``."""
        return cls(num_frames=num_frames, size={"shortest_edge": image_size},
                   crop_size={"height": image_size, "width": image_size}, **kwargs)

    # -- options ------------------------------------------------------------------------------------------------------

    @staticmethod
    def _check_options(
        frame_sampling: str | None = None,
        resize_mode: str | None = None,
        video_backend: str | None = None,
        num_frames: int | None = None,
        dtype: Any = None,
        fps: float | None = None,
        **_: Any,
    ) -> None:
        for name, value, allowed in (("frame_sampling", frame_sampling, FRAME_SAMPLING_STRATEGIES),
                                     ("resize_mode", resize_mode, RESIZE_MODES),
                                     ("video_backend", video_backend, VIDEO_BACKENDS)):
            if value is not None and value not in allowed:
                raise ValueError(f"Unknown {name}={value!r}; use one of {allowed}.")
        if num_frames is not None and (isinstance(num_frames, bool) or int(num_frames) < 1):
            raise ValueError(f"`num_frames` must be a positive int, got {num_frames!r}.")
        if dtype is not None:
            _resolve_dtype(dtype)
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
            raise ValueError(f"`fps` must be a positive number of frames per second, got {fps!r}.")

    def sample_frames(
        self,
        metadata: VideoMetadata,
        num_frames: int | None = None,
        fps: int | float | None = None,
        frame_sampling: str | None = None,
        generator: torch.Generator | None = None,
        source: str = "the video",
        **kwargs: Any,
    ) -> np.ndarray:
        """Frame indices for one video, using [`sample_frame_indices`] with this processor's settings.

        Args:
            metadata (`VideoMetadata`): needs `total_num_frames`, and `fps` when sampling by frame rate.
            num_frames (`int`, *optional*): frames to sample.
            fps (`float`, *optional*): frames to sample per second instead (see the class docstring). Mutually
                exclusive with `num_frames`; when both are `None`, the processor's own setting applies, and when the
                processor has neither either, every frame is returned (as transformers does).
            frame_sampling (`str`, *optional*): defaults to `self.frame_sampling`.
            generator (`torch.Generator`, *optional*): random source for random strategies.
            source (`str`, defaults to `"the video"`): names the video in error messages.
        """
        self._check_options(num_frames=num_frames, fps=fps)
        num_frames, fps = self._frame_budget(num_frames, fps)
        total = metadata.total_num_frames
        if fps is not None:
            num_frames = frames_for_fps(total, metadata.fps, fps, source)
        if num_frames is None:
            return np.arange(total, dtype=np.int64)
        strategy = self.frame_sampling if frame_sampling is None else frame_sampling
        return sample_frame_indices(total, num_frames, strategy, generator)

    # -- decoding -----------------------------------------------------------------------------------------------------

    def fetch_videos(
        self,
        video_url_or_urls: str | os.PathLike | list,
        sample_indices_fn: Callable[..., Any] | None = None,
        video_backend: str | None = None,
        isolate_decoder: bool | None = None,
        decode_timeout: float | None = None,
        decode_threads: int | None = None,
    ) -> tuple[Any, Any]:
        """Decodes one path/URL, or a (nested) list of them, with decord or PyAV instead of the base class' torchcodec.

        Args:
            video_url_or_urls: a path or URL, or a list of them.
            sample_indices_fn (`Callable`, *optional*): called as `sample_indices_fn(metadata=VideoMetadata)`; returns
                the frame indices to decode. All frames when `None`.
            video_backend, isolate_decoder, decode_timeout, decode_threads: default to this processor's settings.

        Returns:
            For one source, `(frames, metadata)` with `frames` a uint8 `(T, H, W, 3)` array; for a list, a pair
            `(list_of_frames, list_of_metadata)`.
        """
        if isinstance(video_url_or_urls, (list, tuple)):
            results = [
                self.fetch_videos(
                    item,
                    sample_indices_fn=sample_indices_fn,
                    video_backend=video_backend,
                    isolate_decoder=isolate_decoder,
                    decode_timeout=decode_timeout,
                    decode_threads=decode_threads,
                )
                for item in video_url_or_urls
            ]
            return [r[0] for r in results], [r[1] for r in results]
        fn = None if sample_indices_fn is None else (lambda metadata: sample_indices_fn(metadata=metadata))
        return decode_video(
            video_url_or_urls,
            sample_indices_fn=fn,
            backend=self.video_backend if video_backend is None else video_backend,
            isolate_decoder=self.isolate_decoder if isolate_decoder is None else isolate_decoder,
            decode_timeout=self.decode_timeout if decode_timeout is None else decode_timeout,
            num_threads=self.decode_threads if decode_threads is None else decode_threads,
        )

    # -- main entry point ---------------------------------------------------------------------------------------------

    def preprocess(self, videos: Any, **kwargs: Unpack[TestaVideoProcessorKwargs]) -> BatchFeature:
        """Decodes (if needed), samples, resizes, rescales and normalises a video or a batch of videos.

        See the class docstring for the accepted inputs and the output. Every setting can be overridden per call,
        e.g. `processor(videos, num_frames=8, frame_sampling="random", seed=0)` or `processor(videos, fps=1)`.
        """
        validate_kwargs(captured_kwargs=kwargs.keys(), valid_processor_keys=list(self.valid_kwargs.__annotations__))
        self._check_options(**kwargs)  # clear ValueErrors for bad choices before the generic type validation
        validate_typed_dict(self.valid_kwargs, kwargs)
        num_frames, fps = self._frame_budget(kwargs.get("num_frames"), kwargs.get("fps"))
        for name in self.valid_kwargs.__annotations__:
            kwargs.setdefault(name, getattr(self, name, None))
        kwargs.update(num_frames=num_frames, fps=fps)
        self._check_options(**kwargs)
        out_dtype = _resolve_dtype(kwargs["dtype"])

        items = flatten_video_inputs(videos)
        metadata_in = metadata_per_video(kwargs["video_metadata"], len(items))
        generator = torch.Generator().manual_seed(int(kwargs["seed"])) if kwargs["seed"] is not None else None
        sample_fn = None
        if kwargs["do_sample_frames"]:
            sample_fn = partial(
                self.sample_frames, num_frames=num_frames, fps=fps, frame_sampling=kwargs["frame_sampling"],
                generator=generator,
            )

        clips: list[torch.Tensor] = []
        metadata_out: list[VideoMetadata] = []
        for (label, video), given_metadata in zip(items, metadata_in):
            video_sample_fn = None if sample_fn is None else partial(sample_fn, source=label)
            if is_path(video):
                clip, metadata = self._decoded_clip(video, video_sample_fn, kwargs)
            else:
                clip, metadata = self._array_clip(video, label, given_metadata, video_sample_fn, kwargs)
            clip = to_rgb(clip, label, kwargs["do_convert_rgb"])
            if kwargs["device"] is not None:
                clip = clip.to(kwargs["device"])
            clips.append(clip)
            metadata_out.append(metadata)
        return self._to_pixel_values(clips, metadata_out, out_dtype, kwargs)

    def _frame_budget(self, num_frames: int | None, fps: float | None) -> tuple[int | None, float | None]:
        """`(num_frames, fps)` for one call (at most one set): the call's own choice, else the processor's."""
        _check_one_frame_budget(num_frames, fps)
        if num_frames is None and fps is None:
            return self.num_frames, self.fps
        return num_frames, fps

    def _decoded_clip(
        self, source: str | os.PathLike, sample_fn: Callable[..., Any] | None, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, VideoMetadata]:
        """Decodes the sampled frames of a file: `(T, 3, H, W)` uint8 and the video's metadata."""
        frames, metadata = self.fetch_videos(
            source,
            sample_indices_fn=sample_fn,
            video_backend=kwargs["video_backend"],
            isolate_decoder=kwargs["isolate_decoder"],
            decode_timeout=kwargs["decode_timeout"],
            decode_threads=kwargs["decode_threads"],
        )
        return torch.from_numpy(frames).permute(0, 3, 1, 2), metadata

    @staticmethod
    def _array_clip(
        video: Any,
        label: str,
        given_metadata: dict[str, Any] | None,
        sample_fn: Callable[..., Any] | None,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, VideoMetadata]:
        """The sampled frames of an in-memory video, `(T, C, H, W)`, and its metadata (with the caller's `fps`)."""
        clip = video_to_tensor(video, label, kwargs["input_data_format"])
        metadata = VideoMetadata(
            total_num_frames=int(clip.shape[0]),
            height=int(clip.shape[-2]),
            width=int(clip.shape[-1]),
        )
        if given_metadata:
            metadata.update({k: v for k, v in given_metadata.items() if k != "total_num_frames"})
        if metadata.fps and metadata.duration is None:
            metadata.duration = metadata.total_num_frames / metadata.fps
        if sample_fn is not None:
            indices = check_frame_indices(sample_fn(metadata=metadata), metadata.total_num_frames, label)
            clip = clip[torch.from_numpy(indices)]
        else:
            indices = np.arange(metadata.total_num_frames)
        metadata.frames_indices = [int(i) for i in indices]
        return clip, metadata

    def _transform_settings(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The resize/crop/rescale/normalise settings of a call (`kwargs` complete: every setting present)."""
        std_kwargs = self._standardize_kwargs(
            size=kwargs["size"],
            crop_size=kwargs["crop_size"],
            default_to_square=kwargs["default_to_square"],
            image_mean=kwargs["image_mean"],
            image_std=kwargs["image_std"],
        )
        settings = {k: kwargs[k] for k in ("do_resize", "resample", "do_center_crop", "do_rescale", "rescale_factor",
                                           "do_normalize", "resize_mode")}
        settings.update({k: std_kwargs[k] for k in ("size", "crop_size", "image_mean", "image_std")})
        self._validate_preprocess_kwargs(**{k: v for k, v in settings.items() if k != "resize_mode"})
        return settings

    def _to_pixel_values(
        self,
        clips: list[torch.Tensor],
        metadata: list[VideoMetadata],
        out_dtype: torch.dtype,
        kwargs: dict[str, Any],
    ) -> BatchFeature:
        """Resizes, rescales and normalises the clips and packs them (stacked unless `return_tensors=None`)."""
        settings = self._transform_settings(kwargs)
        pixel_values = [self._transform(clip, **settings).to(out_dtype) for clip in clips]
        return_tensors = kwargs["return_tensors"]
        if return_tensors is not None:
            shapes = {tuple(p.shape) for p in pixel_values}
            if len(shapes) != 1:
                raise ValueError(
                    f"Cannot stack videos of different shapes {sorted(shapes)} into one tensor; keep "
                    "do_sample_frames=True with a fixed num_frames (not fps) and resize to a fixed crop_size, or pass "
                    "return_tensors=None for a list."
                )
            stacked = torch.stack(pixel_values)
            data = {"pixel_values": stacked.numpy() if str(return_tensors) in ("np", "TensorType.NUMPY") else stacked}
        else:
            data = {"pixel_values": pixel_values}
        output = BatchFeature(data=data)
        if kwargs["return_metadata"]:
            output["video_metadata"] = metadata
        return output

    def frame_transforms(
        self, **kwargs: Unpack[TestaVideoProcessorKwargs]
    ) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """What this processor does to decoded frames, in two steps, so that a caller can shrink each frame as it is
        decoded and keep it at the model's input size (`moments` does, for long videos).

        Returns `(prepare, finish)` with this processor's settings (and the call's `kwargs`, as `__call__` takes
        them): `prepare(frames)` resizes (and, with `resize_mode="shortest_edge"`, crops) uint8 RGB frames
        `(T, 3, H, W)` to the model's input size, keeping uint8; `finish(frames)` rescales, normalises and casts
        prepared frames to `pixel_values` `(T, 3, h, w)` in the processor's `dtype`. Every step works frame by frame,
        so `finish(torch.cat([prepare(f) for f in frames]))` equals `self(videos=[frames], num_frames=T)`'s
        `pixel_values[0]` exactly (`tests/test_moments.py` checks it).
        """
        validate_kwargs(captured_kwargs=kwargs.keys(), valid_processor_keys=list(self.valid_kwargs.__annotations__))
        self._check_options(**kwargs)
        for name in self.valid_kwargs.__annotations__:
            kwargs.setdefault(name, getattr(self, name, None))
        settings = self._transform_settings(kwargs)
        out_dtype = _resolve_dtype(kwargs["dtype"])
        geometry = {k: settings[k] for k in ("do_resize", "size", "resample", "resize_mode", "do_center_crop",
                                             "crop_size")}
        values = {k: settings[k] for k in ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")}

        def prepare(frames: torch.Tensor) -> torch.Tensor:
            return self._geometry(frames, **geometry)

        def finish(frames: torch.Tensor) -> torch.Tensor:
            return self._values(frames, **values).to(out_dtype)

        return prepare, finish

    def _geometry(self, video: torch.Tensor, do_resize: bool, size: SizeDict, resample: Any, resize_mode: str,
                  do_center_crop: bool, crop_size: SizeDict) -> torch.Tensor:
        """Resize (+ crop) one (T, 3, H, W) clip, frame by frame; the dtype is kept."""
        if do_resize:
            if resize_mode == "square":
                video = self.resize(video, SizeDict(height=crop_size.height, width=crop_size.width), resample=resample)
            else:
                video = self.resize(video, size, resample=resample)
        if do_center_crop and resize_mode == "shortest_edge":
            video = self.center_crop(video, crop_size)
        return video

    def _values(self, video: torch.Tensor, do_rescale: bool, rescale_factor: float, do_normalize: bool,
                image_mean: Any, image_std: Any, rescale: bool | None = None) -> torch.Tensor:
        """Rescale and normalise one (T, 3, h, w) clip; returns float32. `rescale` (default: `do_rescale`, except
        for float frames already in [0, 1]) says whether to rescale."""
        if rescale is None:
            rescale = do_rescale and not (video.is_floating_point() and float(video.max()) <= 1.0)
        if video.is_floating_point():
            video = video.float()
        if rescale or do_normalize:
            video = self.rescale_and_normalize(video, rescale, rescale_factor, do_normalize, image_mean, image_std)
        return video.float()

    def _transform(
        self,
        video: torch.Tensor,
        do_resize: bool,
        size: SizeDict,
        resample: Any,
        resize_mode: str,
        do_center_crop: bool,
        crop_size: SizeDict,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: Any,
        image_std: Any,
    ) -> torch.Tensor:
        """Resize (+ crop), rescale and normalise one (T, 3, H, W) clip; returns float32."""
        rescale = do_rescale
        if video.is_floating_point():
            video = video.float()
            if do_rescale and float(video.max()) <= 1.0:
                rescale = False  # float frames already in [0, 1], judged before resizing
        video = self._geometry(video, do_resize, size, resample, resize_mode, do_center_crop, crop_size)
        return self._values(video, do_rescale, rescale_factor, do_normalize, image_mean, image_std, rescale=rescale)

    # -- saving -------------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The processor's settings, serialisable: what `video_preprocessor_config.json` holds except `auto_map`.

        `auto_map` is export metadata, not a setting (`to_json_string` writes it), so a processor and its saved and
        reloaded copy have equal `to_dict()`, before and after saving.
        """
        output = super().to_dict()
        output.pop("auto_map", None)  # set on the object by transformers' `custom_object_save` while saving
        if isinstance(output.get("dtype"), torch.dtype):
            output["dtype"] = _dtype_name(output["dtype"])
        return output

    def remote_code_auto_map(self) -> dict[str, str] | None:
        """The `auto_map` of a saved config, `{"AutoVideoProcessor": "video_processing_testa.TestaVideoProcessor"}`:
        which exported file defines this class (see `register_for_auto_class`); `None` for an unregistered class."""
        if self._auto_class is None:
            return None
        return {self._auto_class: f"{type(self).__module__.rsplit('.', 1)[-1]}.{type(self).__name__}"}

    def to_json_string(self) -> str:
        """`to_dict()` plus `remote_code_auto_map()`, as JSON: the content of `video_preprocessor_config.json`."""
        dictionary = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in self.to_dict().items()}
        auto_map = self.remote_code_auto_map()
        if auto_map:
            dictionary["auto_map"] = auto_map
        return json.dumps(dictionary, indent=2, sort_keys=True) + "\n"


def _check_one_frame_budget(num_frames: int | None, fps: float | None) -> None:
    """Raises transformers' `ValueError` when both `num_frames` and `fps` are given."""
    if num_frames is not None and fps is not None:
        raise ValueError(
            "`num_frames` and `fps` are mutually exclusive arguments, please use only one! "
            f"(got num_frames={num_frames!r} and fps={fps!r})"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _resolve_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":  # "auto": what `pipeline()` / `from_pretrained` pass for the model's dtype
        return torch.float32
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"Unsupported dtype={dtype!r} for pixel_values; use one of {sorted(_DTYPES)}.")
    return _DTYPES[name]


TestaVideoProcessor.register_for_auto_class()

__all__ = ["TestaVideoProcessor", "TestaVideoProcessorKwargs"]
