"""`vit-triton finetune` end to end through the interpreter, on tiny models (2 blocks, width 32, 16-pixel images) and
a few dozen images: the three input layouts, the validation split, unreadable files listed, every bad input a usage
error, the outputs (a model its library loads, the curves), a linear probe that leaves the backbone as it was, a
resume after kill -9 that ends on the uninterrupted run's weights bit for bit, and two torchrun processes (gloo)
that train what one does; and scripts/digits_imagefolder.py, with a short run that learns the digits."""

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import hf_model, image, save_hf, save_timm, timm_model, write_bad_files, write_shard
from tests.numerics import DEVICE, FP32_TOL, rel_err
from tests.scripts import load_script, run_script
from vit_triton import from_pretrained
from vit_triton.cli import main
from vit_triton.data.labeled import class_names, list_sources, scan_source, split_validation

CLASSES = ["ant", "bee", "cat"]
PER_CLASS = 5
# float32 on a GPU too, so that runs compare bit for bit; small steps, a line of metrics each
RUN = ["--batch-size", "4", "--workers", "0", "--no-progress", "--log-interval", "1", "--lr", "1e-3",
       "--precision", "fp32", "--warmup-epochs", "0"]
TINY = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=1)


def _images(root: Path) -> dict[str, list[Path]]:
    """PER_CLASS images of assorted sizes of each class, in ImageFolder's layout, PNG and JPEG."""
    found = {}
    for c, name in enumerate(CLASSES):
        folder = root / name
        folder.mkdir(parents=True)
        found[name] = []
        for i in range(PER_CLASS):
            path = folder / f"{i}.{'png' if i % 2 else 'jpg'}"
            image(10 * c + i, 16 + 3 * i, 18 + 2 * c).save(path)
            found[name].append(path)
    return found


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A timm and a transformers checkpoint, a folder of CLASSES with bad files among them, the same images as a
    CSV and as tar shards; tests run with it as the current directory."""
    root = tmp_path_factory.mktemp("finetune")
    save_timm(timm_model("vit_tiny_patch16_224", num_classes=0, **TINY), root / "timm")
    # its classifier already has the classes the folder has: a linear probe trains it
    labels = dict(enumerate(CLASSES))
    save_hf(hf_model("ViTForImageClassification", hidden_size=32, num_attention_heads=1, intermediate_size=64,
                     image_size=16, patch_size=4, num_labels=3, id2label=labels,
                     label2id={v: k for k, v in labels.items()}),
            root / "hf", processor=dict(size={"height": 16, "width": 16}))
    images = _images(root / "imgs")
    bad = write_bad_files(root / "imgs" / "cat")
    (root / "imgs" / "README.txt").write_text("not in a class folder\n")
    (root / "bad.json").write_text(json.dumps({str(p.relative_to(root)): r for p, r in bad.items()}))
    rows = ["path,label"] + [f"imgs/{c}/{p.name},{c}" for c, paths in images.items() for p in paths]
    (root / "train.csv").write_text("\n".join(rows + ["imgs/cat/gone.png,cat"]) + "\n")
    for k in range(2):   # samples labelled by .cls (a name) and by .json, in two shards
        members = []
        for c, paths in images.items():
            for i, p in enumerate(paths[k::2]):
                key = f"{c}{k}{i:02d}"
                members.append((f"{key}{p.suffix}", p.read_bytes()))
                label = (f"{key}.cls", c.encode()) if i % 2 else (f"{key}.json", json.dumps({"label": c}).encode())
                members.append(label)
        write_shard(root / "shards" / f"{k:05d}.tar", members)
    return root


@pytest.fixture(autouse=True)
def in_work(work, monkeypatch):
    monkeypatch.chdir(work)


def _main(*argv: str) -> tuple[int, str, str]:
    """main(argv): (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


def _finetune(*args: str) -> tuple[int, str, str]:
    return _main("finetune", *args)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return from_pretrained(directory, device="cpu", dtype=torch.float32).state_dict()


def _labelled(spec: str) -> tuple[list[tuple[str, bytes]], list[str]]:
    """((label, bytes) of each readable image of INPUT spec, in order; the names of those skipped)."""
    listing = list_sources(spec)
    found, skipped = [], [name for name, _ in listing.skipped]
    for source in listing.sources:
        samples, left = scan_source(source)
        found += [(s.label, s.read()) for s in samples]
        skipped += [name for name, _ in left]
    return found, skipped


# -- the data --

def test_the_three_layouts_give_the_same_labelled_images(work):
    folder, skipped = _labelled("imgs")
    bad = json.loads((work / "bad.json").read_text())
    assert sorted(skipped) == sorted(["imgs/README.txt", *bad])
    assert [label for label, _ in folder] == [c for c in CLASSES for _ in range(PER_CLASS)]
    csv, csv_skipped = _labelled("train.csv")
    assert csv == folder and csv_skipped == ["imgs/cat/gone.png"]
    shards, shard_skipped = _labelled("shards")
    assert sorted(shards) == sorted(folder) and not shard_skipped   # read back from the shards by their offsets


def test_a_sample_without_a_label_and_a_damaged_shard_are_listed(tmp_path):
    png = io.BytesIO()
    image(1, 20, 20).save(png, "PNG")
    data = write_shard(tmp_path / "a.tar", [("x.png", png.getvalue()), ("x.cls", b"7"), ("y.png", png.getvalue()),
                                            ("y.txt", b"caption"), ("z.png", png.getvalue()),
                                            ("z.json", b'{"cls": 3}')])
    x_members = 512 + -(-len(png.getvalue()) // 512) * 512 + 1024   # tar headers and data in 512-byte blocks
    (tmp_path / "b.tar").write_bytes(data[:x_members + 512 + 100])    # x's members whole, then y.png cut
    samples, skipped = scan_source(list_sources(str(tmp_path / "a.tar")).sources[0])
    assert [(s.name.split("#")[1], s.label) for s in samples] == [("x.png", "7"), ("z.png", "3")]
    assert skipped == [(f"{tmp_path}/a.tar#y.png", "no label: no y.cls, nor a y.json with 'label' or 'cls'")]
    samples, skipped = scan_source(list_sources(str(tmp_path / "b.tar")).sources[0])
    assert [s.label for s in samples] == ["7"]
    assert skipped[0][0] == f"{tmp_path}/b.tar" and skipped[0][1].startswith("truncated or corrupt tar after 2 image")


def test_classes_sort_as_imagefolder_and_integer_labels_as_numbers():
    assert class_names(["10", "2", "1"], folders=True) == ["1", "10", "2"]
    assert class_names(["10", "2", "1"]) == ["1", "2", "10"]
    assert class_names(["b", "10", "a"]) == ["10", "a", "b"]


def test_the_validation_split_holds_out_a_fraction_of_each_class():
    found = list_sources("imgs").sources
    samples = [s for source in found for s in scan_source(source)[0]]
    train, val = split_validation(samples, 0.3, seed=1)
    assert sorted(s.label for s in val) == sorted(CLASSES * 2)   # round(0.3 * 5) of each
    assert sorted(train + val, key=samples.index) == samples and not set(train) & set(val)
    assert split_validation(samples, 0.3, seed=1) == (train, val) != split_validation(samples, 0.3, seed=2)
    few = [samples[0], *samples[PER_CLASS:PER_CLASS + 2]]   # a class of one image keeps it for training
    assert [s.label for s in split_validation(few, 0.5, 0)[1]] == ["bee"]


# -- bad input --

def _bad_inputs(work: Path) -> None:
    (work / "empty" / "a").mkdir(parents=True, exist_ok=True)
    (work / "empty" / "b").mkdir(exist_ok=True)
    image(0, 20, 20).save(work / "empty" / "a" / "0.png")
    (work / "one" / "a").mkdir(parents=True, exist_ok=True)
    for i in range(3):
        image(i, 20, 20).save(work / "one" / "a" / f"{i}.png")
    (work / "ghost.csv").write_text("imgs/ant/0.jpg,ant\nimgs/bee/1.png,bee\nimgs/cat/empty.jpg,ghost\n"
                                    "nowhere.png,ghost\n")
    (work / "malformed.csv").write_text("path,label\nimgs/ant/0.jpg,ant\nimgs/bee/1.png\n")
    (work / "stranger.csv").write_text("imgs/ant/0.jpg,ant\nimgs/bee/1.png,wasp\n")
    (work / "full").mkdir(exist_ok=True)
    (work / "full" / "notes.txt").write_text("mine\n")


@pytest.mark.parametrize("args, match", [
    (["empty"], r"TRAIN empty: class folder empty/b holds no files"),
    (["one"], r"TRAIN one: found 1 class \(a\): a classifier needs at least 2 classes"),
    (["ghost.csv"], r"TRAIN ghost.csv: class 'ghost' has no readable image; 2 input\(s\) skipped, listed in "
                    r".*/out/train.skipped.tsv"),
    (["malformed.csv"], r"TRAIN malformed.csv, line 3: expected a path and a label \(path,label\), got "
                        r"\['imgs/bee/1.png'\]"),
    (["imgs", "--val", "stranger.csv"], "VAL stranger.csv: classes that TRAIN does not have: wasp"),
    (["imgs/ant/*.jpg"], "TRAIN imgs/ant/\\*.jpg names image files without labels: expected a folder of class "
                         "subfolders"),
    (["nowhere"], "TRAIN nowhere: no such file or directory, and not a glob pattern"),
    (["imgs", "--image-size", "3"], "--image-size 3x3: image height and width must be at least the patch size 4"),
    (["imgs", "--batch-size", "40"], "--batch-size 40 is more than the 12 training images"),
    (["imgs", "--val-split", "1.5"], r"--val-split must be in \[0, 1\), got 1.5"),
    (["imgs", "--scale", "0.5", "0.2"], "--scale must be MIN MAX with 0 < MIN <= MAX <= 1, got"),
    (["imgs", "--opt", "nosuch"], "--opt nosuch: not an optimizer of timm.optim"),
    (["imgs", "--output", "full"], "--output full is not an empty folder; choose another --output"),
    (["imgs", "--resume"], "--resume: .*/out holds no fine-tuning run to continue"),
])
def test_bad_input_exits_2_naming_the_problem(args, match, work, tmp_path):
    _bad_inputs(work)
    out = ["--output", str(tmp_path / "out")] if "--output" not in args else []
    status, _, err = _finetune(args[0], "--model", "timm", *out, *RUN, *args[1:])
    assert status == 2 and err.startswith("vit-triton finetune: error: ") and re.search(match, err), err


def test_a_run_whose_scan_failed_may_be_run_again_into_its_output(work, tmp_path):
    """The scan's lists of skipped files are all it leaves, and they do not make OUT_DIR another run's."""
    _bad_inputs(work)
    for _ in range(2):
        status, _, err = _finetune("ghost.csv", "--model", "timm", "--output", str(tmp_path / "out"), *RUN)
        assert status == 2 and "class 'ghost' has no readable image" in err, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train.skipped.tsv"]


def test_a_missing_extra_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm.optim", None)   # import fails as if timm were not installed
    status, _, err = _finetune("imgs", "--model", "timm", "--output", "never")
    assert status == 1 and err == ('vit-triton finetune: error: vit-triton finetune needs timm, which is not installed: '
                                   'pip install "vit-triton[train]"\n')


def test_val_and_val_split_together_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["finetune", "imgs", "--model", "timm", "--output", "x", "--val", "imgs", "--val-split", "0.2"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


# -- training --

KILLED = ["imgs", "--model", "timm", *RUN, "--epochs", "2", "--val-split", "0.2", "--checkpoint-every", "1",
          "--drop-path", "0.2", "--drop", "0.1"]


@pytest.fixture(scope="module")
def trained(work) -> tuple[Path, str]:
    """(OUT_DIR, stderr) of an uninterrupted run of KILLED's: 12 training images (the bad files skipped, 3 held out)
    in 3 steps an epoch, 2 epochs, drop path and dropout on."""
    cwd = os.getcwd()
    os.chdir(work)
    try:
        status, out, err = _finetune(*KILLED, "--output", "trained")
    finally:
        os.chdir(cwd)
    assert status == 0, err
    assert "vit-triton finetune: done, 2 epoch(s), 6 steps on 12 images of 3 classes; validation top-1" in out
    return work / "trained", err


@pytest.mark.slow
def test_outputs_model_curves_and_skipped_files(trained, work):
    out, err = trained
    assert "12 training images of 3 classes, validation: 3 images held out of TRAIN (--val-split 0.2); 5 input(s) " \
           "skipped" in err
    assert "vit_tiny_patch16_224 with a new head of 3 classes" in err
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["epoch"], r["step"]) for r in lines] == [
        ("step", 1, 1), ("step", 1, 2), ("step", 1, 3), ("epoch", 1, 3),
        ("step", 2, 4), ("step", 2, 5), ("step", 2, 6), ("epoch", 2, 6)]
    for r in lines:
        values = [r[k] for k in ("loss", "lr", "images_per_s")] if r["kind"] == "step" else \
            [r[k] for k in ("train_loss", "val_loss", "val_top1", "seconds")]
        assert all(np.isfinite(v) and v >= 0 for v in values), r
    assert lines[0]["lr"] == 1e-3 > lines[-2]["lr"]   # no warm-up: the peak, then the cosine's descent
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    skipped = dict(line.split("\t") for line in (out / "train.skipped.tsv").read_text().splitlines())
    expected = {**json.loads((work / "bad.json").read_text()), "path": "reason",
                "imgs/README.txt": "not in a class folder"}
    assert skipped.keys() == expected.keys() and all(skipped[k].startswith(expected[k]) for k in skipped), skipped
    assert len(json.loads((out / "training" / "data.json").read_text())["train"]) == 12


@pytest.mark.slow
def test_the_result_loads_in_vit_triton_and_timm_with_its_labels(trained, work):
    timm = pytest.importorskip("timm")
    out, _ = trained
    ours = from_pretrained(out, device=DEVICE, dtype=torch.float32)
    assert ours.checkpoint.id2label == dict(enumerate(CLASSES))
    theirs = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert theirs.num_classes == 3
    pixels = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(ours(pixels.to(DEVICE)).cpu(), theirs(pixels)) < 1e-4
    before = _weights(work / "timm")
    after = ours.state_dict()
    assert not torch.equal(before["blocks.0.qkv.weight"], after["blocks.0.qkv.weight"].cpu())
    status, printed, _ = _main("classify", str(work / "imgs" / "bee" / "0.jpg"), "--model", str(out))
    assert status == 0 and printed.splitlines()[1].split()[1] in CLASSES


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="one process on a GPU replays a CUDA graph of each step")
def test_the_graphed_steps_train_what_eager_ones_do(trained, work):
    # KILLED has drop path and dropout on: the replays draw their numbers from the generator as eager steps do
    status, _, err = _finetune(*KILLED, "--output", "eager", "--no-cuda-graph")
    assert status == 0, err
    graphed, eager = _weights(trained[0]), _weights(work / "eager")
    assert graphed.keys() == eager.keys() and all(torch.equal(graphed[k], eager[k]) for k in graphed)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux: the run's DataLoader worker dies with it")
