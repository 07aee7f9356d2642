"""`vit-triton classify`: the top classes, named by the checkpoint's labels, of a few images."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from ..data import Preprocess
from ..data.files import ImageFiles


def classify(model, paths: list[str], *, top_k: int = 5, batch_size: int = 8,
             preprocess: Preprocess | None = None, image_size: int | tuple[int, int] | None = None) -> Iterator[dict]:
    """For each path, in order: {"path", "predictions": [{"index", "label", "probability"}, ...]}
    (top_k by softmax probability), or {"path", "error": reason} for a file that cannot be read. Without
    `preprocess`, the checkpoint's own, for images of image_size (an int or (height, width); default the
    checkpoint's size) as Preprocess.for_model makes it."""
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
                logits = model(pre.normalize(batch.pixels.to(device)))
                probs, classes = logits.float().softmax(-1).topk(k)
                predictions = [[{"index": ci, "label": id2label.get(ci, f"LABEL_{ci}"), "probability": pi}
                                for pi, ci in zip(p, c)] for p, c in zip(probs.tolist(), classes.tolist())]
            readable = iter(predictions)  # in order, one for each path without a reason
            for path, reason in zip(batch.names, batch.reasons):
                yield {"path": path, "error": reason} if reason else {"path": path, "predictions": next(readable)}
