"""The paged-attention backend for a device, chosen once at start-up (kernels/attention.py's
torch backend, or FlashInfer's on CUDA, kernels/flashinfer_attention.py, which imports the
former: the choice lives here so that neither module imports the other)."""
from __future__ import annotations

import importlib.util
import logging

import torch

from kernels.attention import TorchPagedAttention

logger = logging.getLogger(__name__)


def make_attention_backend(device: torch.device | str):
    """The paged-attention backend for `device`, chosen once at start-up: FlashInfer on CUDA
    when it is installed, TorchPagedAttention otherwise.

    Both expose `plan(batch, num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, scale)`
    (once per step) and `forward(q, kv_layer, batch, scale)` (per layer).
    """
    device = torch.device(device)
    if device.type == "cuda":
        if importlib.util.find_spec("flashinfer") is not None:
            # NOTE: imported here: only CUDA machines have flashinfer
            from kernels.flashinfer_attention import FlashInferPagedAttention
            logger.info("attention backend: FlashInfer on %s", device)
            return FlashInferPagedAttention(device)
        logger.warning("flashinfer is not installed; using torch attention on %s "
                       "(install the 'gpu' extra for FlashInfer)", device)
    return TorchPagedAttention()
