"""The `vit-triton` command line: thin, each command a few calls into the package."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import textwrap
import time

from . import __version__
from .utils import MissingExtra, batch_sizes, image_size, natural_int, positive_int

# --dtype names -> torch dtype names, as strings so that parsing the command line does not import torch
# (torch_dtype gives the dtype, and takes bench's tf32 too).
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EMBED_TIME_LINE = "vit-triton embed: time: "   # then each phase's seconds: "imports 2.1 s, device 0.6 s, ..."
_EXIT_CODES = """exit status:
  0    success (embed: every input embedded, or listed with its reason in the .skipped.tsv file)
  1    failure: a checkpoint that cannot be used, an I/O error, ... (message on stderr);
       classify: an image could not be read, or its output was NaN or infinite (the other images are
       still printed)
  2    usage error: a bad option, INPUT or --model not found, an output written with other settings
       or being written by another run
  130  interrupted; embed continues where it stopped when the same command is run again"""
_MODEL_HELP = ("checkpoint: a HuggingFace hub id (google/vit-base-patch16-224, facebook/deit-base-distilled-"
               "patch16-224, timm/vit_base_patch16_224.augreg2_in21k_ft_in1k), fetched into the HuggingFace cache "
               "(HF_HUB_OFFLINE=1 reads only the cache); or a local directory in the same layout (config.json + "
               "model.safetensors or pytorch_model.bin, sharded or not); or a local weights file with config.json "
               "beside it. Supported families: ViT, DeiT, DINOv2, DINOv3, EVA02, RoPE ViT, CLIP (OpenCLIP's "
               "towers too), SigLIP, ViT-MAE, AIMv2, from transformers or timm (README's \"Supported models\" table "
               "names the classes)")
_DEVICE_HELP = ("cpu, cuda or cuda:N (default: cuda, or cuda:LOCAL_RANK under torchrun; without a CUDA device, cpu "
                "through Triton's interpreter)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vit-triton", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify",
        help="check this machine's kernels against PyTorch and time a forward pass",
        description="Run every kernel at the shapes of one forward pass, and the whole model, with random "
                    "weights; print relative errors against a float64 PyTorch reference per dtype, and the "
                    "time per batch. Without a CUDA device, runs through Triton's interpreter on the CPU "
                    "(the 'tiny' model by default). Exits 1 if any check is out of tolerance.",
    )
    verify.add_argument("--model", default=None,
                        help="model shape: tiny, vit_small_patch16_224, vit_base_patch16_224 (default on a GPU), "
                             "vit_large_patch16_224, vit_large_patch14_clip_336; tiny is the default without a GPU")
    verify.add_argument("--batch-size", type=positive_int, default=None,
                        help="images per batch (default 8 on a GPU, 2 in the interpreter)")
    verify.add_argument("--dtypes", type=dtype_list, default="fp32,bf16,fp16",
                        help="comma-separated subset of fp32,bf16,fp16 (default: %(default)s)")
    verify.set_defaults(usage_error=verify.error)
    bench = sub.add_parser(
        "bench",
        help="time vit-triton against HF, timm and torch.compile; or every kernel on a roofline",
        description="In one process, on the same random inputs: vit-triton, HF transformers (sdpa), timm "
                    "(eager) and torch.compile(timm) in default, max-autotune-no-cudagraphs and reduce-overhead "
                    "modes. Checks vit-triton's output against HF's (or timm's) first and refuses to time a wrong "
                    "answer. Prints median ms, images/s, TFLOP/s, MFU against a matmul ceiling measured in the same "
                    "run, peak memory and the speed-up over the best peer; writes bench.json and throughput.png "
                    "(or roofline.json and roofline.png with --kernels) under --out. Without a CUDA device, runs "
                    "the correctness part only (tiny model, Triton interpreter).",
    )
    bench.add_argument("--model", default="vit_base_patch16_224",
                       help="model shape: vit_small_patch16_224, vit_base_patch16_224, vit_large_patch16_224, "
                            "vit_large_patch14_clip_336, or any timm architecture that from_timm converts (e.g. "
                            "vit_large_patch14_reg4_dinov2), built with random weights (default: %(default)s)")
    bench.add_argument("--image-size", type=positive_int, default=None,
                       help="input size in pixels, square, for a timm architecture (default: the architecture's)")
    bench.add_argument("--batch-sizes", type=batch_sizes, default=None,
                       help="comma-separated positive integers (default: 1,8,32,128,256; 128 with --train)")
    bench.add_argument("--dtype", default="bf16", choices=sorted(DTYPES) + ["tf32"],
                       help="tf32: float32 tensors with every system's matmuls on tf32 tensor cores "
                            "(torch.set_float32_matmul_precision('high')); fp32 keeps them exact "
                            "(default: %(default)s)")
    bench.add_argument("--systems", default=None,
                       help="comma-separated subset of vit-triton,vit-triton+cudagraph,hf,timm,timm:exact-fp32,"
                            "timm+compile:default,timm+compile:max-autotune-no-cudagraphs,"
                            "timm+compile:reduce-overhead (default: all); timm:exact-fp32 is timm with exact "
                            "float32 matmuls (PyTorch's default), for a float32 or tf32 run")
    bench.add_argument("--kernels", action="store_true",
                       help="time each kernel of one forward pass (at the largest batch size) against PyTorch "
                            "and place it on a roofline, with a per-kernel breakdown of one forward")
    bench.add_argument("--energy", action="store_true",
                       help="after each timing, run the system back to back for a second and report joules per "
                            "image, mean board power and SM clock (from NVML): at large batch the "
                            "GPU runs at its power limit, where images/s is the limit over joules per image; with "
                            "--kernels, each kernel's millijoules a call, ours and PyTorch's, against the least the "
                            "measured matmul and copy allow")
    bench.add_argument("--profile", action="store_true",
                       help="with each system's timing at the largest batch size, its CUDA kernels under "
                            "torch.profiler: GPU time per pass by class (GEMM, attention, norm, optimizer, other) "
                            "side by side, and each system's costliest kernels in bench.json")
    bench.add_argument("--train", action="store_true",
                       help="time a training step (forward, cross-entropy, backward, fused AdamW) of vit-triton, timm "
                            "and torch.compile(timm) from the same weights, at each batch size (default 128) and "
                            "--precisions, after checking vit-triton's loss and gradients against timm's; then the "
                            "attention backward against PyTorch's flash SDPA backward")
    bench.add_argument("--precisions", default="bf16-mixed,bf16",
                       help="with --train: comma-separated subset of bf16-mixed (autocast over float32 weights), "
                            "bf16 (everything bfloat16) (default: %(default)s)")
    bench.add_argument("--out", default="bench-results", help="output folder (default: %(default)s)")
    bench.set_defaults(usage_error=bench.error)
    _add_classify_and_embed(sub)
    _add_finetune(sub)
    return parser


def _add_classify_and_embed(sub) -> None:
    classify = sub.add_parser(
        "classify", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EXIT_CODES,
        help="print the top classes of images, named by the checkpoint's labels",
        description=textwrap.fill(
            "Classify images with a checkpoint's classifier, after the checkpoint's own preprocessing (resize, "
            "crop, normalize as its transformers image processor or timm transform does). Prints each image's "
            "path and its top-k labels with their probabilities (softmax).", 100),
    )
    classify.add_argument("images", nargs="+", metavar="IMAGE", help="image files (any format Pillow reads)")
    classify.add_argument("--model", required=True, help=_MODEL_HELP + "; it must have a classification head")
    classify.add_argument("--top-k", type=positive_int, default=5, help="classes per image (default 5)")
    classify.add_argument("--json", action="store_true",
                          help='print one JSON array: per image {"path", "predictions": [{"index", "label", '
                               '"probability"}]}, or {"path", "error"} for an unreadable file')
    _add_runtime_options(classify, "images per forward pass (default 8)")

    embed = sub.add_parser(
        "embed", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EXIT_CODES + """

