"""--device: where the model runs and the device KV tier lives, resolved once at start-up.
torch is imported where a device is resolved: the flag is checked where torch is not loaded."""
from __future__ import annotations

import re

DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_spec(spec: str) -> None:
    """A clear error for a --device value that names no device (no torch needed)."""
    if not DEVICE_SPEC.fullmatch(spec):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {spec!r}")


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def resolve_device(spec: str):
    """auto: the first CUDA device torch sees, else the CPU; cuda[:N]: that device, or a
    ValueError saying why it cannot be used. Returns a torch.device."""
    import torch
    check_device_spec(spec)
    if spec == "auto":
        return torch.device("cuda", 0) if cuda_available() else torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cpu":
        return dev
    if not cuda_available():
        raise ValueError(f"--device {spec}: torch sees no CUDA device (a CPU-only torch build, "
                         f"no driver, or CUDA_VISIBLE_DEVICES hides them); use --device cpu")
    count = torch.cuda.device_count()
    index = 0 if dev.index is None else dev.index
    if index >= count:
        raise ValueError(f"--device {spec}: torch sees {count} CUDA device(s), "
                         f"cuda:0..cuda:{count - 1}")
    return torch.device("cuda", index)


def describe(device) -> str:
    """The device (a torch.device) in words, for the start-up log and benchmark results."""
    if device.type == "cuda":
        import torch
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"
