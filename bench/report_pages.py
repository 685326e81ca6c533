"""The README Results sections of issue 32's benches (which pages where): residency and
placement. Called by bench/report.py."""
from __future__ import annotations

from bench import residency


def residency_section(rep: dict, png: str) -> list[str]:
    t = rep["tiers"]
    arms = ", ".join(f"`{a}`: " + " ".join(_flag(k, v) for k, v in over.items())
                     for a, over in rep["arms"].items())
    table = residency.report(rep).splitlines()[1:]          # without its machine line
    return ["### Which pages stay in DRAM: residency and placement", "",
            f"`.venv/bin/python bench/residency.py`: {rep['batch']} x {rep['context']} tokens, "
            f"sparse budget {t['sparse_budget']}, {t['kv_device_gb']} + {t['kv_host_gb']} GB of "
            f"DRAM KV (a quarter of it), the rest on disk, `--pipeline {t['pipeline']}`; each arm "
            f"in its own process, {len(next(iter(rep['runs'].values())))} rounds in "
            f"turns ({arms}). {rep['machine']['cpu']}. Hit rate: pages a step needed that DRAM "
            "held (KVDrive's Table 3); the first 3 steps follow the prefills (placement).", "",
            f"![residency]({png})", "", *table, ""]


def _flag(field: str, value) -> str:
    if field == "disk_folders":
        return f"--kv-disk-path over {value} folders"
    return f"--{field.replace('_', '-')} {value}"
