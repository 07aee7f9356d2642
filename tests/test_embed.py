"""`vit-triton embed` end to end through the interpreter: complete output equal to direct model calls,
bad files listed, resume after kill -9 (which takes the DataLoader workers with it), one run at a time
into an output, re-runs that add INPUT's new files, and a 2-process torchrun (gloo) equal to one process;
for folders of images and for tar shards, local and through fsspec (memory://)."""

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

from PIL import Image

from tests.checkpoints import hf_model, save_hf, save_timm, timm_model, write_bad_files, write_images, write_shard
from tests.numerics import DEVICE, assert_close
from tests.scripts import load_script
from vit_triton import embed_images, from_pretrained
from vit_triton.cli import main
from vit_triton.data import Preprocess, UnreadableImage, decode_image, load_image
from vit_triton.data.decode import WIDE_QUEUES, widen_hardware_queues
from vit_triton.data.sources import expand_braces, list_inputs
from vit_triton.pipelines.embed import embedding_fn, resolve_device as embed_device
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


def _direct(model_dir: str, paths: list[str], image_size=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pooled, tokens) of `paths` from the model called directly, in one batch."""
    model = from_pretrained(model_dir, device=DEVICE, dtype=torch.float32)   # where `embed` runs it
    pre = Preprocess.for_model(model, image_size)
    pixels = torch.stack([pre(load_image(p)) for p in paths]).to(DEVICE)
    with torch.no_grad():
        features = model.forward_features(pixels)
        return model.forward_head(features, pre_logits=True).cpu(), features.cpu()


def _read_parquet(path) -> tuple[list[str], np.ndarray]:
    table = pq.read_table(path)
    embedding = np.array(table["embedding"].combine_chunks().flatten()).reshape(table.num_rows, -1)
    return table["path"].to_pylist(), embedding


def _embed_in(work: Path, spec: str, output: str) -> Path:
    cwd = os.getcwd()
    os.chdir(work)
    try:
        assert _embed(spec, "--model", "deit", "--output", output, *RUN) == 0
    finally:
        os.chdir(cwd)
    return work / output


@pytest.fixture(scope="module")
def single(work) -> Path:
    """One uninterrupted single-process run into single.parquet: the output others must equal."""
    return _embed_in(work, "imgs", "single.parquet")


SHARDS = "shards/{00000..00002}.tar"


@pytest.fixture(scope="module")
def shards(work) -> tuple[list[tuple[str, str]], list[str]]:
    """Three tar shards of the folder's 14 good images as img2dataset writes them (KEY.jpg or KEY.png beside
    KEY.txt and KEY.json; a _stats.json beside each shard), with a corrupt and an empty image, the last shard cut
    in its 4th image: ([(row name, the folder's image it holds)], the skipped-files lines to expect)."""
    good = [os.path.relpath(p, work) for p in list_inputs(str(work / "imgs")) if "/bad/" not in p]
    corrupt = (work / "imgs/bad/corrupt.png").read_bytes()
    layout = [good[0:3] + ["corrupt.png"] + good[3:6], good[6:10] + ["empty.jpg"], good[10:14]]
    rows, skipped = [], []
    for s, images in enumerate(layout):
        shard, members = f"shards/{s:05d}.tar", []
        for i, image in enumerate(images):
            key, data = f"{s:05d}{i:04d}", {"corrupt.png": corrupt, "empty.jpg": b""}.get(image)
            name = key + os.path.splitext(image)[1]
            members += [(name, (work / image).read_bytes() if data is None else data),
                        (f"{key}.txt", image.encode()), (f"{key}.json", json.dumps({"key": key}).encode())]
            (rows if data is None else skipped).append((f"{shard}#{name}", image))
        data = write_shard(work / shard, members)
        (work / f"shards/{s:05d}_stats.json").write_text("{}")
        if s == 2:  # cut in the data of its 4th image
            (work / shard).write_bytes(data[:data.index(members[9][1]) + 100])
            rows = rows[:-1]
    with pytest.raises(UnreadableImage) as reason:
        decode_image(corrupt)
    lines = [f"{skipped[0][0]}\t{reason.value}", f"{skipped[1][0]}\tempty file",
             "shards/00002.tar\ttruncated or corrupt tar after 3 image(s): unexpected end of data"]
    return rows, lines


@pytest.fixture(scope="module")
def shard_single(work, shards) -> Path:
    """One uninterrupted single-process run over the shards, named by a brace range: the output others must equal."""
    return _embed_in(work, SHARDS, "shards.parquet")


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


def test_shards_give_what_the_folder_of_their_images_does(single, shard_single, shards, capsys):
    rows, skipped = shards
    paths, embedding = _read_parquet(shard_single)
    assert paths == [name for name, _ in rows]  # SHARD#MEMBER, in shard order then archive order
    folder_paths, folder_embedding = _read_parquet(single)
    images = [folder_paths.index(image) for _, image in rows]
    # other batches than the folder run's: the last bits may differ
    assert_close(torch.from_numpy(embedding), torch.from_numpy(folder_embedding[images]), torch.float32)
    assert Path("shards.skipped.tsv").read_text().splitlines() == ["path\treason", *skipped]

    assert _embed(SHARDS, "--model", "deit", "--output", "shards.parquet", *RUN) == 0
    out = capsys.readouterr()
    assert "already complete" in out.err and "done 13, skipped 3" in out.out
    # the folder of the shards (their _stats.json files left out) names the same shards
    assert _embed("shards", "--model", "deit", "--output", "shard-folder.parquet", *RUN) == 0
    assert pq.read_table("shard-folder.parquet").equals(pq.read_table(shard_single))
    assert Path("shard-folder.skipped.tsv").read_text() == Path("shards.skipped.tsv").read_text()


def test_a_folder_through_fsspec_gives_what_the_local_one_does(single, work, memory, tmp_path):
    fs, root = memory
    for path in list_inputs("imgs"):
        fs.pipe(f"{root}/{path}", (work / path).read_bytes())
    url = f"memory://{root}"
    assert _embed(f"{url}/imgs", "--model", "deit", "--output", str(tmp_path / "m.parquet"), *RUN) == 0
    paths, embedding = _read_parquet(tmp_path / "m.parquet")
    folder_paths, folder_embedding = _read_parquet(single)
    assert paths == [f"{url}/{p}" for p in folder_paths]
    assert np.array_equal(embedding, folder_embedding)  # the same chunks and batches
    assert (tmp_path / "m.skipped.tsv").read_text() == Path("single.skipped.tsv").read_text().replace(
        "imgs/", f"{url}/imgs/")


@pytest.mark.parametrize("output, options", [("m.parquet", []), ("m.npy", ["--tokens"])])
def test_shards_through_fsspec_and_a_shard_added_later(output, options, shard_single, shards, work, memory, tmp_path,
                                                       capsys):
    fs, root = memory
    url, out = f"memory://{root}", tmp_path / output
    for s in (0, 1):
        fs.pipe(f"{root}/0000{s}.tar", (work / f"shards/0000{s}.tar").read_bytes())
    cmd = [url, "--model", "deit", "--output", str(out), *options, *RUN]
    assert _embed(*cmd) == 0
    fs.pipe(f"{root}/00002.tar", (work / "shards/00002.tar").read_bytes())
    capsys.readouterr()
    assert _embed(*cmd) == 0
    logged = capsys.readouterr()
    assert f"1 file(s) new in INPUT since {out} was written: embedding them, to add after its 10 rows" in logged.err
    assert "done 13, skipped 3" in logged.out and "this run: 4 images" in logged.out  # 3 and the damage
    paths, embedding, tokens = _read_output(out)
    want_paths, want = _read_parquet(shard_single)
    assert paths == [p.replace("shards/", f"{url}/", 1) for p in want_paths]
    assert np.array_equal(embedding, want)  # a shard's batches are its own, whatever run reads it
    if tokens is not None:
        _, features = _direct("deit", [image for _, image in shards[0]])
        assert_close(torch.from_numpy(tokens), features.double(), torch.float32)
    assert out.with_name("m.skipped.tsv").read_text() == Path("shards.skipped.tsv").read_text().replace(
        "shards/", f"{url}/")

    assert _embed(*cmd) == 0  # nothing new now
    assert "already complete; nothing to do" in capsys.readouterr().err


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



def test_the_log_says_where_the_time_went(tmp_path, capsys):
    listed = [str(p) for p in sorted(Path("imgs").glob("*.png"))[:3]]
    (tmp_path / "list.txt").write_text("\n".join(listed) + "\n")
    started = time.perf_counter()
    assert _embed(str(tmp_path / "list.txt"), "--model", "deit", "--output", str(tmp_path / "e.parquet"), *RUN) == 0
    wall = time.perf_counter() - started
    err = capsys.readouterr().err
    assert sum(line.startswith("vit-triton embed: time: ") for line in err.splitlines()) == 1, err
    phases = load_script("embed_throughput.py").logged_phases(err)   # how the GPU's measurements read it
    assert list(phases) == ["imports", "device", "checkpoint", "decoder", "listing", "first batch", "embedding",
                            "merge"]
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) <= wall + 0.05 * len(phases)   # each rounded to 0.1 s


def test_another_image_size_with_tokens(tmp_path, capsys):
    import vit_triton

    paths = [str(p) for p in sorted(Path("imgs").glob("*.png"))][:4]
    (tmp_path / "list.txt").write_text("\n".join(paths) + "\n")
    out = tmp_path / "emb.npy"
    assert _embed(str(tmp_path / "list.txt"), "--model", "deit", "--output", str(out), "--tokens",
                  "--image-size", "16x40", *RUN) == 0
    pooled, features = _direct("deit", paths, (16, 40))
    assert features.shape == (4, 2 + 2 * 5, 64)
    assert_close(torch.from_numpy(np.load(out)), pooled.double(), torch.float32)
    assert_close(torch.from_numpy(np.load(tmp_path / "emb.tokens.npy")), features.double(), torch.float32)
    model = from_pretrained("deit", device=DEVICE, dtype=torch.float32)
    assert_close(vit_triton.embed_images(model, paths, image_size=(16, 40)), pooled.double(), torch.float32)

    capsys.readouterr()
    assert _embed(str(tmp_path / "list.txt"), "--model", "deit", "--output", str(out), "--tokens", *RUN) == 2
    assert "with other settings (image_size: [16, 40] then, None now)" in capsys.readouterr().err
    assert _embed("imgs", "--model", "deit", "--output", str(tmp_path / "x.npy"), "--image-size", "6", *RUN) == 2
    assert "--image-size 6x6: image height and width must be at least the patch size 8" in \
        capsys.readouterr().err


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


def _blocked_run(work: Path, name: str, inputs: list[str] | None = None, fifo_suffix: str = ".fifo",
                 done: int = 3) -> tuple[subprocess.Popen, list[str], Path]:
    """(process, command, FIFO) of a run into NAME.parquet over `inputs` (default: the single run's) and, last, a
    FIFO: reading blocks on it, so the run stops for sure in the middle (chunks 0 to done-1 written; chunk done's
    last batch waits on the next), however fast it is; returned once it got there."""
    fifo = work / f"{name}{fifo_suffix}"
    os.mkfifo(fifo)
    (work / f"{name}.txt").write_text("\n".join((inputs or list_inputs("imgs")) + [fifo.name]) + "\n")
    cmd = ["embed", f"{name}.txt", "--model", "deit", "--output", f"{name}.parquet", *RUN]
    run = subprocess.Popen(_cli(*cmd), cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = work / f"{name}.parquet.partial"
    deadline = time.monotonic() + 120
    while len(list(partial.glob("chunk-*.json"))) < done and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    if run.poll() is not None or len(list(partial.glob("chunk-*.json"))) != done:
        run.kill()
        pytest.fail(f"the run did not stop at chunk {done}: {run.communicate()}")
    return run, cmd, fifo


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent PID, start time) of a process, from /proc; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[19])


def _descendants(pid: int) -> dict[int, int]:
    """PID -> start time of every process below `pid` (its children, theirs, ...)."""
    stats = {int(p.name): _proc_stat(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    found, parents = {}, [pid]
    while parents:
        parent = parents.pop()
        for child, stat in stats.items():
            if stat is not None and stat[1] == parent and child not in found:
                found[child] = stat[2]
                parents.append(child)
    return found


def _still_running(processes: dict[int, int], seconds: float) -> list[int]:
    """Those of `processes` (PID -> start time) still running after waiting up to `seconds` for them to end."""
    deadline = time.monotonic() + seconds
    while True:
        running = [pid for pid, start in processes.items()
                   if (stat := _proc_stat(pid)) is not None and stat[0] != "Z" and stat[2] == start]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the run's processes in /proc")
@pytest.mark.parametrize("kind", ["images", "shards"])
def test_resume_after_kill_9_has_no_duplicates_and_no_gaps(kind, request, work, capsys):
    # the uninterrupted run; the inputs; the FIFO's suffix; chunks done when it blocks, of all; inputs still to do
    # (images: chunks 3 and 4, the FIFO's path now missing; shards: the cut shard's 3 images and its damage, and
    # the FIFO's path)
    single, inputs, suffix, done, chunks, to_do = {
        "images": ("single", list_inputs("imgs"), ".fifo", 3, 5, 7),
        "shards": ("shard_single", expand_braces(SHARDS), ".tar", 2, 4, 5),
    }[kind]
    single = request.getfixturevalue(single)
    name = f"killed-{kind}"
    run, cmd, fifo = _blocked_run(work, name, inputs, suffix, done)
    workers = _descendants(run.pid)  # its DataLoader worker, blocked on the FIFO
    assert workers
    run.send_signal(signal.SIGKILL)
    run.wait()
    left = _still_running(workers, 10)  # they end with their parent
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the killed run still running: {left}"
    fifo.unlink()
    assert run.returncode == -signal.SIGKILL, run.stderr.read()
    partial = work / f"{name}.parquet.partial"
    assert len(list(partial.glob("chunk-*.json"))) == done and not (work / f"{name}.parquet").exists()

    assert main(cmd) == 0
    out = capsys.readouterr()
    assert f"resuming {name}.parquet: {done} of {chunks} chunks already done" in out.err
    assert f"this run: {to_do} images" in out.out
    assert pq.read_table(work / f"{name}.parquet").equals(pq.read_table(single))
    skipped = (work / f"{name}.skipped.tsv").read_text()
    assert skipped == single.with_suffix(".skipped.tsv").read_text() + \
        f"{fifo.name}\tcannot read file: No such file or directory\n"


def test_a_second_run_into_an_output_being_written_is_refused(single, work):
    # Without the lock it would resume the first run's work: remove its temporary files, redo its chunks.
    first, cmd, fifo = _blocked_run(work, "locked")
    try:
        second = subprocess.run(_cli(*cmd), cwd=work, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        assert (f"vit-triton embed: error: another vit-triton embed run (PID {first.pid}) is writing locked.parquet: "
                f"it holds locked.parquet.lock; wait for it to end, or stop it") in second.stderr
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # lets the first run go on: an empty file
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()  # if the test failed
        fifo.unlink()
    assert first.returncode == 0, err
    assert "done 14, skipped 5" in out and "this run: 19 images" in out
    assert pq.read_table(work / "locked.parquet").equals(pq.read_table(single))
    skipped = (work / "locked.skipped.tsv").read_text()
    assert skipped == (work / "single.skipped.tsv").read_text() + "locked.fifo\tempty file\n"
    assert not (work / "locked.parquet.lock").exists() and not (work / "locked.parquet.partial").exists()


def _read_output(path: Path) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """(paths, embeddings, tokens or None) of a finished .parquet or .npy output."""
    if path.suffix == ".parquet":
        paths, embedding = _read_parquet(path)
        return paths, embedding, None
    stem = path.with_suffix("")
    tokens = Path(f"{stem}.tokens.npy")
    paths = json.loads(Path(f"{stem}.paths.json").read_text())["paths"]
    return paths, np.load(path), np.load(tokens) if tokens.exists() else None


@pytest.mark.parametrize("output, options", [("grown.parquet", []), ("grown.npy", ["--tokens"])])
def test_a_rerun_adds_the_new_inputs_and_names_the_removed_ones(output, options, tmp_path, capsys):
    folder = tmp_path / "photos"
    write_images(folder, 5)
    (folder / "notes.txt").write_text("not an image\n")
    cmd = [str(folder), "--model", "deit", "--output", str(tmp_path / output), *options, *RUN]
    assert _embed(*cmd) == 0
    old_paths, old_embedding, old_tokens = _read_output(tmp_path / output)
    assert len(old_paths) == 5

    added = [str(p) for p in write_images(folder, 3, start=5)] + [str(folder / "zz.txt")]
    (folder / "zz.txt").write_text("not an image either\n")
    (folder / "img001.png").unlink()
    capsys.readouterr()
    assert _embed(*cmd) == 0
    out = capsys.readouterr()
    assert (f"4 file(s) new in INPUT since {tmp_path / output} was written: embedding them, to add after its 5 "
            f"rows") in out.err
    assert (f"warning: 1 input(s) of {tmp_path / output} are no longer in INPUT (the first: {folder}/img001.png): "
            f"they stay in it; pass --overwrite to embed INPUT as it is now") in out.err
    assert "done 8, skipped 2" in out.out and "this run: 4 images" in out.out
    # the old rows as they were, then the new ones in input order
    paths, embedding, tokens = _read_output(tmp_path / output)
    new = sorted(added[:3], key=list_inputs(str(folder)).index)
    assert paths == old_paths + new
    assert np.array_equal(embedding[:5], old_embedding)
    pooled, features = _direct("deit", new)
    assert_close(torch.from_numpy(embedding[5:]), pooled.double(), torch.float32)
    if old_tokens is not None:
        assert np.array_equal(tokens[:5], old_tokens)
        assert_close(torch.from_numpy(tokens[5:]), features.double(), torch.float32)
    skipped = (tmp_path / output).with_name("grown.skipped.tsv").read_text().splitlines()
    assert skipped == ["path\treason", f"{folder}/notes.txt\tnot an image (unrecognised format)",
                       f"{folder}/zz.txt\tnot an image (unrecognised format)"]
    assert not (tmp_path / f"{output}.partial").exists()

    assert _embed(*cmd) == 0  # nothing new now
    out = capsys.readouterr()
    assert "already complete; nothing to do" in out.err and "no longer in INPUT" in out.err
    assert "done 8, skipped 2" in out.out


def test_the_same_input_spelled_otherwise_is_the_same(single, work, capsys):
    for spelling in ("imgs/", "./imgs", str(work / "imgs"), f"{work}/./imgs/"):
        assert _embed(spelling, "--model", "deit", "--output", "single.parquet", *RUN) == 0, capsys.readouterr().err
        err = capsys.readouterr().err
        assert "already complete; nothing to do" in err and "INPUT" not in err, spelling


@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="two ranks on CUDA need two devices")
@pytest.mark.parametrize("spec, reference, counts", [("imgs", "single", "done 14, skipped 4"),
                                                     (SHARDS, "shard_single", "done 13, skipped 3")])
def test_torchrun_two_processes_write_what_one_does(spec, reference, counts, request, work):
    single = request.getfixturevalue(reference)
    two = work / f"two-{single.name}"
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "vit_triton", "embed",
                             spec, "--model", "deit", "--output", two.name, *RUN],
                            cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"vit-triton embed: {counts}") == 1  # rank 0 alone reports
    assert pq.read_table(two).equals(pq.read_table(single))
    assert two.with_suffix(".skipped.tsv").read_text() == single.with_suffix(".skipped.tsv").read_text()


def test_hardware_queues_are_widened_only_before_cuda_starts_and_a_set_value_is_kept(monkeypatch):
    # CUDA reads CUDA_DEVICE_MAX_CONNECTIONS when it starts; with its default 8 queues nvJPEG waits out the forwards.
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not widen_hardware_queues() and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert widen_hardware_queues() and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == str(WIDE_QUEUES) == "32"
    for value, wide in (("8", False), ("1", False), ("31", False), ("32", True), ("many", False)):
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
        assert widen_hardware_queues() is wide and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == value


def test_the_cli_widens_the_queues_before_it_asks_cuda_anything(monkeypatch):
    class Asked(Exception):
        pass

    seen = []

    def is_available():
        seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        raise Asked

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    with pytest.raises(Asked):
        _embed("imgs", "--model", "deit", "--output", "x.parquet")
    assert seen == ["32"]


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


@pytest.mark.parametrize("cuda_devices, device, has", [
    (0, "cuda", "cpu (it has no CUDA device)"), (0, "cuda:0", "cpu (it has no CUDA device)"),
    (0, "tpu", "cpu (it has no CUDA device)"), (2, "mps", "cpu, cuda, cuda:0, cuda:1"),
    (2, "cuda:2", "cpu, cuda, cuda:0, cuda:1"),
])
def test_a_device_this_machine_lacks_is_a_usage_error_naming_those_it_has(cuda_devices, device, has, monkeypatch):
    # torch's own errors came later: "Expected a torch.device with a specified index" for cuda on a machine
    # without one, the list of every device type torch knows for tpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    with pytest.raises(UsageError, match=f"^--device {device}: expected a device of this machine: {re.escape(has)}$"):
        embed_device(device, 0)
    assert embed_device("cpu", 0) == torch.device("cpu")
    if cuda_devices:
        # "cuda" is the current device, by its index: torch.cuda.set_device refuses a device without one
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        assert embed_device("cuda:1", 0) == embed_device("cuda", 0) == torch.device("cuda", 1)


def test_the_model_spelled_otherwise_is_the_same(single, work, monkeypatch, capsys):
    for spelling in ("./deit/", str(work / "deit")):
        assert _embed("imgs", "--model", spelling, "--output", "single.parquet", *RUN) == 0, capsys.readouterr().err
        assert "already complete; nothing to do" in capsys.readouterr().err, spelling
    # its rows' paths are relative to the folder it was started in: from another one they would name other files
    monkeypatch.chdir(work / "imgs")
    assert _embed(".", "--model", "../deit", "--output", "../single.parquet", *RUN) == 2
    assert (f"../single.parquet names its inputs by paths relative to {work}, where it was started: run the command "
            f"from there") in capsys.readouterr().err


def test_an_output_path_that_cannot_be_a_file_exits_2(work, capsys):
    for output in ("imgs/img000.jpg/e.parquet", "imgs/img000.jpg/deeper/e.npy"):
        assert _embed("imgs", "--model", "deit", "--output", output) == 2
        assert (f"vit-triton embed: error: --output {output}: imgs/img000.jpg is a file, not a directory"
                in capsys.readouterr().err)
    (work / "folder.parquet").mkdir()
    assert _embed("imgs", "--model", "deit", "--output", "folder.parquet") == 2
    assert ("--output folder.parquet is a directory: expected a file's path, ending in .parquet or .npy"
            in capsys.readouterr().err)


@pytest.mark.parametrize("args, match", [
    (["nowhere", "--output", "x.parquet"], "INPUT nowhere: no such file or directory"),
    (["imgs", "--output", "x.csv"], "--output must end in .parquet or .npy"),
    (["imgs/*.tiff", "--output", "x.parquet"], r"INPUT imgs/\*.tiff: names no files"),
    (["shards/{00005..00009}.tar", "--output", "x.parquet"],
     r"INPUT shards/\{00005..00009\}.tar: names no files \(shards/00005.tar, the first of its 5 names, does not "
     r"exist\)"),
    (["nosuch://data/", "--output", "x.parquet"], "nosuch://data/: no fsspec file system reads nosuch:// URLs"),
])
def test_usage_errors_exit_2(args, match, capsys):
    assert _embed(*args[:1], "--model", "deit", *args[1:]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vit-triton embed: error: ") and re.search(match, err), err


def test_a_protocol_without_its_package_exits_2(missing_protocol, capsys):
    protocol, err = missing_protocol
    assert _embed(f"{protocol}://bucket/{SHARDS}", "--model", "deit", "--output", "x.parquet") == 2
    assert capsys.readouterr().err == (f"vit-triton embed: error: {protocol}://bucket/shards/00000.tar: fsspec's "
                                       f"{protocol}:// file system needs a package that is not installed: {err}\n")


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


def test_embed_images_gives_what_embed_writes(single):
    import vit_triton
    from PIL import Image

    from vit_triton.data import UnreadableImage

    paths, written = _read_parquet(single)
    model = from_pretrained("deit", device=DEVICE, dtype=torch.float32)
    embedded = vit_triton.embed_images(model, paths, batch_size=5)
    assert embedded.shape == written.shape and embedded.dtype == torch.float32
    assert_close(embedded, torch.from_numpy(written), torch.float32)   # other batches: the last bits may differ
    with Image.open(paths[2]) as image:
        one = vit_triton.embed_images(model, [image], normalize=True)
    assert_close(one, torch.nn.functional.normalize(embedded[2:3], dim=-1), torch.float32)
    assert vit_triton.embed_images(model, []).shape == (0, model.config.embed_dim)
    with pytest.raises(UnreadableImage, match=r"^imgs/bad/empty.jpg: empty file"):
        vit_triton.embed_images(model, [paths[0], "imgs/bad/empty.jpg"])


def _turned_jpeg(path: Path) -> Path:
    """A JPEG whose EXIF orientation tag (6) says it is seen turned a quarter clockwise."""
    exif = Image.Exif()
    exif[0x0112] = 6
    load_image("imgs/img000.jpg").resize((40, 24)).save(path, exif=exif)
    return path


def test_pil_images_are_turned_upright_and_converted_as_files_are(tmp_path):
    model = from_pretrained("deit", device=DEVICE, dtype=torch.float32)
    pre = Preprocess.for_model(model)
    path = _turned_jpeg(tmp_path / "turned.jpg")
    upright = load_image(path)
    assert upright.size == (24, 40)
    with Image.open(path) as turned:
        assert torch.equal(pre(turned), pre(upright))
        for mode in ("RGBA", "L", "CMYK", "P"):   # as the path loader converts them
            assert torch.equal(pre.resize_crop(upright.convert(mode)), pre.resize_crop(upright.convert(mode).convert(
                "RGB"))), mode
        assert torch.equal(embed_images(model, [turned, upright.convert("RGBA")]),
                           embed_images(model, [path, upright.convert("RGBA").convert("RGB")]))
        assert turned.size == (40, 24)   # the caller's image is left as it was


def test_wrong_arguments_are_named(work):
    from vit_triton.pipelines import classify

    model = from_pretrained("deit", device=DEVICE, dtype=torch.float32)
    pixels = torch.zeros(1, 3, 32, 32, device=DEVICE)
    with pytest.raises(TypeError, match=r"^images must be a list of paths or PIL images, got str; for one image, "
                                        r"pass \[image\]$"):
        embed_images(model, "imgs/img000.jpg")
    with pytest.raises(TypeError, match=r"^images must be a list of paths or PIL images, got Tensor; a tensor of "
                                        r"pixels goes to the model itself \(model\(pixels\), "):
        embed_images(model, pixels)
    with pytest.raises(TypeError, match=r"^images\[1\] must be a path or a PIL image, got Tensor; a tensor of "):
        embed_images(model, ["imgs/img000.jpg", pixels[0]])
    with pytest.raises(TypeError, match=r"^images must be a list of paths, got str; for one image, pass \[image\]$"):
        next(classify(model, "imgs/img000.jpg"))
    with Image.open("imgs/img000.jpg") as photo, pytest.raises(
            TypeError, match=r"^pixels must be a torch.Tensor \[B, C, H, W\], got JpegImageFile; for images, "
                             r"vit_triton.Preprocess.for_model\(model\) makes the pixels$"):
        model(photo)
    with pytest.raises(TypeError, match=r"^Preprocess takes a PIL image, got Tensor \(uint8 pixels \[C, H, W\] go to "
                                        r"normalize\)$"):
        Preprocess.for_model(model)(pixels[0])


@pytest.fixture(scope="module")
def nan_model(work) -> str:
    """The folder of a checkpoint whose every output is NaN (a NaN in its final norm's bias)."""
    model = hf_model("DeiTForImageClassificationWithTeacher", num_labels=3)
    with torch.no_grad():
        model.deit.layernorm.bias[0] = float("nan")
    save_hf(model, work / "nan")
    return "nan"


def test_nan_outputs_are_skipped_and_listed_or_raised(nan_model, tmp_path, capsys):
    (tmp_path / "list.txt").write_text("imgs/img000.jpg\nimgs/bad/empty.jpg\nimgs/img001.png\n")
    out = tmp_path / "e.npy"
    assert _embed(str(tmp_path / "list.txt"), "--model", nan_model, "--output", str(out), *RUN) == 0
    assert "done 0, skipped 3" in capsys.readouterr().out
    assert np.load(out).shape == (0, 64)
    nan = "NaN or infinite output (the checkpoint's weights or preprocessing make one, or a value overflows the dtype)"
    assert (tmp_path / "e.skipped.tsv").read_text() == (
        f"path\treason\nimgs/img000.jpg\t{nan}\nimgs/bad/empty.jpg\tempty file\nimgs/img001.png\t{nan}\n")
    model = from_pretrained(nan_model, device=DEVICE, dtype=torch.float32)
    with pytest.raises(ValueError, match=re.escape(f"images[0] (imgs/img001.png): {nan}")):
        embed_images(model, ["imgs/img001.png"])


def test_from_pretrained_is_float32_on_the_cpu_unless_a_dtype_is_given():
    assert from_pretrained("deit", device="cpu").patch_embed.weight.dtype == torch.float32
    assert from_pretrained("deit", device="cpu", dtype=torch.bfloat16).patch_embed.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("counts", [(20000, 5000, 5000), (65536, 4096, 16384), (300, 17, 75), (4096, 8191, 1)])
def test_the_throughput_scripts_warm_up_covers_every_batch_shape_embed_makes(counts):
    from vit_triton.pipelines.embed import ChunkBatches

    shapes = {len(batch) for count in counts
              for batch in ChunkBatches([range(s, min(s + 4096, count)) for s in range(0, count, 4096)], 256)}
    warmed = load_script("embed_throughput.py").short_batches(counts, 256)
    assert {s or 256 for s in warmed} == shapes | {256}   # 0 stands for a full batch
