"""`vit-triton embed` end to end through the interpreter: complete output equal to direct model calls,
bad files listed, resume after kill -9, and a 2-process torchrun (gloo) equal to one process."""

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

from tests.checkpoints import hf_model, save_hf, save_timm, timm_model, write_bad_files, write_images
from tests.numerics import DEVICE, assert_close
from vit_triton import from_pretrained
from vit_triton.cli import main
from vit_triton.data import Preprocess, load_image
from vit_triton.data.files import list_inputs
from vit_triton.pipelines.embed import _device as embed_device, embedding_fn
from vit_triton.pipelines.store import UsageError
from vit_triton.runtime import CUDAGraphRunner

pq = pytest.importorskip("pyarrow.parquet")

# Small chunks and batches, so that a dozen images make several of each (and a partial last one).
# float32 on a GPU too (whose default is bf16), so that outputs compare with direct float32 calls
RUN = ["--chunk-size", "4", "--batch-size", "3", "--num-workers", "1", "--no-progress", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A checkpoint and a folder of 14 images and 4 bad files; tests run with it as the current directory."""
    root = tmp_path_factory.mktemp("embed")
    save_hf(hf_model("DeiTForImageClassificationWithTeacher", num_labels=3), root / "deit",
            processor=dict(size={"height": 36, "width": 36}, crop_size={"height": 32, "width": 32}))
    write_images(root / "imgs", 14)
    write_bad_files(root / "imgs" / "bad")
    return root


@pytest.fixture(autouse=True)
def in_work(work, monkeypatch):
    monkeypatch.chdir(work)


def _embed(*args: str) -> int:
    return main(["embed", *args])


def _direct(model_dir: str, paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pooled, tokens) of `paths` from the model called directly, in one batch."""
    model = from_pretrained(model_dir, device=DEVICE, dtype=torch.float32)   # where `embed` runs it
    pre = Preprocess.for_model(model)
    pixels = torch.stack([pre(load_image(p)) for p in paths]).to(DEVICE)
    with torch.no_grad():
        features = model.forward_features(pixels)
        return model.forward_head(features, pre_logits=True).cpu(), features.cpu()


def _read_parquet(path) -> tuple[list[str], np.ndarray]:
    table = pq.read_table(path)
    embedding = np.array(table["embedding"].combine_chunks().flatten()).reshape(table.num_rows, -1)
    return table["path"].to_pylist(), embedding


@pytest.fixture(scope="module")
def single(work) -> Path:
    """One uninterrupted single-process run into single.parquet: the output others must equal."""
    cwd = os.getcwd()
    os.chdir(work)
    try:
        assert _embed("imgs", "--model", "deit", "--output", "single.parquet", *RUN) == 0
    finally:
        os.chdir(cwd)
    return work / "single.parquet"


def test_output_is_complete_and_equal_to_direct_model_calls(single, capsys):
    paths, embedding = _read_parquet(single)
    good = [p for p in list_inputs("imgs") if "/bad/" not in p]
    assert paths == good  # every good image once, in input order
    pooled, _ = _direct("deit", good)
    assert_close(torch.from_numpy(embedding), pooled.double(), torch.float32)
    skipped = Path("single.skipped.tsv").read_text().splitlines()
    assert skipped[0] == "path\treason"
    assert sorted(line.split("\t")[0] for line in skipped[1:]) == sorted(
        f"imgs/bad/{n}" for n in ("corrupt.png", "empty.jpg", "notes.txt", "truncated.jpg"))
    assert "imgs/bad/empty.jpg\tempty file" in skipped
    assert not Path("single.parquet.partial").exists()

    # run again: recognised as finished, nothing redone
    assert _embed("imgs", "--model", "deit", "--output", "single.parquet", *RUN) == 0
    out = capsys.readouterr()
    assert "already complete" in out.err
    assert "vit-triton embed: done 14, skipped 4 (listed in single.skipped.tsv); this run: nothing to do" in out.out


def test_npy_tokens_normalized_from_a_list_file_with_a_timm_checkpoint(tmp_path):
    ref = timm_model("vit_tiny_patch16_224", embed_dim=64, num_heads=2, reg_tokens=1, global_pool="avg",
                     class_token=False, fc_norm=True, num_classes=0)
    save_timm(ref, tmp_path / "timm")
    listed = [str(p) for p in sorted(Path("imgs").glob("*.png"))] + ["imgs/missing.png"]
    (tmp_path / "list.txt").write_text("\n".join(listed) + "\n")
    out = tmp_path / "emb.npy"
    assert _embed(str(tmp_path / "list.txt"), "--model", str(tmp_path / "timm"), "--output", str(out),
                  "--tokens", "--normalize", "--output-dtype", "float16", *RUN) == 0
    index = json.loads((tmp_path / "emb.paths.json").read_text())
    assert index["paths"] == listed[:-1] and index["done"] == len(listed) - 1 and index["skipped"] == 1
    embedding, tokens = np.load(out), np.load(tmp_path / "emb.tokens.npy")
    assert embedding.dtype == tokens.dtype == np.float16
    assert embedding.shape == (len(listed) - 1, 64) and tokens.shape == (len(listed) - 1, 1 + 16, 64)
    pooled, features = _direct(str(tmp_path / "timm"), listed[:-1])
    want = torch.nn.functional.normalize(pooled, dim=-1)
    assert np.allclose(np.linalg.norm(embedding.astype(np.float32), axis=1), 1, atol=2e-3)
    torch.testing.assert_close(torch.from_numpy(embedding).float(), want, atol=2e-3, rtol=0)
    torch.testing.assert_close(torch.from_numpy(tokens).float(), features, atol=2e-3, rtol=2e-3)
    assert "imgs/missing.png\tcannot read file: No such file or directory" in (tmp_path / "emb.skipped.tsv").read_text()



@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_graphed_batches_equal_eager_ones():
    # On a GPU, embed replays full batches from a CUDA graph of embedding_fn (normalize, forward, pooling,
    # L2 norm, cast) and runs short ones eagerly: both must write the same bits.
    model = from_pretrained("deit", device=DEVICE, dtype=torch.bfloat16)
    fn = embedding_fn(model, Preprocess.for_model(model), normalize=True, tokens=True, output_dtype=torch.float16)
    graphed = CUDAGraphRunner(model, forward=fn)
    pixels = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8, device=DEVICE)
    with torch.inference_mode():
        eager = fn(pixels)
        first = graphed(pixels)   # captured, then replayed
        first[0].add_(1)          # its own memory: the next replay leaves it alone
        again = graphed(pixels)
    assert len(eager) == len(first) == len(again) == 2
    for e, a in zip(eager, again):
        assert torch.equal(a, e)
    assert torch.equal(first[0], eager[0] + 1) and torch.equal(first[1], eager[1])

