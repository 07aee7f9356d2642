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
            results = {i: {"path": paths[i], "error": reason} for i, reason in batch.skipped}
            if batch.indices:
                logits = model(pre.normalize(batch.pixels.to(device)))
                probs, classes = logits.float().softmax(-1).topk(k)
                for i, p, c in zip(batch.indices, probs.tolist(), classes.tolist()):
                    results[i] = {"path": paths[i], "predictions": [
                        {"index": ci, "label": id2label.get(ci, f"LABEL_{ci}"), "probability": pi}
                        for pi, ci in zip(p, c)]}
            yield from (results[i] for i in sorted(results))
