"""The attention kernels for a device, chosen once at start-up: paged attention (prefill and
dense decode: kernels/attention.py's torch backend, or FlashInfer's on CUDA,
kernels/flashinfer_attention.py) and sparse decode (the C kernel on a CPU, FlashInfer's on
CUDA, kernels/flashinfer_sparse_attention.py, else torch). The FlashInfer modules import the
torch ones: the choice lives here so that neither imports the other."""
from __future__ import annotations

import importlib.util
import logging

import torch

from kernels.attention import TorchPagedAttention
from kernels.sparse_attention import NativeSparseDecode, TorchSparseDecode, native_decode_built

logger = logging.getLogger(__name__)


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def make_attention_backend(device: torch.device | str):
    """The paged-attention backend for `device`, chosen once at start-up: FlashInfer on CUDA
    when it is installed, TorchPagedAttention otherwise.

    Both expose `plan(batch, num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, scale)`
    (once per step) and `forward(q, kv_layer, batch, scale)` (per layer).
    """
    device = torch.device(device)
    if device.type == "cuda":
        if flashinfer_installed():
            # NOTE: imported here: only CUDA machines have flashinfer
            from kernels.flashinfer_attention import FlashInferPagedAttention
            logger.info("attention backend: FlashInfer on %s", device)
            return FlashInferPagedAttention(device)
        logger.warning("flashinfer is not installed; using torch attention on %s "
                       "(install the 'gpu' extra for FlashInfer)", device)
    return TorchPagedAttention()


def make_sparse_decode(device: torch.device | str):
    """The sparse decode kernel for the KV pool's device: the C one on a CPU (when built),
    FlashInfer's on CUDA (when installed), else the torch one. All take
    `forward(q, kv_pool, head_table, group, scale)`."""
    device = torch.device(device)
    if device.type == "cpu" and native_decode_built():
        return NativeSparseDecode()
    if device.type == "cuda" and flashinfer_installed():
        from kernels.flashinfer_sparse_attention import FlashInferSparseDecode
        return FlashInferSparseDecode(device)
    return TorchSparseDecode()