def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "vit_triton", *args]


def test_resume_after_kill_9_has_no_duplicates_and_no_gaps(single, work, capsys):
    # The single run's inputs and, last, a FIFO: decoding blocks on it, so the run stops for sure
    # in the middle (chunks 0-2 written; chunk 3's last batch waits on the next), however fast it is.
    fifo = work / "blocks.fifo"
    os.mkfifo(fifo)
    (work / "list.txt").write_text("\n".join(list_inputs("imgs") + [fifo.name]) + "\n")
    cmd = ["embed", "list.txt", "--model", "deit", "--output", "killed.parquet", *RUN]
    run = subprocess.Popen(_cli(*cmd), cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial = work / "killed.parquet.partial"
    deadline = time.monotonic() + 120
    while len(list(partial.glob("chunk-*.json"))) < 3 and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    run.send_signal(signal.SIGKILL)
    run.wait()
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # release the orphaned worker reading it
    fifo.unlink()
    assert run.returncode == -signal.SIGKILL, run.stderr.read().decode()
    assert len(list(partial.glob("chunk-*.json"))) == 3 and not (work / "killed.parquet").exists()

    assert main(cmd) == 0
    out = capsys.readouterr()
    assert "resuming killed.parquet: 3 of 5 chunks already done" in out.err
    assert "this run: 7 images" in out.out  # chunks 3 and 4, the FIFO's path now missing
    assert pq.read_table(work / "killed.parquet").equals(pq.read_table(single))
    skipped = (work / "killed.skipped.tsv").read_text()
    assert skipped == (work / "single.skipped.tsv").read_text() + "blocks.fifo\tcannot read file: No such file or directory\n"


@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="two ranks on CUDA need two devices")
def test_torchrun_two_processes_write_what_one_does(single, work):
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "vit_triton", "embed",
                             "imgs", "--model", "deit", "--output", "two.parquet", *RUN],
                            cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("vit-triton embed: done 14, skipped 4") == 1  # rank 0 alone reports
    assert pq.read_table(work / "two.parquet").equals(pq.read_table(single))
    assert (work / "two.skipped.tsv").read_text() == (work / "single.skipped.tsv").read_text()


