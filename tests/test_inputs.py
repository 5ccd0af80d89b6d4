"""Bad inputs give one clear message (a ValueError naming the thing at fault), never a traceback or a
wrong answer: image files (proteus.images), ImageFolder layouts, device names, backbone weights.

Every image, folder and weights file is made here under tmp_path; nothing needs the network or a GPU.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from proteus import distributed
from proteus.backbones import build_backbone
from proteus.backbones.hub import hub_unreachable_reason
from proteus.backbones.weights import WeightsError
from proteus.config import BenchmarkConfig
from proteus.distributed import DeviceError, device_for_rank
from proteus.images import (
    DEFAULT_MAX_PIXELS,
    ImageError,
    ImageTooLargeError,
    load_images,
    open_image,
    to_rgb,
)
from proteus.streams import BenchmarkError, CorruptImageError, DataNotFoundError, build_benchmark
from proteus.streams.datasets import ImageFileDataset, list_class_dirs, scan_image_folder

VIT = "vit_ti16"  # the smallest timm ViT preset of the registry
VIT_REPO = "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


# ---------------------------------------------------------------------------------------------- helpers
def gradient16(h: int = 24, w: int = 40) -> np.ndarray:
    """A 16-bit ramp covering 0..65535 (so clipping at 255 would be obvious)."""
    ramp = np.linspace(0, 65535, h * w).round().astype(np.uint16)
    return ramp.reshape(h, w)


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header says ``width x height`` but whose pixel data is garbage (decoding would fail)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grayscale
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"not zlib") + chunk(b"IEND", b"")
    )
    return path


def save_rgb(path: Path, value: int = 100, size: tuple[int, int] = (8, 8)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, value // 2, 255 - value)).save(path)
    return path


def make_tree(root: Path, classes: dict[str, int], splits: tuple[str, ...] = ("train", "test")) -> Path:
    for split in splits:
        (root / split).mkdir(parents=True, exist_ok=True)
        for ci, (name, n) in enumerate(classes.items()):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                save_rgb(root / split / name / f"{i:03d}.png", 20 * ci + i)
    return root


@pytest.fixture
def empty_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Hugging Face and torch caches pointed at empty folders under tmp_path; no proxy."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    for var in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        *PROXY_VARS,
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.hub, "_hub_dir", None, raising=False)
    return tmp_path / "hf" / "hub"


# ---------------------------------------------------------------------------------------------- images
def test_16bit_png_decodes_like_its_8bit_version(tmp_path: Path) -> None:
    a16 = gradient16()
    a8 = np.floor(a16 / 257 + 0.5).astype(np.uint8)
    Image.fromarray(a16).save(tmp_path / "g16.png")
    Image.fromarray(a8).save(tmp_path / "g8.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I;16")  # really a 16-bit file
    rgb16 = np.asarray(open_image(tmp_path / "g16.png"), dtype=np.int16)
    rgb8 = np.asarray(open_image(tmp_path / "g8.png"), dtype=np.int16)
    assert rgb16.shape == rgb8.shape == (*a16.shape, 3)
    assert np.abs(rgb16 - rgb8).max() <= 1
    assert rgb16.min() == 0 and rgb16.max() == 255 and len(np.unique(rgb16)) > 200  # scaled, not clipped


def test_mode_I_with_16bit_data_is_scaled_like_16bit() -> None:
    a16 = gradient16()
    img = Image.fromarray(a16.astype(np.int32))
    assert img.mode == "I"
    got = np.asarray(to_rgb(img), dtype=np.int16)[..., 0]
    assert np.abs(got - np.floor(a16 / 257 + 0.5)).max() <= 1


def test_float_images_scaled_by_range() -> None:
    unit = np.linspace(0, 1, 50, dtype=np.float32).reshape(5, 10)
    assert np.array_equal(np.asarray(to_rgb(Image.fromarray(unit)))[..., 1], np.floor(unit * 255 + 0.5))
    wide = (unit * 1000 - 300).astype(np.float32)  # outside [0, 1]: min-max
    got = np.asarray(to_rgb(Image.fromarray(wide)))[..., 2]
    assert got.min() == 0 and got.max() == 255
    wide32 = Image.fromarray((unit * 10_000_000).astype(np.int32))  # "I" beyond 16 bits: min-max
    got32 = np.asarray(to_rgb(wide32))[..., 0]
    assert got32.min() == 0 and got32.max() == 255


@pytest.mark.parametrize("mode", ["F", "I", "I;16"])
def test_high_bit_depth_by_strips_as_in_one_piece(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A high-bit-depth image converts a strip of rows at a time, a row longer than a strip in pieces
    (temporaries bounded, not the image's size): the same bytes as in one piece, NaN and infinities
    included."""
    import proteus.images as images

    rng = np.random.default_rng(0)
    if mode == "F":
        arr = (rng.standard_normal((37, 23)) * 1e3).astype(np.float32)
        arr[3, 4], arr[5, 6], arr[7, 8] = np.nan, np.inf, -np.inf
    elif mode == "I":
        arr = rng.integers(-(2**31), 2**31 - 1, (37, 23), dtype=np.int64).astype(np.int32)
    else:
        arr = rng.integers(0, 65535, (37, 23), dtype=np.int64).astype(np.uint16)
    img = Image.fromarray(arr)  # F, I and I;16 from float32, int32 and uint16
    assert img.mode == mode
    whole = np.asarray(to_rgb(img))
    monkeypatch.setattr(images, "STRIP_SAMPLES", 50)  # strips of 2 rows
    assert np.array_equal(np.asarray(to_rgb(img)), whole)
    monkeypatch.setattr(images, "STRIP_SAMPLES", 10)  # a row longer than that: pieces of 10, 10 and 3
    assert np.array_equal(np.asarray(to_rgb(img)), whole)
    assert max(a.size for _, _, a in images._tiles(img)) == 10


