"""KV tiers (device, host, disk) behind one batched interface; see base.py for the contract."""
from kvstore.tiers.base import PageShape, Tier
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_fault import DiskFault
from kvstore.tiers.errors import PageCorrupted, PageMissing, TierError, TierFull, TierIOError
from kvstore.tiers.host import HostTier

__all__ = ["DeviceTier", "DiskFault", "DiskTier", "HostTier", "PageCorrupted", "PageMissing",
           "PageShape", "Tier", "TierError", "TierFull", "TierIOError"]