def test_a_rank_without_its_gpu_is_named(monkeypatch):
    # Under torchrun each process takes cuda:LOCAL_RANK; more processes than GPUs is a usage error, said as
    # such before CUDA answers "invalid device ordinal".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError, match=r"LOCAL_RANK 1 needs cuda:1, but this machine has 1 CUDA device\(s\): run at "
                                         r"most that many processes a node \(torchrun --nproc-per-node\) or pass --device"):
        embed_device(None, 1)
    assert embed_device(None, 0) == torch.device("cuda", 0)
    assert embed_device("cpu", 1) == torch.device("cpu")


@pytest.mark.parametrize("args, match", [
    (["nowhere", "--output", "x.parquet"], "INPUT nowhere: no such file or directory"),
    (["imgs", "--output", "x.csv"], "--output must end in .parquet or .npy"),
    (["imgs", "--output", "x.parquet", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["imgs/*.tiff", "--output", "x.parquet"], r"INPUT imgs/\*.tiff: names no files"),
])
def test_usage_errors_exit_2(args, match, capsys):
    assert _embed(*args[:1], "--model", "deit", *args[1:]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-triton embed: error: ") and re.search(match, err), err


def test_missing_model_exits_2(capsys):
    assert _embed("imgs", "--model", "./no/such/model", "--output", "x.parquet") == 2
    assert "no such file or directory: ./no/such/model" in capsys.readouterr().err


def test_outputs_from_other_settings_or_other_programs_are_not_touched(single, work, capsys):
    assert _embed("imgs", "--model", "deit", "--output", "single.parquet", "--normalize", *RUN) == 2
    assert "was written with other settings (normalize: False then, True now)" in capsys.readouterr().err
    (work / "foreign.parquet").write_bytes(b"PAR1 not ours")
    assert _embed("imgs", "--model", "deit", "--output", "foreign.parquet", *RUN) == 2
    assert "was not written by vit-triton embed" in capsys.readouterr().err
    assert (work / "foreign.parquet").read_bytes() == b"PAR1 not ours"


def test_list_inputs(tmp_path):
    (tmp_path / "a" / ".hidden").mkdir(parents=True)
    for name in ("b.jpg", "a/c.png", "a/.d.png", "a/.hidden/e.png", "a/notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    root = str(tmp_path)
    assert list_inputs(root) == [f"{root}/b.jpg", f"{root}/a/c.png", f"{root}/a/notes.txt"]
    assert list_inputs(f"{root}/**/*.png") == [f"{root}/a/c.png"]
    assert list_inputs(f"{root}/b.jpg") == [f"{root}/b.jpg"]
    (tmp_path / "list.txt").write_text("one.jpg\n\n two.png\r\n")
    assert list_inputs(f"{root}/list.txt") == ["one.jpg", " two.png"]
    with pytest.raises(FileNotFoundError, match="names no files"):
        list_inputs(f"{root}/*.gif")
