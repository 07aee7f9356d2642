"""vit-triton: Vision Transformers from Triton kernels, numerically equal to HuggingFace and timm.

Names are imported on first use: Triton reads TRITON_INTERPRET when the kernels are defined, so
`import vit_triton` must not define them before a program (the CLI, a test) has chosen.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "ViT": ".model",
    "ViTConfig": ".model",
    "PRESETS": ".model",
    "from_hf": ".loaders",
    "from_timm": ".loaders",
    "compile": ".runtime",
    "from_pretrained": ".loaders",
    "save_pretrained": ".loaders",
    "Preprocess": ".data",
    "embed_images": ".pipelines",
    "launch_options": ".kernels",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'vit_triton' has no attribute {name!r}")
