"""``open_checkpoint``: the one way in to a checkpoint, whatever its file format.

A path (or a Hugging Face repo id in the local cache) names safetensors files (one file,
an index or a directory), or one GGUF file; gpt-oss safetensors checkpoints have a layout
of their own; safetensors experts stored as FP8 get their block scales attached. The
format modules below this one know nothing of each other.
"""

from __future__ import annotations

import os

from numa_moe.checkpoints.fp8 import attach_fp8_scales
from numa_moe.checkpoints.gguf import gguf_file_of, open_gguf
from numa_moe.checkpoints.gpt_oss import is_gpt_oss, open_gpt_oss
from numa_moe.checkpoints.naming import NamingPattern
from numa_moe.checkpoints.safetensors import Checkpoint, read_config, resolve_checkpoint_path
from numa_moe.formats import FP8_DTYPES

__all__ = ["open_checkpoint"]


def open_checkpoint(path: str | os.PathLike, pattern: NamingPattern | None = None) -> Checkpoint:
    """Open a checkpoint by path, or by Hugging Face repo id (``resolve_checkpoint_path``):
    GGUF (converted while loading, ``numa_moe.checkpoints.gguf``), gpt-oss safetensors
    (config.json model_type gpt_oss: ``numa_moe.checkpoints.gpt_oss``), else safetensors,
    with FP8 experts' block scales attached (``numa_moe.checkpoints.fp8``)."""
    root = resolve_checkpoint_path(path)
    gguf_file = gguf_file_of(root)
    if gguf_file is not None:
        return open_gguf(gguf_file, pattern)
    if is_gpt_oss(read_config(root)):
        return open_gpt_oss(root, pattern)
    checkpoint = Checkpoint.from_safetensors(root, pattern)
    if checkpoint.dtype in FP8_DTYPES:
        attach_fp8_scales(checkpoint)
    return checkpoint