def test_resume_after_kill_9_ends_on_the_uninterrupted_runs_weights(trained, work):
    """The killed run reads with a worker process where the uninterrupted one read in its own: each image's
    augmentation is drawn from its own seed, so that makes no difference either."""
    out, _ = trained
    cmd = [sys.executable, "-m", "vit_triton", "finetune", *KILLED, "--output", "killed", "--workers", "1"]
    run = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoint = work / "killed" / "training" / "checkpoint.pt"
    deadline = time.monotonic() + 600
    while run.poll() is None and time.monotonic() < deadline:   # killed once step 2's checkpoint is there
        if checkpoint.exists() and torch.load(checkpoint, weights_only=True)["step"] >= 2:
            break
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    _, stderr = run.communicate()
    assert run.returncode == -signal.SIGKILL, stderr
    step = torch.load(checkpoint, weights_only=True)["step"]
    assert 2 <= step < 6 and not (work / "killed" / "model.safetensors").exists()

    status, _, err = _finetune(*KILLED, "--output", "killed", "--resume")
    assert status == 0, err
    assert f"resuming killed at step {step} of 6" in err
    ours, reference = _weights(work / "killed"), _weights(out)
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    lines = (work / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 3, 4, 5, 6, 6]   # no step twice
    # once finished, the same command says so, with the last epoch's numbers; another one is refused, naming what
    # differs
    status, printed, err = _finetune(*KILLED, "--output", "killed", "--resume")
    assert status == 0 and "the run in killed is finished: writing its model again" in err
    top1 = json.loads(lines[-1])["val_top1"]
    assert f"validation top-1 {100 * top1:.2f}%" in printed
    status, _, err = _finetune(*KILLED, "--output", "killed", "--resume", "--epochs", "3")
    assert status == 2 and "the run in killed was started with other settings: epochs 2 there, 3 now" in err
    status, _, err = _finetune(*KILLED, "--output", "killed")
    assert status == 2 and "--output killed holds a fine-tuning run: --resume continues it" in err


