"""The checkpoint's own preprocessing: pixels equal (not close) to transformers' and timm's, and decoding."""

import json

import numpy as np
import pytest
import torch

from tests.checkpoints import hf_model, image, save_hf, save_timm, timm_model, write_bad_files
from vit_triton import from_pretrained
from vit_triton.data import Preprocess, UnreadableImage, load_image

# (height, width) of the inputs: larger and smaller than the outputs, odd, square, very wide.
SIZES = [(64, 80), (31, 29), (40, 40), (17, 100), (300, 251)]
IMAGENET = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])

HF_PROCESSORS = {
    "vit-bilinear": ("ViTImageProcessor", dict(size={"height": 40, "width": 40})),
    "vit-bicubic-no-normalize": ("ViTImageProcessor", dict(size={"height": 33, "width": 37}, resample=3,
                                                           do_normalize=False)),
    "deit-crop": ("DeiTImageProcessor", dict(size={"height": 45, "width": 45},
                                             crop_size={"height": 32, "width": 32}, **IMAGENET)),
    "deit-shortest-edge-bilinear": ("DeiTImageProcessor", dict(size={"shortest_edge": 36}, resample=2,
                                                               crop_size={"height": 32, "width": 31})),
    "deit-crop-pads": ("DeiTImageProcessor", dict(size={"shortest_edge": 26}, crop_size={"height": 33, "width": 31})),
    "vit-nearest-no-rescale": ("ViTImageProcessor", dict(size={"height": 24, "width": 24}, resample=0,
                                                         do_rescale=False)),
    "clip": ("CLIPImageProcessor", dict(size={"shortest_edge": 36}, crop_size={"height": 36, "width": 36})),
    "bit-dinov2": ("BitImageProcessor", dict(size={"shortest_edge": 40}, crop_size={"height": 35, "width": 35},
                                             **IMAGENET)),
    "siglip": ("SiglipImageProcessor", dict(size={"height": 38, "width": 38})),
    "beit": ("BeitImageProcessor", dict(size={"height": 36, "width": 34})),
}


def hf_processor(case, directory):
    """(transformers' processor, ours) for an HF_PROCESSORS case, saved to and read from `directory`."""
    import transformers

    cls, kw = HF_PROCESSORS[case]
    getattr(transformers, cls)(**kw).save_pretrained(directory)
    theirs = transformers.AutoImageProcessor.from_pretrained(directory)  # what a user of transformers gets
    return theirs, Preprocess.from_hf(json.loads((directory / "preprocessor_config.json").read_text()))


@pytest.mark.parametrize("case", HF_PROCESSORS)
def test_equal_to_transformers_image_processor(case, tmp_path):
    theirs, ours = hf_processor(case, tmp_path)
    for seed, (h, w) in enumerate(SIZES):
        img = image(seed, h, w)
        want = theirs(img, return_tensors="pt")["pixel_values"][0]
        got = ours(img)
        assert got.dtype == torch.float32 and got.shape == want.shape == (3, *ours.size)
        assert torch.equal(got, want), f"{case} {h}x{w}: max difference {(got - want).abs().max()}"


@pytest.mark.parametrize("architecture, model_type", [("BeitModel", "beit"),
                                                       ("Data2VecVisionModel", "data2vec-vision")])
def test_a_checkpoint_without_its_processor_gets_transformers_default(architecture, model_type, tmp_path):
    # what AutoImageProcessor gives the model type without a preprocessor_config.json: its class's defaults
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES[model_type]
    getattr(transformers, names["torchvision"] if isinstance(names, dict) else names)().save_pretrained(tmp_path)
    want = Preprocess.from_hf(json.loads((tmp_path / "preprocessor_config.json").read_text()))
    assert Preprocess.from_hf({}, architecture, 224) == want


