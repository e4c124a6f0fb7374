"""cuflash: exact FlashAttention on CuPy (GPU) and NumPy (CPU) arrays, with no framework."""
from . import reference, ring
from .api import (attention, attention_backward, attention_vjp, merge, paged_append,
                  release_graph_memory)

__all__ = ["attention", "attention_backward", "attention_vjp", "merge", "paged_append",
           "reference", "release_graph_memory", "ring"]
__version__ = "0.1.0"
