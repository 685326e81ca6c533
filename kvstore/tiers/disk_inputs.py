"""DiskWithInputs: the disk tier plus a sidecar of the pages' layer inputs (KVPR recompute).

With `--kv-recompute` on, each full page is written twice: its K/V to the disk tier as always,
and the layer inputs its K/V were computed from (the hidden states after the layer's input
norm, [page_size, hidden]) to a second DiskTier under `<kv-disk-path>/inputs`. A fill may then
read a page's inputs instead of its K/V and recompute them (kvstore/recompute.py).

The sidecar follows the KV tier's request lifecycle call for call (register, skip, bind,
unbind, release, delete, close), so a page's inputs live exactly as long as its K/V and sit
at the same index of the same request's file. It takes no part in the prefix cache's index:
after a restart the restored pages have no inputs and are read as K/V.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kvstore.tiers.base import PageShape
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_layout import INPUTS_FOLDER


def input_page_shape(page_size: int, hidden: int, dtype: torch.dtype) -> PageShape:
    """A page of layer inputs [page_size, hidden] expressed as the disk tier's page geometry
    ([2, 1, page_size, hidden / 2]: the same bytes; the tier treats a page as opaque)."""
    if hidden % 2:
        raise ValueError(f"layer inputs of odd width ({hidden}) cannot be stored as pages")
    return PageShape(page_size, 1, hidden // 2, dtype)


class DiskWithInputs(DiskTier):
    """The disk tier (K/V pages) whose request lifecycle also drives `inputs`, the sidecar
    tier of the pages' layer inputs."""

    def __init__(self, *args, inputs: DiskTier, **kw):
        super().__init__(*args, **kw)
        self.inputs = inputs

    def register_request(self, request_handle: int, capacity_pages_per_layer: int) -> None:
        self.inputs.register_request(request_handle, capacity_pages_per_layer)
        try:
            super().register_request(request_handle, capacity_pages_per_layer)
        except BaseException:
            self.inputs.release_request(request_handle)
            raise

    def skip(self, request_handle: int, n: int) -> None:
        super().skip(request_handle, n)
        self.inputs.skip(request_handle, n)

    def bind(self, page_ids, request_handle: int, first_index: int) -> None:
        super().bind(page_ids, request_handle, first_index)
        self.inputs.bind(page_ids, request_handle, first_index)

    def unbind(self, page_ids) -> None:
        super().unbind(page_ids)
        self.inputs.unbind(page_ids)

    def release_request(self, request_handle: int) -> None:
        super().release_request(request_handle)
        self.inputs.release_request(request_handle)

    def delete(self, keys: torch.Tensor) -> None:
        super().delete(keys)
        self.inputs.delete(keys)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.inputs.close()


def inputs_path(disk_path: str | Path) -> Path:
    """Where the sidecar of a KV folder lives (what `strata cache clear` clears too)."""
    return Path(disk_path) / INPUTS_FOLDER