def test_a_linear_probe_trains_the_head_alone_from_a_csv(work):
    """The transformers classifier already has the folder's classes: its head is kept and trained, the rest stays
    bit for bit; transformers loads the result."""
    transformers = pytest.importorskip("transformers")
    status, _, err = _finetune("train.csv", "--model", "hf", "--output", "probe", "--linear-probe", *RUN,
                                 "--epochs", "1", "--val-split", "0.2", "--lr", "1e-2")
    assert status == 0, err
    assert "with its own head (the same classes), 99 of" in err and "(linear probe)" in err
    before, after = _weights(work / "hf"), _weights(work / "probe")
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == ["head.bias", "head.weight"]
    theirs = transformers.AutoModelForImageClassification.from_pretrained(work / "probe").eval()
    assert theirs.config.id2label == dict(enumerate(CLASSES))
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    ours = from_pretrained(work / "probe", device=DEVICE, dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(ours(pixels.to(DEVICE)).cpu(), theirs(pixels).logits) < 1e-4


@pytest.mark.slow
@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="two ranks on CUDA need two devices")
def test_two_torchrun_processes_train_what_one_does_from_shards(work):
    """Each process takes half of every batch of 4; gradients are accumulated over 2 batches (no_sync) and then
    averaged by DDP. SGD: its update is the gradient itself, so the weights differ by float32 rounding only (the
    two halves' gradients are summed apart, then added); AdamW's normalised steps would magnify that where a
    gradient is near zero. Equality is not to be had: the sums' order differs."""
    args = ["shards", "--model", "timm", *RUN, "--epochs", "1", "--val-split", "0.2", "--opt", "sgd", "--lr", "0.1",
            "--drop-path", "0", "--grad-accum-steps", "2", "--checkpoint-every", "0"]
    status, _, err = _finetune(*args, "--output", "one-process")
    assert status == 0, err
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "vit_triton", "finetune",
                             *args, "--output", "two-processes"], cwd=work, env=env, capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("vit-triton finetune: done") == 1 and "batch 4 (2 a process) x 2 accumulated" in \
        result.stderr
    one, two = _weights(work / "one-process"), _weights(work / "two-processes")
    errors = {k: rel_err(two[k], one[k]) for k in one if one[k].norm() > 0}
    assert max(errors.values()) < 1e-6, errors
    metrics = [json.loads((work / d / "metrics.jsonl").read_text().splitlines()[-1])
               for d in ("one-process", "two-processes")]
    assert metrics[0]["val_top1"] == metrics[1]["val_top1"]
    assert metrics[0]["train_loss"] == pytest.approx(metrics[1]["train_loss"], rel=1e-6)