def test_a_float_image_is_never_copied_whole_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """The conversion's numpy temporaries stay near a strip's size: a 1000 x 1000 float image (an 8 MB
    float64 copy, were it made whole) converts with under 3 MB of numpy memory at 10,000-sample strips (the
    uint8 result itself is 1 MB)."""
    import tracemalloc

    import proteus.images as images

    arr = (np.random.default_rng(0).standard_normal((1000, 1000)) * 100).astype(np.float32)
    img = Image.fromarray(arr)
    monkeypatch.setattr(images, "STRIP_SAMPLES", 10_000)
    tracemalloc.start()
    try:
        to_rgb(img)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3_000_000, peak


def test_an_extreme_aspect_ratio_is_cut_before_the_resize() -> None:
    """The resize scales the short side, so a long thin image (64 megapixels at 8,000,000 x 8) would become
    gigapixels: it is cut to its centre at 4 x its short side first, which keeps the centre crop whole (the
    same crop to the resampling's round-off); an image within that ratio is not touched."""
    from proteus.backbones.base import DataConfig
    from proteus.backbones.transforms import MAX_ASPECT, _bounded_aspect, build_transform

    cfg = DataConfig(input_size=32, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    tf = build_transform(cfg)
    rng = np.random.default_rng(0)
    thin = Image.fromarray(rng.integers(0, 255, (40, 4000, 3), dtype=np.uint8))  # 4000 x 40: 100 to 1
    assert _bounded_aspect(thin).size == (MAX_ASPECT * 40, 40)
    ok = Image.fromarray(rng.integers(0, 255, (40, 160, 3), dtype=np.uint8))
    assert _bounded_aspect(ok) is ok
    import torchvision.transforms as T

    ref = T.Compose([T.Resize(round(32 / cfg.crop_pct)), T.CenterCrop(32), T.ToTensor(),
                     T.Normalize(cfg.mean, cfg.std)])(thin)  # fmt: skip
    got = tf(thin)
    assert got.shape == ref.shape == (3, 32, 32)
    assert float((got - ref).abs().max()) < 0.05
    huge = Image.new("L", (8_000_000, 8)).convert("RGB")  # resized whole: 73 x 73,000,000 pixels
    assert tf(huge).shape == (3, 32, 32)


def test_oversized_header_refused_before_decoding_without_pil_bomb_warning(tmp_path: Path) -> None:
    limit_before = Image.MAX_IMAGE_PIXELS
    big = png_header_only(tmp_path / "big.png", 12000, 12000)  # above PIL's warning threshold
    huge = png_header_only(tmp_path / "huge.png", 20000, 20000)  # above PIL's error threshold
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ImageTooLargeError) as info:
            open_image(big)
        with pytest.raises(ImageTooLargeError, match="400.0 megapixels"):
            open_image(huge)
    msg = str(info.value)
    assert msg == (
        f"{big}: 12000 x 12000 = 144.0 megapixels is above the limit of 64.0 megapixels "
        "(raise it with --max-pixels / eval.max_image_pixels)"
    )
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert Image.MAX_IMAGE_PIXELS == limit_before  # PIL's global limit is left as it was
    assert DEFAULT_MAX_PIXELS == 64_000_000


