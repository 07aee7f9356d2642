"""What makes a model fast to call: CUDA-graph capture per batch shape."""

from .cuda_graph import CUDAGraphRunner, compile

__all__ = ["CUDAGraphRunner", "compile"]