def test_dinov3_processor_within_a_uint8_step(tmp_path):
    # transformers' DINOv3 processor resizes the rescaled float image; ours resizes uint8 first (rounded, in
    # torchvision's fixed point), as for the others
    import transformers

    transformers.DINOv3ViTImageProcessor(size={"height": 40, "width": 24}).save_pretrained(tmp_path)
    theirs = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    ours = Preprocess.from_hf(json.loads((tmp_path / "preprocessor_config.json").read_text()))
    assert ours == Preprocess.from_hf({}, "DINOv3ViTModel", 224)._hf_at((40, 24))   # the defaults, resized
    bound = 1 / 255 / min(ours.std)
    worst = 0.0
    for seed, (h, w) in enumerate(SIZES):
        img = image(seed, h, w)
        want = theirs(img, return_tensors="pt")["pixel_values"][0]
        got = ours(img)
        assert got.shape == want.shape == (3, 40, 24)
        worst = max(worst, (got - want).abs().max().item())
    assert 0 < worst <= bound, (worst, bound)


TIMM_CFGS = {
    "bicubic-0.9": dict(input_size=(3, 32, 32), interpolation="bicubic", crop_pct=0.9, mean=(0.5,) * 3,
                        std=(0.5,) * 3),
    "bilinear-squash": dict(input_size=(3, 32, 32), interpolation="bilinear", crop_pct=0.875, crop_mode="squash"),
    "crop_pct-1": dict(input_size=(3, 24, 24), interpolation="bicubic", crop_pct=1.0),
    "lanczos-padded": dict(input_size=(3, 24, 24), interpolation="lanczos", crop_pct=1.2),
    "defaults": dict(input_size=(3, 24, 24)),
    # Non-square: a center crop after the image is scaled to just cover size / crop_pct (aspect kept), also
    # where both sides round to one scale size; squashed.
    "center-24x40": dict(input_size=(3, 24, 40), interpolation="bicubic", crop_pct=0.9),
    "center-40x24-bilinear": dict(input_size=(3, 40, 24), interpolation="bilinear", crop_pct=0.875),
    "center-same-scale": dict(input_size=(3, 24, 25), crop_pct=2.0),
    "squash-32x16": dict(input_size=(3, 32, 16), crop_pct=0.95, crop_mode="squash"),
}


def timm_eval_transform(**resolve_args):
    """timm's eval transform for resolve_data_config(**resolve_args), with the resize's interpolation that timm
    1.0.31 fixed: before it, the non-square center crop's ResizeKeepRatio ignored the configured one (bilinear)."""
    import timm
    from packaging.version import Version
    from timm.data import create_transform, resolve_data_config
    from timm.data.transforms import ResizeKeepRatio, str_to_interp_mode

    config = resolve_data_config(**resolve_args)
    transform = create_transform(**config)
    if Version(timm.__version__) < Version("1.0.31"):
        for t in transform.transforms:
            if isinstance(t, ResizeKeepRatio):
                t.interpolation = str_to_interp_mode(config["interpolation"])
    return transform


@pytest.mark.parametrize("case", TIMM_CFGS)
def test_equal_to_timm_eval_transform(case):
    cfg = TIMM_CFGS[case]
    theirs = timm_eval_transform(pretrained_cfg=cfg)
    ours = Preprocess.from_timm(cfg)
    for seed, (h, w) in enumerate(SIZES + [(25, 25)]):
        img = image(seed, h, w)
        got = ours(img)
        assert got.shape == (3, *cfg["input_size"][1:]) and torch.equal(got, theirs(img)), f"{case} {h}x{w}"


def coordinates(height: int, width: int) -> torch.Tensor:
    """int32 [2, height, width]: each pixel's row and column, counted from 1 (0 is a padded pixel's)."""
    return torch.stack(torch.meshgrid(torch.arange(1, height + 1), torch.arange(1, width + 1), indexing="ij")).int()


def window(geometry, size: tuple[int, int]) -> torch.Tensor:
    """coordinates() of the resized image's pixels that a geometry's window of `size` keeps, 0 outside the image."""
    rows = torch.arange(size[0]) + geometry.top + 1
    cols = torch.arange(size[1]) + geometry.left + 1
    inside = ((rows >= 1) & (rows <= geometry.height))[:, None] & ((cols >= 1) & (cols <= geometry.width))[None, :]
    return torch.stack([torch.where(inside, rows[:, None], 0), torch.where(inside, cols[None, :], 0)]).int()