def test_raised_limit_decodes_without_pil_bomb_warning(tmp_path: Path) -> None:
    # no limit of ours: the (garbage) pixel data is reached, and PIL still neither warns nor raises a bomb
    big = png_header_only(tmp_path / "big.png", 12000, 12000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ImageError, match="truncated or corrupt") as info:
            open_image(big, max_pixels=None)
    assert not isinstance(info.value, ImageTooLargeError)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]


def test_small_max_pixels(tmp_path: Path) -> None:
    f = save_rgb(tmp_path / "a.png", size=(100, 80))
    with pytest.raises(ImageTooLargeError, match=r"a\.png: 100 x 80 = 0\.0 megapixels is above the limit"):
        open_image(f, max_pixels=5000)
    assert open_image(f, max_pixels=8000).size == (100, 80)
    with pytest.raises(ValueError, match="max_pixels must be a positive integer"):
        open_image(f, max_pixels=0)


def _truncated(tmp_path: Path) -> Path:
    good = save_rgb(tmp_path / "full.png", size=(64, 64))
    Image.fromarray(np.random.RandomState(0).randint(0, 255, (64, 64, 3), dtype=np.uint8)).save(good)
    data = good.read_bytes()
    bad = tmp_path / "cut.png"
    bad.write_bytes(data[: len(data) // 2])
    return bad


def _text(tmp_path: Path) -> Path:
    f = tmp_path / "notes.png"
    f.write_text("this is a text file, not a picture\n")
    return f


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "nowhere.png"


def _directory(tmp_path: Path) -> Path:
    d = tmp_path / "folder.png"
    d.mkdir()
    return d


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_truncated, "truncated or corrupt"),
        (_text, "not an image"),
        (_missing, "no such file"),
        (_directory, "is a directory"),
    ],
    ids=["truncated", "text-named-png", "missing", "directory"],
)
def test_unreadable_image_names_file(tmp_path: Path, make, reason: str) -> None:
    f = make(tmp_path)
    with pytest.raises(ImageError) as info:
        open_image(f)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"{f}: ") and reason in str(info.value)
    assert info.value.path == str(f) and reason in info.value.reason


def test_load_images_skips_unreadable(tmp_path: Path) -> None:
    good1 = save_rgb(tmp_path / "a.png")
    good2 = save_rgb(tmp_path / "b.jpg", value=30)
    text = _text(tmp_path)
    missing = _missing(tmp_path)
    images, kept, skipped = load_images([good1, text, good2, missing], skip_unreadable=True)
    assert kept == [str(good1), str(good2)]
    assert [im.mode for im in images] == ["RGB", "RGB"]
    assert [p for p, _ in skipped] == [str(text), str(missing)]
    assert "not an image" in skipped[0][1] and "no such file" in skipped[1][1]
    with pytest.raises(ImageError, match="notes.png: "):
        load_images([good1, text, good2])


@pytest.mark.parametrize("mode", ["RGBA", "P", "CMYK", "LA", "1"])
def test_colour_modes_decode_to_rgb(tmp_path: Path, mode: str) -> None:
    if mode == "RGBA":
        src = Image.new("RGBA", (6, 4), (10, 200, 30, 0))  # fully transparent: alpha is dropped
        expected = (10, 200, 30)
    elif mode == "P":
        src = Image.new("RGB", (6, 4), (255, 0, 0)).convert("P")
        expected = (255, 0, 0)
    elif mode == "CMYK":
        src = Image.new("CMYK", (6, 4), (0, 255, 255, 0))  # no cyan, full magenta and yellow = red
        expected = (255, 0, 0)
    elif mode == "LA":
        src = Image.new("LA", (6, 4), (77, 128))
        expected = (77, 77, 77)
    else:
        src = Image.new("1", (6, 4), 1)
        expected = (255, 255, 255)
    f = tmp_path / ("img.jpg" if mode == "CMYK" else "img.png")
    src.save(f)
    assert Image.open(f).mode == mode
    out = open_image(f)
    assert out.mode == "RGB" and out.size == (6, 4)
    assert np.abs(np.asarray(out, dtype=int)[1, 1] - np.array(expected)).max() <= 2


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    img = Image.new("RGB", (40, 20), (0, 0, 0))
    img.paste((255, 255, 255), (0, 0, 20, 20))  # left half white
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    f = tmp_path / "rotated.jpg"
    img.save(f, exif=exif.tobytes(), quality=95)
    out = open_image(f)
    assert out.size == (20, 40)  # upright: portrait
    arr = np.asarray(out, dtype=int)
    assert arr[5, 10].mean() > 200 and arr[35, 10].mean() < 50  # the white half is now on top