# -- the digits demo --

def test_digits_imagefolder_writes_the_split(tmp_path):
    result = run_script("digits_imagefolder.py", str(tmp_path), "--per-class", "5", "--size", "12", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote 40 training and 10 validation images of 10 digits under {tmp_path}/\n"
    for split, count in (("train", 4), ("val", 1)):
        folders = sorted((tmp_path / split).iterdir())
        assert [f.name for f in folders] == [str(d) for d in range(10)]
        assert all(len(list(f.iterdir())) == count for f in folders)
    from PIL import Image

    one = Image.open(next((tmp_path / "val" / "7").iterdir()))
    assert one.size == (12, 12) and one.mode == "L"
    again = tmp_path / "again"
    load_script("digits_imagefolder.py").write_digits(again, size=12, seed=3, per_class=5)
    assert sorted(p.name for p in (again / "val").rglob("*.png")) == sorted(p.name for p in (tmp_path / "val").rglob(
        "*.png"))


@pytest.mark.slow
def test_a_tiny_vit_learns_the_digits(tmp_path):
    """From random weights, 160 training images (16 a digit, 8 x 8 pixels) in 3 epochs of 20 steps: about 80-90% of
    the 40 validation images right (PyTorch's own ViT, trained by this pipeline, reaches 80-90% over seeds), 10% by
    chance. Average pooling of the 4 patch tokens (no class token) learns fastest at this size; no augmentation:
    a crop or a flip of 8 pixels changes the digit."""
    timm = pytest.importorskip("timm")
    assert run_script("digits_imagefolder.py", str(tmp_path / "digits"), "--size", "8", "--per-class", "20",
                      "--seed", "0").returncode == 0
    torch.manual_seed(0)
    args = dict(img_size=8, patch_size=4, embed_dim=32, depth=2, num_heads=1, mlp_ratio=2, num_classes=0,
                global_pool="avg", class_token=False)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **args)
    model.create_args = args
    save_timm(model, tmp_path / "vit")
    status, _, err = _finetune(str(tmp_path / "digits" / "train"), "--val", str(tmp_path / "digits" / "val"),
                                 "--model", str(tmp_path / "vit"), "--output", str(tmp_path / "run"), "--epochs", "3",
                                 "--batch-size", "8", "--lr", "1e-2", "--warmup-epochs", "0", "--scale", "1", "1",
                                 "--hflip", "0", "--smoothing", "0", "--drop-path", "0", "--layer-decay", "1",
                                 "--weight-decay", "0.01", "--workers", "0", "--precision", "fp32", "--no-progress")
    assert status == 0, err
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["val_top1"] >= 0.7, err


