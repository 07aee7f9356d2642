"""`vit-triton classify`: the top classes, named by the checkpoint's labels, of a few images."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader

from ..data import Preprocess
from ..data.files import ImageFiles
from .embed import NON_FINITE, check_images


def classify(model, paths: Sequence[str], *, top_k: int = 5, batch_size: int = 8,
             preprocess: Preprocess | None = None, image_size: int | tuple[int, int] | None = None) -> Iterator[dict]:
    """For each path of the list `paths`, in order: {"path", "predictions": [{"index", "label", "probability"},
    ...]} (top_k by softmax probability), or {"path", "error": reason} for a file that cannot be read or whose
    logits are not finite (NON_FINITE). Without `preprocess`, the checkpoint's own, for images of image_size (an int
    or (height, width); default the checkpoint's size) as Preprocess.for_model makes it. TypeError for anything but
    a list of paths."""
    check_images(paths, pil=False)
    if model.head is None:
        raise ValueError("the model has no classification head")
    pre = preprocess or Preprocess.for_model(model, image_size)
    id2label = getattr(getattr(model, "checkpoint", None), "id2label", {})
    device = model.patch_embed.weight.device
    dataset = ImageFiles(paths, pre)
    k = min(top_k, model.config.num_classes)
    with torch.inference_mode():
        for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=dataset.collate):
            predictions = []
            if len(batch.pixels):
                logits = model(pre.normalize(batch.pixels.to(device))).float()
                probs, classes = logits.softmax(-1).topk(k)
                predictions = [[{"index": ci, "label": id2label.get(ci, f"LABEL_{ci}"), "probability": pi}
                                for pi, ci in zip(p, c)] if finite else NON_FINITE
                               for p, c, finite in zip(probs.tolist(), classes.tolist(),
                                                       logits.isfinite().all(-1).tolist())]
            readable = iter(predictions)  # in order, one for each path without a reason: its predictions, or why none
            for path, reason in zip(batch.names, batch.reasons):
                found = next(readable) if reason is None else reason
                yield {"path": path, "error": found} if isinstance(found, str) else {"path": path, "predictions": found}