def test_dataset_decodes_like_prediction(tmp_path: Path) -> None:
    Image.fromarray(gradient16()).save(tmp_path / "g16.png")
    png_header_only(tmp_path / "big.png", 9000, 9000)
    ds = ImageFileDataset(tmp_path, ["g16.png", "big.png"], [0, 1])
    img, label = ds[0]
    assert label == 0 and np.array_equal(np.asarray(img), np.asarray(open_image(tmp_path / "g16.png")))
    with pytest.raises(
        CorruptImageError, match="cannot read image file .*big.png: 9000 x 9000 = 81.0 megap"
    ) as info:
        ds[1]
    assert isinstance(info.value, ImageError) and isinstance(info.value, BenchmarkError)
    assert ds.select([0]).max_pixels == DEFAULT_MAX_PIXELS


# ---------------------------------------------------------------------------------------------- ImageFolder
def test_benchmark_errors_are_value_errors() -> None:
    for cls in (BenchmarkError, DataNotFoundError, CorruptImageError):
        assert issubclass(cls, ValueError)
    assert issubclass(DataNotFoundError, FileNotFoundError)  # kept for existing handlers


def test_imagefolder_with_one_class(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "one", {"cat": 2})
    (root / "tasks.yaml").write_text(yaml.safe_dump({"tasks": [["cat"]]}))
    with pytest.warns(UserWarning, match="single class"):
        with pytest.raises(BenchmarkError) as info:
            build_benchmark(BenchmarkConfig(name="folder", data=str(root)))
    msg = str(info.value)
    assert str(root / "train") in msg and "only one class" in msg and "<class_a>" in msg


def test_imagefolder_without_class_folders(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "train" / "stray.png").write_bytes(b"")  # files directly in the split are not classes
    with pytest.raises(BenchmarkError) as info:
        scan_image_folder(root, "train", list_class_dirs(root / "train"))
    assert f"{root / 'train'} holds no class folder" in str(info.value) and "<class_a>" in str(info.value)
    with pytest.raises(DataNotFoundError, match=str(root / "train")):
        build_benchmark(BenchmarkConfig(name="imagenet-r", data=str(root), num_tasks=1))


def test_imagefolder_class_folder_without_images(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "t", {"a": 2, "b": 2})
    for f in (root / "train" / "b").iterdir():
        f.unlink()
    (root / "train" / "b" / "readme.txt").write_text("no images here")
    with pytest.raises(BenchmarkError) as info:
        scan_image_folder(root, "train", ["a", "b"])
    assert f"class folder {root / 'train' / 'b'} holds no image" in str(info.value)


def test_missing_split_folder_names_it(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match=f"split folder {tmp_path / 'nope'} does not exist"):
        list_class_dirs(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------- devices
@pytest.mark.parametrize("name", ["tpu", "gpu0", "cuda:x"])
def test_unknown_device(name: str) -> None:
    with pytest.raises(DeviceError, match=f"unknown device '{name}'; use auto, cpu, cuda or cuda:N"):
        device_for_rank(name)


def test_mps_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="device 'mps' .* not available.*use auto, cpu, cuda or cuda:N"):
        device_for_rank("mps")


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_gpu(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError) as info:
        device_for_rank(name)
    msg = str(info.value)
    assert msg.startswith(f"device '{name}' was requested but no CUDA GPU is visible to torch (torch ")
    assert "CUDA build: " in msg and msg.endswith("use --device cpu")
    assert issubclass(DeviceError, ValueError)


