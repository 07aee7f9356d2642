"""The commands' work, callable from Python: classify a few images, embed a folder of a million, fine-tune on
labelled images.

These sit below data/ in the layers (they use decoding, preprocessing and the loaders), above cli.py.
"""

from .classify import classify
from .embed import EmbedOptions, embed, embed_images
from .finetune import FinetuneOptions, FinetuneSummary, finetune
from .store import Summary, UsageError, check_image_size

__all__ = ["EmbedOptions", "FinetuneOptions", "FinetuneSummary", "Summary", "UsageError", "check_image_size",
           "classify", "embed", "embed_images", "finetune"]