@pytest.mark.parametrize("case", TIMM_CFGS)
def test_geometry_is_timms_resize_and_center_crop(case):
    resize, crop = timm_eval_transform(pretrained_cfg=TIMM_CFGS[case]).transforms[:2]
    ours = Preprocess.from_timm(TIMM_CFGS[case])
    for seed, (h, w) in enumerate(SIZES + [(25, 25)]):
        g = ours.geometry(h, w)
        assert resize(image(seed, h, w)).size == (g.width, g.height)
        assert torch.equal(crop(coordinates(g.height, g.width)), window(g, ours.size)), f"{case} {h}x{w}: {g}"


@pytest.mark.parametrize("case", HF_PROCESSORS)
def test_geometry_is_transformers_resize_and_center_crop(case, tmp_path):
    theirs, ours = hf_processor(case, tmp_path)
    for seed, (h, w) in enumerate(SIZES):
        g = ours.geometry(h, w)
        pixels = torch.from_numpy(np.array(image(seed, h, w))).permute(2, 0, 1)
        assert theirs.resize(pixels, theirs.size, resample=theirs.resample).shape[-2:] == (g.height, g.width)
        kept = coordinates(g.height, g.width)
        if theirs.do_center_crop:
            kept = theirs.center_crop(kept, theirs.crop_size)
        assert torch.equal(kept, window(g, ours.size)), f"{case} {h}x{w}: {g}"


@pytest.mark.parametrize("size", [32, (24, 40)])
@pytest.mark.parametrize("preprocess_cfg", [dict(), dict(mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bilinear"),
                                            dict(resize_mode="squash")])
def test_equal_to_open_clip_eval_transform(preprocess_cfg, size):
    open_clip = pytest.importorskip("open_clip")   # a test extra; the GPU machine's image lacks it

    theirs = open_clip.image_transform(size, is_train=False, **preprocess_cfg)
    ours = Preprocess.from_open_clip(preprocess_cfg, size)
    for seed, (h, w) in enumerate(SIZES):
        img = image(seed, h, w)
        want, got = theirs(img), ours(img)
        assert got.shape == want.shape == (3, *ours.size)
        assert torch.equal(got, want), f"{preprocess_cfg} {h}x{w}: max difference {(got - want).abs().max()}"


def test_normalize_on_a_uint8_batch_equals_per_image():
    pre = Preprocess.from_timm(TIMM_CFGS["bicubic-0.9"])
    imgs = [image(i, 50, 41 + i) for i in range(3)]
    batch = pre.normalize(torch.stack([pre.resize_crop(i) for i in imgs]))
    assert torch.equal(batch, torch.stack([pre(i) for i in imgs]))


def test_for_model_uses_the_checkpoints_preprocessing(tmp_path):
    import transformers

    model = hf_model("DeiTForImageClassification", num_labels=2)
    directory = save_hf(model, tmp_path / "hf", processor=dict(size={"height": 36, "width": 36},
                                                                crop_size={"height": 32, "width": 32}))
    pre = Preprocess.for_model(from_pretrained(directory, device="cpu"))
    img = image(0, 50, 70)
    theirs = transformers.AutoImageProcessor.from_pretrained(directory)
    assert torch.equal(pre(img), theirs(img, return_tensors="pt")["pixel_values"][0])

    directory = save_timm(timm_model("vit_tiny_patch16_224", embed_dim=64, num_heads=2), tmp_path / "timm")
    pre = Preprocess.for_model(from_pretrained(directory, device="cpu"))
    # as timm.create_model("hf-hub:...") resolves it: the pretrained_cfg of the checkpoint's config.json
    pretrained_cfg = json.loads((directory / "config.json").read_text())["pretrained_cfg"]
    theirs = timm_eval_transform(pretrained_cfg=pretrained_cfg)
    assert torch.equal(pre(img), theirs(img))


def test_for_model_gives_aimv2_its_processors_pixels(tmp_path):
    # transformers' AIMv2 checkpoints come with a CLIPImageProcessor (AutoImageProcessor's class for aimv2 too: the
    # shorter side resized, bicubic, a center crop, OpenAI's mean and std); timm's with their pretrained_cfg
    import transformers

    imgs = [image(seed, h, w) for seed, (h, w) in enumerate(SIZES)]
    directory = save_hf(hf_model("Aimv2VisionModel"), tmp_path / "hf",
                        processor=dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}))
    pre = Preprocess.for_model(from_pretrained(directory, device="cpu"))
    theirs = transformers.AutoImageProcessor.from_pretrained(directory)
    assert type(theirs).__name__ == "CLIPImageProcessor" and pre.mean == tuple(theirs.image_mean)
    for img in imgs:
        assert torch.equal(pre(img), theirs(img, return_tensors="pt")["pixel_values"][0])

    model = timm_model("aimv2_large_patch14_224", embed_dim=64, num_heads=2, mlp_ratio=1.5)
    directory = save_timm(model, tmp_path / "timm")
    pre = Preprocess.for_model(from_pretrained(directory, device="cpu"))
    theirs = timm_eval_transform(pretrained_cfg=json.loads((directory / "config.json").read_text())["pretrained_cfg"])
    assert pre.crop == (32, 32) and pre.resize == 32   # crop_pct 1.0
    for img in imgs:
        assert torch.equal(pre(img), theirs(img))