def test_cuda_index_beyond_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceError, match=r"'cuda:2' was requested but torch sees only 2 CUDA GPU\(s\)"):
        device_for_rank("cuda:2")
    assert device_for_rank("cuda:1") == torch.device("cuda", 1)


def test_auto_and_torchrun_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_for_rank("auto") == torch.device("cpu")
    assert device_for_rank("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # a plain run names the GPU by its index, as torchrun does: the records of both say cuda:0 (the first
    # gpu-check found "cuda" in one and "cuda:0" in the other)
    assert device_for_rank("auto") == torch.device("cuda", 0) == device_for_rank("cuda")
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_for_rank("auto") == torch.device("cuda", 3)
    assert device_for_rank("cuda") == torch.device("cuda", 3)


# ---------------------------------------------------------------------------------------------- weights
def _truncated_pth(tmp_path: Path) -> Path:
    f = tmp_path / "cut.pth"
    torch.save({"w": torch.zeros(1000)}, f)
    f.write_bytes(f.read_bytes()[:300])
    return f


def _text_safetensors(tmp_path: Path) -> Path:
    f = tmp_path / "notes.safetensors"
    f.write_text("hello, not weights")
    return f


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda p: p / "absent.pth", "not found"),
        (lambda p: p, "is a directory"),
        (_truncated_pth, "truncated"),
        (_text_safetensors, "not a readable safetensors file"),
    ],
    ids=["missing", "directory", "truncated-pth", "text-safetensors"],
)
def test_unreadable_weights_file(tmp_path: Path, make, what: str) -> None:
    f = make(tmp_path)
    with pytest.raises(WeightsError) as info:
        build_backbone(VIT, pretrained=False, weights=str(f))
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(f) in msg and VIT in msg and what in msg


def test_weights_that_do_not_fit_the_backbone(tmp_path: Path) -> None:
    state = build_backbone(VIT, pretrained=False).vit.state_dict()
    state = dict(state)
    del state["cls_token"], state["blocks.0.attn.qkv.weight"]
    state["extra.weight"] = torch.zeros(3)
    state["pos_embed"] = torch.zeros(1, 197, 7)
    state["head.weight"] = torch.zeros(1000, 192)  # an ImageNet classifier: ignored
    f = tmp_path / "other.pth"
    torch.save(state, f)
    with pytest.raises(WeightsError) as info:
        build_backbone(VIT, pretrained=False, weights=str(f))
    msg = str(info.value)
    assert f"weights file {f} does not fit backbone {VIT}" in msg
    assert "2 missing key(s) (e.g. cls_token, blocks.0.attn.qkv.weight)" in msg
    assert "1 unexpected key(s) (e.g. extra.weight)" in msg
    assert "1 shape mismatch(es) (e.g. pos_embed: file (1, 197, 7) vs backbone (1, 197, 192))" in msg


def test_weights_file_loads_when_it_fits(tmp_path: Path) -> None:
    ref = build_backbone(VIT, pretrained=False)
    state = {k: v + 1.0 if v.is_floating_point() else v for k, v in ref.vit.state_dict().items()}
    f = tmp_path / "good.pth"
    torch.save({"state_dict": state}, f)
    bb = build_backbone(VIT, pretrained=False, weights=str(f))
    assert bb.weights_id == f"file:{f}"
    assert torch.equal(bb.vit.cls_token, state["cls_token"])


def test_mobilenet_weights_mismatch_names_backbone(tmp_path: Path) -> None:
    f = tmp_path / "vit.pth"
    torch.save(build_backbone(VIT, pretrained=False).vit.state_dict(), f)
    with pytest.raises(WeightsError, match=f"weights file {f} does not fit backbone mobilenet_v2"):
        build_backbone("mobilenet_v2", pretrained=False, weights=str(f))


def _offline_vit_message(t0: float, info: pytest.ExceptionInfo[WeightsError], cache: Path) -> str:
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, f"took {elapsed:.1f} s"
    msg = str(info.value)
    assert msg.startswith(f"backbone {VIT}: ")
    assert "--weights FILE" in msg and "--config mobilenet_cpu" in msg and VIT_REPO in msg
    assert str(cache / f"models--{VIT_REPO.replace('/', '--')}" / "snapshots") in msg
    return msg