@pytest.mark.slow
def test_digits_vs_timm_trains_both_on_the_same_batches(tmp_path):
    """scripts/digits_vs_timm.py, tiny and without stochastic depth: `vit-triton finetune` and timm's model run
    through the same recipe from the same weights on the same batches, so their epochs' training and validation
    losses agree to float32 precision; both runs' metrics, the summary and the plot are written."""
    result = run_script("digits_vs_timm.py", str(tmp_path), "--per-class", "4", "--size", "8", "--epochs", "2",
                        "--batch-size", "8", "--depth", "1", "--width", "32", "--drop-path", "0", "--device",
                        DEVICE.type, "--precision", "fp32")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [[r for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "epoch"] for run in ("vit-triton", "timm")]
    assert [len(r) for r in runs] == [2, 2]
    for ours, theirs in zip(*runs):
        for key in ("train_loss", "val_loss"):
            assert abs(ours[key] - theirs[key]) <= FP32_TOL * theirs[key], (key, ours, theirs)
    summary = json.loads((tmp_path / "summary.json").read_text())
    for name, records in zip(("vit-triton", "timm"), runs):
        assert summary[name] == {"val_top1": [r["val_top1"] for r in records],
                                 "epoch_seconds": [r["seconds"] for r in records]}
    assert (tmp_path / "curves.png").stat().st_size > 0