@pytest.mark.parametrize("size", [(24, 40), 16], ids=["24x40", "16"])
def test_for_model_at_another_image_size(size, tmp_path):
    # What the libraries make at that size: timm's transform for input_size (3, H, W); a transformers processor
    # called with size {"height", "width"}, or with a crop, crop_size and the size scaled as the crop (36/32).
    import transformers

    height, width = (size, size) if isinstance(size, int) else size
    imgs = [image(seed, h, w) for seed, (h, w) in enumerate(SIZES)]
    vit = save_hf(hf_model("ViTModel"), tmp_path / "vit", processor=dict(size={"height": 32, "width": 32}))
    deit = save_hf(hf_model("DeiTModel"), tmp_path / "deit", processor=dict(size={"height": 36, "width": 36},
                                                                           crop_size={"height": 32, "width": 32}))
    calls = {vit: dict(size={"height": height, "width": width}),
             deit: dict(size={"height": height * 36 // 32, "width": width * 36 // 32},
                        crop_size={"height": height, "width": width})}
    for directory, kw in calls.items():
        pre = Preprocess.for_model(from_pretrained(directory, device="cpu"), image_size=size)
        theirs = transformers.AutoImageProcessor.from_pretrained(directory)
        for img in imgs:
            want = theirs(img, return_tensors="pt", **kw)["pixel_values"][0]
            assert want.shape == (3, height, width) and torch.equal(pre(img), want), directory.name

    directory = save_timm(timm_model("vit_tiny_patch16_224", embed_dim=64, num_heads=2), tmp_path / "timm",
                          pretrained_cfg=dict(input_size=[3, 32, 32], crop_pct=0.9, interpolation="bicubic"))
    pre = Preprocess.for_model(from_pretrained(directory, device="cpu"), image_size=size)
    pretrained_cfg = json.loads((directory / "config.json").read_text())["pretrained_cfg"]
    theirs = timm_eval_transform(args={"input_size": (3, height, width)}, pretrained_cfg=pretrained_cfg)
    for img in imgs:
        assert pre(img).shape == (3, height, width) and torch.equal(pre(img), theirs(img))


def test_for_model_at_a_size_the_model_does_not_take(tmp_path):
    model = from_pretrained(save_hf(hf_model("ViTModel"), tmp_path), device="cpu")
    with pytest.raises(ValueError, match="at least the patch size 8, got 24x6"):
        Preprocess.for_model(model, image_size=(24, 6))


def test_without_preprocessor_config_the_processor_defaults_at_the_model_size(tmp_path):
    model = from_pretrained(save_hf(hf_model("ViTModel"), tmp_path), device="cpu")
    pre = Preprocess.for_model(model)
    assert (pre.resize, pre.crop, pre.resample, pre.mean) == ((32, 32), None, "bilinear", (0.5, 0.5, 0.5))


def test_preprocessing_for_another_size_is_an_error(tmp_path):
    directory = save_hf(hf_model("ViTModel"), tmp_path, processor=dict(size={"height": 224, "width": 224}))
    with pytest.raises(ValueError, match="gives 224x224 images but the model takes 32x32"):
        Preprocess.for_model(from_pretrained(directory, device="cpu"))


@pytest.mark.parametrize("config, match", [
    ({"image_processor_type": "ConvNextImageProcessor"}, r"unsupported image processor 'ConvNextImageProcessor'; "
                                                          r"supported: ViTImageProcessor, DeiTImageProcessor, CLIP"),
    ({"resample": 1}, r"unsupported resample 1 .*supported: 0 \(nearest\), 2 \(bilinear\), 3 \(bicubic\)"),
    ({"size": {"shortest_edge": 40}}, "must give a fixed image size"),
    ({"size": {"longest_edge": 40}}, "unsupported image processor size"),
])
def test_unsupported_transformers_preprocessing(config, match):
    with pytest.raises(ValueError, match=match):
        Preprocess.from_hf(config)


def test_unsupported_timm_preprocessing():
    with pytest.raises(ValueError, match="unsupported timm crop_mode 'border'; supported: center, squash"):
        Preprocess.from_timm({"crop_mode": "border"})
    with pytest.raises(ValueError, match="unsupported timm resample 'random'"):
        Preprocess.from_timm({"interpolation": "random"})


def test_feature_extractor_configs_from_the_hub_read_as_their_processor():
    # google/vit-base-patch16-224's and facebook/deit-base-distilled-patch16-224's files, verbatim
    vit = Preprocess.from_hf({"do_normalize": True, "do_resize": True, "feature_extractor_type": "ViTFeatureExtractor",
                              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": 224})
    assert (vit.resize, vit.crop, vit.rescale) == ((224, 224), None, 1 / 255)
    deit = Preprocess.from_hf({"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
                               "feature_extractor_type": "DeiTFeatureExtractor", "resample": 3, "size": 256,
                               "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]})
    assert (deit.resize, deit.crop, deit.resample) == ((256, 256), (224, 224), "bicubic")


def test_load_image_reasons(tmp_path):
    for path, reason in write_bad_files(tmp_path).items():
        with pytest.raises(UnreadableImage, match=reason):
            load_image(path)
    with pytest.raises(UnreadableImage, match="cannot read file: No such file or directory"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(UnreadableImage, match="cannot read file: Is a directory"):
        load_image(tmp_path)
    image(1, 20, 30, mode="RGBA").save(tmp_path / "alpha.png")
    image(2, 20, 30, mode="L").save(tmp_path / "gray.png")
    assert load_image(tmp_path / "alpha.png").mode == load_image(tmp_path / "gray.png").mode == "RGB"
    assert load_image(tmp_path / "gray.png", mode="L").size == (30, 20)


@pytest.mark.parametrize("orientation", [6, 8])
def test_load_image_turns_a_photo_upright_by_its_exif_orientation(orientation, tmp_path):
    # A phone stores a portrait photo landscape, with the turn to apply in EXIF; transformers' load_image applies it.
    from PIL import Image, ImageOps

    from vit_triton.data.files import ImageFiles

    exif = Image.Exif()
    exif[0x0112] = orientation
    image(3, 20, 34).save(tmp_path / "photo.jpg", "JPEG", exif=exif)
    turn = {6: Image.Transpose.ROTATE_270, 8: Image.Transpose.ROTATE_90}[orientation]
    with Image.open(tmp_path / "photo.jpg") as stored:
        want = ImageOps.exif_transpose(stored).convert("RGB")
        turned = stored.convert("RGB").transpose(turn)
    assert want.size == turned.size == (20, 34) and want.tobytes() == turned.tobytes()
    got = load_image(tmp_path / "photo.jpg")
    assert got.size == (20, 34) and got.tobytes() == want.tobytes()
    assert load_image(tmp_path / "photo.jpg", mode="L").tobytes() == want.convert("L").tobytes()
    # the path embed and classify decode through
    pre = Preprocess.from_timm(TIMM_CFGS["defaults"])
    _, pixels, reason = ImageFiles([str(tmp_path / "photo.jpg")], pre)[0]
    assert reason is None and torch.equal(pixels, pre.resize_crop(want))