def test_offline_vit_preset_fails_fast(empty_caches: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once, anywhere
    t0 = time.perf_counter()
    with pytest.raises(WeightsError) as info:
        build_backbone(VIT, pretrained=True)
    msg = _offline_vit_message(t0, info, empty_caches)
    assert "127.0.0.1:9 is unreachable" in msg


def test_hf_hub_offline_vit_preset_fails_fast(empty_caches: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(WeightsError) as info:
        build_backbone(VIT, pretrained=True)
    assert "HF_HUB_OFFLINE is set" in _offline_vit_message(t0, info, empty_caches)


def test_vit_preset_on_this_offline_machine(empty_caches: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    if hub_unreachable_reason("https://huggingface.co") is None:
        pytest.skip("huggingface.co is reachable: this test is about offline machines")
    t0 = time.perf_counter()
    with pytest.raises(WeightsError) as info:
        build_backbone(VIT, pretrained=True)
    _offline_vit_message(t0, info, empty_caches)


def test_vit_preset_uses_hub_cache_without_network(
    empty_caches: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache path the offline message names is the one that works."""
    from safetensors.torch import save_file

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    ref = build_backbone(VIT, pretrained=False)
    state = {k: (v * 0.5).contiguous() for k, v in ref.vit.state_dict().items()}
    state["head.weight"] = torch.zeros(1000, 192)
    state["head.bias"] = torch.zeros(1000)
    folder = empty_caches / f"models--{VIT_REPO.replace('/', '--')}"
    (folder / "snapshots" / "abc123").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("abc123")
    save_file(state, str(folder / "snapshots" / "abc123" / "model.safetensors"))
    bb = build_backbone(VIT, pretrained=True)
    assert bb.weights_id == "timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    assert torch.equal(bb.vit.pos_embed, state["pos_embed"])


def test_a_webp_image_counts_its_decoder_in_the_pixel_budget(tmp_path: Path) -> None:
    """PIL's WebP decoder holds more per pixel than the budgets declare for one: a WebP pixel counts as
    :data:`proteus.images.PIXEL_WEIGHT` pixels of them, before decoding, wherever an image is checked."""
    from proteus.images import PIXEL_WEIGHT, budget_pixels, check_image_file, image_info

    webp, png = tmp_path / "a.webp", tmp_path / "a.png"
    Image.new("RGB", (1000, 1000), (90, 120, 30)).save(webp, format="WEBP")
    Image.new("RGB", (1000, 1000), (90, 120, 30)).save(png)
    counted = budget_pixels("WEBP", 1000, 1000)
    assert counted == round(1_000_000 * PIXEL_WEIGHT["WEBP"]) > 1_000_000
    with open(webp, "rb") as f:
        assert image_info(f, "a.webp").budget_pixels == counted
    assert open_image(png, max_pixels=counted - 1).size == (1000, 1000)
    check_image_file(png, max_pixels=counted - 1)
    for check in (open_image, check_image_file):
        with pytest.raises(ImageTooLargeError, match=f"which a WEBP image counts as {counted / 1e6:.1f}"):
            check(webp, max_pixels=counted - 1)
    assert open_image(webp, max_pixels=counted).size == (1000, 1000)


_DECODE_PEAK = """
import resource, sys
from proteus.images import open_image
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
open_image(sys.argv[1], max_pixels=int(sys.argv[2]))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
def test_a_webp_image_at_the_budget_decodes_within_its_bytes(tmp_path: Path) -> None:
    """A WebP image as large as the pixel budget lets it be decodes within the bytes the budget declares per
    pixel (:data:`proteus.budgets.IMAGE_BYTES_PER_PIXEL`, plus a fixed 32 MiB): at 24 megapixels, where
    counting its pixels once (a 24-megapixel WebP: 16 bytes a pixel) passes that bound by ~40 MiB."""
    from proteus.budgets import IMAGE_BYTES_PER_PIXEL
    from proteus.images import PIXEL_WEIGHT

    budget = 24_000_000
    side = int((budget / PIXEL_WEIGHT["WEBP"]) ** 0.5)
    path = tmp_path / "big.webp"
    Image.new("RGB", (side, side), (90, 120, 30)).save(path, format="WEBP")
    argv = [sys.executable, "-c", _DECODE_PEAK, str(path), str(budget)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    cost = int(out.stdout.split()[-1])
    assert cost <= IMAGE_BYTES_PER_PIXEL * budget + (32 << 20), cost >> 20