outputs (OUT = emb.parquet or emb.npy):
  emb.parquet          columns path, embedding (fixed-size list) [, tokens]; or
  emb.npy              embeddings [N, D] (+ emb.tokens.npy [N, T, D]) and emb.paths.json, a JSON object:
                       "paths" (the rows' paths, in order) and the run's "settings", "cwd", "done", "skipped"
  emb.skipped.tsv      path and reason of each input not embedded (empty, truncated, corrupt, not an image,
                       NaN or infinite output)
  emb.inputs.tsv       path, size and mtime_ns of each input: a later run embeds again a file replaced in place
  emb.parquet.partial/ while running: the finished chunks and the manifest a resumed run continues from
  emb.parquet.lock     while running: the lock that refuses a second run into the same output

several GPUs: torchrun --nproc-per-node N -m vit_triton embed INPUT --model M --output OUT
  shards the chunks over the processes and writes the same output as one process.""",
        help="write one embedding per image of a folder, list, glob or tar shards: resumable, on one or several GPUs",
        description=textwrap.fill(
            "Embed every image of INPUT with a checkpoint: decode and preprocess in DataLoader worker processes "
            "while the GPU runs, write finished chunks atomically, merge them into OUT as they come. Files that "
            "cannot be read are skipped and listed with the reason; the run never stops for one. Killed (even "
            "with kill -9), the same command continues where it stopped, without duplicates or gaps; run again "
            "after it finished, it embeds only the files new in INPUT, and those replaced in place (another size "
            "or modification time), whose old rows it replaces, and adds their rows at the end. Relative paths "
            "are recorded as INPUT lists them: run it again from the same directory. OUT's own files in INPUT "
            "are no inputs. Images are turned upright by their EXIF orientation.", 100),
    )
    embed.add_argument("input", metavar="INPUT",
                       help="a directory (recursive; hidden files left out), a text file of paths (one per line, "
                            "relative to the current directory), or a glob pattern in quotes ('imgs/**/*.jpg'); or "
                            "tar shards (webdataset's layout): one .tar, a brace range ('data/{00000..00099}.tar'), "
                            "a glob, folder or list of them. Any of these may be a URL fsspec opens (s3://, gs://, "
                            "https://, with its package installed)"),
    embed.add_argument("--model", required=True, help=_MODEL_HELP)
    embed.add_argument("--output", required=True, metavar="OUT",
                       help="the output file: .parquet (Parquet) or .npy (NumPy, with OUT's .paths.json)")
    embed.add_argument("--normalize", action="store_true", help="L2-normalize each pooled embedding")
    embed.add_argument("--tokens", action="store_true",
                       help="also write all tokens [T, D] of each image (the final-norm features), besides the "
                            "pooled embedding (class token, or the mean of the patch tokens, as the model pools)")
    embed.add_argument("--output-dtype", choices=["float32", "float16"], default="float32",
                       help="dtype of the written embeddings (default float32)")
    embed.add_argument("--num-workers", type=natural_int, default=None,
                       help="DataLoader worker processes decoding images, per GPU (default: the CPUs per process, "
                            "less one); 0 decodes in the main process, without overlap")
    embed.add_argument("--chunk-size", type=positive_int, default=None,
                       help="images per chunk: the unit written atomically and redone after a kill (default 4096, "
                            "512 with --tokens); a resumed run must use the same. A tar shard is one chunk, written "
                            "this many images at a time")
    embed.add_argument("--overwrite", action="store_true",
                       help="delete OUT and any unfinished run into it, and start over")
    embed.add_argument("--decode", choices=["cpu", "gpu"], default=None,
                       help="where images are decoded and resized: gpu (baseline colour JPEGs by nvImageCodec, "
                            "the GPU's hardware JPEG decoders where it has them, else by torchvision's nvJPEG, then "
                            "the resize kernel, beside the forward; other files still on the CPU, counted; the "
                            "default where it can run; the log names the decoder) or cpu (Pillow in the workers; the "
                            "default elsewhere)")
    embed.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar with images/s on stderr (default: when stderr is a terminal)")
    _add_runtime_options(embed, "images per forward pass, per GPU (default 256 on a GPU, 4 in the interpreter)")


def _add_finetune(sub) -> None:
    finetune = sub.add_parser(
        "finetune", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EXIT_CODES + """

inputs (TRAIN, VAL):
  a folder of class subfolders   TRAIN/CLASS/IMAGE (torchvision's ImageFolder layout; classes sorted by name)
  a CSV file                     rows path,label (an optional header path,label; paths relative to the CSV)
  tar shards                     webdataset's layout: KEY.jpg beside KEY.cls (an integer or a name) or KEY.json
                                 ({"label": ...} or {"cls": ...}); a .tar, a brace range, a glob, folder or list
  integer labels of a CSV or of shards are sorted as numbers; any INPUT may be a URL that fsspec opens

outputs (in OUT_DIR):
  config.json, model.safetensors, ...  the fine-tuned model in its source library's layout (transformers or
                                       timm), labels included: vit-triton classify/embed and the library load it
  metrics.jsonl, curves.png            a line per --log-interval steps and per epoch; their plot
  train.skipped.tsv, val.skipped.tsv   path and reason of each input that is not a readable labelled image
  training/                            settings, the scanned data set, the last checkpoint (for --resume)

several GPUs: torchrun --nproc-per-node N -m vit_triton finetune TRAIN --model M --output OUT_DIR
  DistributedDataParallel; --batch-size stays the global batch, split over the processes.""",
        help="fine-tune a checkpoint into a classifier of labelled images: resumable, on one or several GPUs",
        description=textwrap.fill(
            "Fine-tune a checkpoint's ViT on labelled images (a new head for the classes found), with the fine-tuning "
            "literature's defaults: AdamW, layer-wise learning-rate decay, a cosine schedule after a linear warm-up, "
            "drop path, label smoothing, RandomResizedCrop and horizontal flips, the checkpoint's own normalization "
            "(its own preprocessing for validation). Every image is decoded once first: those that cannot be read "
            "are listed and left out. Checkpoints are written atomically; after a kill (even kill -9), --resume "
            "continues to the weights the uninterrupted run would have reached.", 100),
    )
    finetune.add_argument("train", metavar="TRAIN",
                          help="the training images: a folder of class subfolders, a CSV of path,label, or tar shards "
                               "with .cls or .json labels (see inputs below)")
    finetune.add_argument("--model", required=True, help=_MODEL_HELP + "; with or without a classification head")
    finetune.add_argument("--output", required=True, metavar="OUT_DIR",
                          help="the output folder: new or empty (or the run's own, with --resume)")
    val = finetune.add_mutually_exclusive_group()
    val.add_argument("--val", metavar="VAL", default=None,
                     help="the validation images, in any layout TRAIN may have; their classes must be TRAIN's")
    val.add_argument("--val-split", type=float, default=None, metavar="FRACTION",
                     help="hold out this fraction of each class of TRAIN for validation, drawn from --seed "
                          "(default 0.1 without --val; 0: no validation)")
    finetune.add_argument("--epochs", type=positive_int, default=10, help="epochs (default %(default)s)")
    finetune.add_argument("--batch-size", type=positive_int, default=None,
                          help="images a batch, over all processes (unlike timm's, per process): under torchrun each "
                               "of N processes takes 1/N of every batch (default 128 on a GPU, 8 in the interpreter)")
    finetune.add_argument("--grad-accum-steps", type=positive_int, default=1,
                          help="batches accumulated into each optimizer step (default %(default)s)")
    finetune.add_argument("--lr", type=float, default=None,
                          help="peak learning rate (default 5e-4 x batch size x grad-accum-steps / 512)")
    finetune.add_argument("--opt", default="adamw", help="optimizer, any of timm.optim's (default %(default)s)")
    finetune.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum (default %(default)s)")
    finetune.add_argument("--weight-decay", type=float, default=0.05,
                          help="weight decay, but for biases, norms, position embeddings and prefix tokens "
                               "(default %(default)s)")
    finetune.add_argument("--layer-decay", type=float, default=0.75,
                          help="layer-wise learning-rate decay (timm's): block i of 1..L learns at lr x decay^(L + 1 - "
                               "i), the embeddings at lr x decay^(L + 1), the final norm and the head at lr (default "
                               "%(default)s; 1: none)")
    finetune.add_argument("--sched", choices=["cosine", "tanh"], default="cosine",
                          help="learning-rate schedule after the warm-up, stepped each optimizer step (timm.scheduler; "
                               "default %(default)s)")
    finetune.add_argument("--warmup-epochs", type=natural_int, default=1,
                          help="epochs of linear warm-up from --warmup-lr (default %(default)s)")
    finetune.add_argument("--warmup-lr", type=float, default=1e-6, help="learning rate the warm-up starts at "
                                                                         "(default %(default)s)")
    finetune.add_argument("--min-lr", type=float, default=1e-6, help="learning rate the schedule ends at "
                                                                      "(default %(default)s)")
    finetune.add_argument("--drop-path", type=float, default=0.1,
                          help="stochastic depth: the last block's drop rate, rising linearly from 0 over the blocks "
                               "(default %(default)s)")
    finetune.add_argument("--drop", type=float, default=0.0,
                          help="dropout of the pooled features before the head (default %(default)s)")
    finetune.add_argument("--smoothing", type=float, default=0.1, help="label smoothing (default %(default)s)")
    finetune.add_argument("--clip-grad", type=float, default=None, help="clip the gradients' norm to this (default: "
                                                                         "no clipping)")
    finetune.add_argument("--scale", type=float, nargs=2, default=(0.08, 1.0), metavar=("MIN", "MAX"),
                          help="RandomResizedCrop's range of the area cropped (default 0.08 1)")
    finetune.add_argument("--ratio", type=float, nargs=2, default=(3 / 4, 4 / 3), metavar=("MIN", "MAX"),
                          help="RandomResizedCrop's range of aspect ratios (default 3/4 4/3)")
    finetune.add_argument("--hflip", type=float, default=0.5, help="probability of a horizontal flip (default "
                                                                    "%(default)s)")
    finetune.add_argument("--linear-probe", action="store_true",
                          help="train the head alone: the backbone is frozen and runs without autograd")
    finetune.add_argument("--grad-checkpointing", action="store_true",
                          help="activation checkpointing: each block's forward runs again in the backward, for memory")
    finetune.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                          help="issue each step's kernels from Python, as eagerly as PyTorch does (by default one "
                               "process on a GPU captures a micro-batch's forward and backward as a CUDA graph and "
                               "replays it: the same computation, without the Python that bounds an eager step; "
                               "torchrun's processes and --grad-checkpointing run eagerly)")
    finetune.add_argument("--precision", choices=["bf16-mixed", "bf16", "fp32"], default=None,
                          help="bf16-mixed: float32 weights, bfloat16 compute (torch.autocast); bf16: all bfloat16; "
                               "fp32 (default bf16-mixed on a GPU, fp32 in the CPU interpreter)")
    finetune.add_argument("--seed", type=natural_int, default=42,
                          help="seed of the data order, the augmentations, the new head and drop path (default "
                               "%(default)s)")
    finetune.add_argument("-j", "--workers", type=natural_int, default=None,
                          help="DataLoader worker processes decoding and augmenting images, per process (default: "
                               "the CPUs per process, less one)")
    finetune.add_argument("--checkpoint-every", type=natural_int, default=500, metavar="N",
                          help="write a checkpoint every N optimizer steps, besides each epoch's end (default "
                               "%(default)s; 0: at epochs' ends only)")
    finetune.add_argument("--log-interval", type=positive_int, default=50, metavar="N",
                          help="write the loss, learning rate and images/s to metrics.jsonl every N steps (default "
                               "%(default)s)")
    finetune.add_argument("--resume", action="store_true",
                          help="continue the run in OUT_DIR from its last checkpoint (the same settings)")
    finetune.add_argument("--image-size", type=image_size, default=None, metavar="N|HxW",
                          help="train and validate on images of this size, N x N or H x W pixels, instead of the "
                               "checkpoint's (the saved model keeps its own; pass --image-size to classify and embed)")
    finetune.add_argument("--device", default=None, help=_DEVICE_HELP)
    finetune.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                          help="progress bars with the loss, learning rate and images/s on stderr (default: when "
                               "stderr is a terminal)")


def _add_runtime_options(p: argparse.ArgumentParser, batch_help: str) -> None:
    p.add_argument("--image-size", type=image_size, default=None, metavar="N|HxW",
                   help="run the model on images of this size, N x N or H x W pixels (at least the patch size), "
                        "instead of the checkpoint's: its preprocessing makes them, and its position embedding is "
                        "resampled as timm (dynamic_img_size) and transformers (interpolate_pos_encoding) do")
    p.add_argument("--batch-size", type=positive_int, default=None, help=batch_help)
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="compute dtype of the model (default bf16 on a GPU, fp32 in the CPU interpreter)")
    p.add_argument("--device", default=None, help=_DEVICE_HELP)


def torch_dtype(name: str):
    """The torch dtype of a --dtype name: fp32, bf16, fp16, or tf32 (float32)."""
    import torch

    return getattr(torch, DTYPES["fp32" if name == "tf32" else name])


def dtype_list(text: str) -> list[str]:
    """A --dtypes value: a comma-separated subset of DTYPES' names."""
    names = text.split(",")
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown dtype {unknown[0]!r}; expected a subset of {','.join(DTYPES)}")
    return names


def _bench(args: argparse.Namespace) -> int:
    import torch

    on_gpu = _interpret_without_cuda(None)
    from pathlib import Path

    cfg, timm_module = _bench_model(args)
    batch_sizes = sorted(set(args.batch_sizes or ([128] if args.train else [1, 8, 32, 128, 256])))
    if args.dtype == "tf32":
        torch.set_float32_matmul_precision("high")
    dtype = torch_dtype(args.dtype)
    if args.energy and not on_gpu:
        raise SystemExit("vit-triton bench: --energy reads a GPU board's energy while the systems or kernels run: it "
                         "needs a CUDA device")
    if args.profile and (args.kernels or not on_gpu):
        args.usage_error("--profile lists the CUDA kernels of each system's timed pass: it needs a CUDA device, and "
                         "not --kernels (which times each kernel alone)")
    from .bench import systems

    if args.train and on_gpu:
        return _bench_train(args, cfg, timm_module, batch_sizes)
    names = tuple(args.systems.split(",")) if args.systems else systems.SYSTEMS
    unknown = set(names) - set(systems.SYSTEMS)
    if unknown:
        args.usage_error(f"unknown systems {sorted(unknown)}; expected a subset of {','.join(systems.SYSTEMS)}")
    if not on_gpu:
        return _bench_without_gpu(dtype)
    from .bench import harness, power, roofline
    from .bench.profile import format_kernel_classes

    name = args.model + (f"_{args.image_size}" if args.image_size else "")
    device, out = torch.device("cuda"), Path(args.out) / name / args.dtype
    board = power.Board(device) if args.energy else None   # a missing NVML fails before anything runs
    if args.kernels:
        _, _, ours = systems.build_systems(cfg, dtype, device, ("vit-triton",), timm_module)
        roofline.run_roofline(name, cfg, batch_sizes[-1], dtype, device, ours, out, board=board)
    else:
        result = harness.run_bench(name, cfg, batch_sizes, dtype, device, out, names, board=board,
                                   timm_module=timm_module, profile=args.profile)
        print(harness.format_table(result))
        if args.profile:
            print(format_kernel_classes(result["rows"]))
    print(f"results under {out}/")
    return 0


def _bench_train(args: argparse.Namespace, cfg, timm_module, batch_sizes: list[int]) -> int:
    import torch
    from pathlib import Path

    from .bench import systems, train
    from .bench.profile import format_kernel_classes

    precisions = args.precisions.split(",")
    unknown = set(precisions) - set(train.PRECISIONS)
    if unknown:
        args.usage_error(f"unknown precisions {sorted(unknown)}; expected a subset of {','.join(train.PRECISIONS)}")
    names = tuple(args.systems.split(",")) if args.systems else train.TRAIN_SYSTEMS
    if set(names) - set(train.TRAIN_SYSTEMS):
        args.usage_error(f"with --train, --systems is a subset of {','.join(train.TRAIN_SYSTEMS)}")
    timm_module = timm_module if timm_module is not None else systems.timm_model(cfg)
    name = args.model + (f"_{args.image_size}" if args.image_size else "")
    out = Path(args.out) / name / "train"
    result = train.run_train_bench(name, timm_module, batch_sizes, precisions, torch.device("cuda"), out, names,
                                   profile=args.profile)
    print(train.format_train_table(result))
    if args.profile:
        print(format_kernel_classes(result["rows"]))
    print(f"results under {out}/")
    return 0


def _bench_model(args: argparse.Namespace):
    """(ViTConfig, timm module or None) of bench's --model: a preset shape (at --image-size), or a timm
    architecture built with random weights."""
    import dataclasses

    from .model import PRESETS

    if args.model in PRESETS:
        cfg = PRESETS[args.model]
        try:
            return (dataclasses.replace(cfg, image_size=args.image_size) if args.image_size else cfg), None
        except ValueError as e:
            args.usage_error(f"--image-size {args.image_size}: {e}")
    try:
        import timm
    except ImportError:
        args.usage_error(f"unknown model {args.model!r}; expected one of {', '.join(PRESETS)} (or, with timm "
                         f"installed, a timm architecture)")
    if not timm.is_model(args.model):
        args.usage_error(f"unknown model {args.model!r}; expected one of {', '.join(PRESETS)} or a timm architecture")
    from .loaders import timm_config_to_vit

    module = timm.create_model(args.model, pretrained=False, **({"img_size": args.image_size} if args.image_size
                                                                else {}))
    try:
        return timm_config_to_vit(module), module
    except ValueError as e:
        args.usage_error(f"--model {args.model}: {e}")


def _bench_without_gpu(dtype) -> int:
    import torch

    from .bench.harness import check_correctness
    from .bench.systems import build_systems
    from .bench.verify import format_table, kernel_checks
    from .model import PRESETS

    print("vit-triton bench: no CUDA device, so no timings; running the correctness part only "
          "(the tiny model through Triton's interpreter)", flush=True)
    cfg, device = PRESETS["tiny"], torch.device("cpu")
    _, reference, ours = build_systems(cfg, dtype, device, ("vit-triton",))
    check = check_correctness(reference, ours, cfg, dtype, device)
    checks = kernel_checks(cfg, 2, dtype, device)
    print(format_table(checks, {}))
    print(f"model output against {check['reference']} (float64): rel err {check['err']:.2e}, "
          f"tolerance {check['tol']:.2e}: {'ok' if check['ok'] else 'FAIL'}")
    return 0 if check["ok"] and all(c.ok for c in checks) else 1


def _verify(args: argparse.Namespace) -> int:
    import torch

    on_gpu = _interpret_without_cuda(None)
    from .bench.verify import format_table, verify
    from .model import PRESETS

    name = args.model or ("vit_base_patch16_224" if on_gpu else "tiny")
    if name not in PRESETS:
        args.usage_error(f"unknown model {name!r}; expected one of {', '.join(PRESETS)}")
    dtypes = [torch_dtype(d) for d in args.dtypes]
    batch = args.batch_size or (8 if on_gpu else 2)
    device = torch.device("cuda" if on_gpu else "cpu")
    where = torch.cuda.get_device_name() if on_gpu else "CPU, Triton interpreter"
    print(f"vit-triton verify: {name}, batch {batch}, on {where}", flush=True)
    checks, times = verify(PRESETS[name], batch, dtypes, device, log=lambda s: print(s, flush=True))
    timer = "median of CUDA-event timings" if on_gpu else "one run through the interpreter, not a GPU speed"
    print(format_table(checks, times, batch, timer))
    failed = [c for c in checks if not c.ok]
    if failed:
        print(f"\n{len(failed)} check(s) out of tolerance", file=sys.stderr)
        return 1
    print(f"\nall {len(checks)} checks within tolerance")
    return 0


def _interpret_without_cuda(device: str | None) -> bool:
    """True on a GPU; otherwise sets TRITON_INTERPRET, which must precede the kernels' definition
    (the first import of vit_triton's model, in each command below)."""
    import torch

    on_gpu = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    return on_gpu


def _classify(args: argparse.Namespace) -> int:
    on_gpu = _interpret_without_cuda(args.device)
    import json

    from .loaders import from_pretrained
    from .pipelines import UsageError, check_image_size, classify
    from .pipelines.embed import resolve_device

    model = from_pretrained(args.model, device=resolve_device(args.device, 0),
                            dtype=torch_dtype(args.dtype or ("bf16" if on_gpu else "fp32")))
    if model.head is None:
        raise UsageError(f"--model {args.model} has no classification head ({model.checkpoint.architecture}): "
                         f"use vit-triton embed for its embeddings")
    check_image_size(model, args.image_size)
    results, failed = [], 0
    for result in classify(model, args.images, top_k=args.top_k, batch_size=args.batch_size or 8,
                           image_size=args.image_size):
        if "error" in result:
            failed += 1
            print(f"vit-triton classify: {result['path']}: {result['error']}", file=sys.stderr)
        if args.json:
            results.append(result)
        elif "predictions" in result:
            print(result["path"])
            for p in result["predictions"]:
                print(f"  {p['probability']:.4f}  {p['label']}")
    if args.json:
        print(json.dumps(results, indent=1))
    return EXIT_FAILURE if failed else EXIT_OK


def _embed(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from .data.decode import widen_hardware_queues

    widen_hardware_queues()   # before CUDA is asked anything, even whether it is there
    _interpret_without_cuda(args.device)
    from .pipelines import EmbedOptions, embed

    imports = time.perf_counter() - started

    summary = embed(EmbedOptions(
        model=args.model, input=args.input, output=args.output, batch_size=args.batch_size,
        num_workers=args.num_workers, chunk_size=args.chunk_size, normalize=args.normalize, tokens=args.tokens,
        dtype=args.dtype and torch_dtype(args.dtype), output_dtype=args.output_dtype, device=args.device,
        image_size=args.image_size, overwrite=args.overwrite, progress=args.progress, decode=args.decode,
    ))
    if summary is not None:  # rank 0
        this_run = "nothing to do"
        if summary.processed:
            this_run = (f"{summary.processed} images in {summary.seconds:.1f} s, "
                        f"{summary.processed / summary.seconds:.1f} images/s, decoded {summary.gpu_decoded} on the "
                        f"GPU and {summary.cpu_decoded} on the CPU")
        if summary.phases:
            phases = {"imports": imports, **summary.phases}
            print(EMBED_TIME_LINE + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()),
                  file=sys.stderr, flush=True)
        print(f"vit-triton embed: done {summary.done}, skipped {summary.skipped} (listed in "
              f"{summary.skipped_file}); this run: {this_run} -> {summary.output}", flush=True)
    return EXIT_OK


def _finetune(args: argparse.Namespace) -> int:
    _interpret_without_cuda(args.device)
    from .pipelines import FinetuneOptions, finetune

    summary = finetune(FinetuneOptions(
        train=args.train, model=args.model, output=args.output, val=args.val, val_split=args.val_split,
        epochs=args.epochs, batch_size=args.batch_size, grad_accum_steps=args.grad_accum_steps, lr=args.lr,
        opt=args.opt, momentum=args.momentum, weight_decay=args.weight_decay, layer_decay=args.layer_decay,
        sched=args.sched, warmup_epochs=args.warmup_epochs, warmup_lr=args.warmup_lr, min_lr=args.min_lr,
        drop_path=args.drop_path, drop=args.drop, smoothing=args.smoothing, clip_grad=args.clip_grad,
        scale=tuple(args.scale), ratio=tuple(args.ratio), hflip=args.hflip, image_size=args.image_size,
        linear_probe=args.linear_probe, grad_checkpointing=args.grad_checkpointing, precision=args.precision,
        seed=args.seed, workers=args.workers, checkpoint_every=args.checkpoint_every,
        log_interval=args.log_interval, resume=args.resume, device=args.device, progress=args.progress,
        cuda_graph=args.cuda_graph,
    ))
    if summary is not None:  # rank 0
        validated = (f"validation top-1 {100 * summary.val_top1:.2f}% (loss {summary.val_loss:.4f}) on "
                     f"{summary.val_images} images" if summary.val_top1 is not None else "no validation")
        print(f"vit-triton finetune: done, {summary.epochs} epoch(s), {summary.steps} steps on {summary.train_images} "
              f"images of {summary.classes} classes; {validated}; skipped {summary.skipped} (listed in "
              f"{summary.output}/*.skipped.tsv); this run {summary.seconds:.1f} s -> {summary.output}", flush=True)
    return EXIT_OK


def _version() -> str:
    """The installed package's version; from a source tree that is not installed, the one it declares."""
    try:
        return importlib.metadata.version("vit-triton")
    except importlib.metadata.PackageNotFoundError:
        return f"{__version__} (not installed)"


def _run_reporting_errors(command, args: argparse.Namespace) -> int:
    """Every failure becomes one line on stderr and an exit status (see _EXIT_CODES); bugs keep their traceback."""
    try:
        return command(args)
    except KeyboardInterrupt:
        print(f"vit-triton {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, OSError, RuntimeError) as e:
        from .loaders import CheckpointNotFound
        from .pipelines import UsageError

        print(f"vit-triton {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, (UsageError, CheckpointNotFound)) else EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command in ("classify", "embed", "finetune"):
            return _run_reporting_errors({"classify": _classify, "embed": _embed, "finetune": _finetune}[args.command],
                                         args)
        return {"verify": _verify, "bench": _bench}[args.command](args)
    except MissingExtra as e:
        print(f"vit-triton {args.command}: error: {e}", file=sys.stderr)
        return EXIT_FAILURE


def run() -> None:
    """The vit-triton command: main(), then the process ends at once (os._exit) with its exit status. By then
    everything the command writes is written, closed and flushed; the interpreter's teardown that os._exit skips
    (torch's, CUDA's, the decoder's: a second or more of every command) leaves nothing behind that a user reads. An
    error main() does not handle ends the process the ordinary way, with its traceback."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
