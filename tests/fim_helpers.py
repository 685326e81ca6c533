"""A FIM model for tests: the bundled SmolLM2 whose tokenizer spells four unused special
tokens as StarCoder's FIM markers (it has <reponame> and <file_sep> already), so prompts
assemble and generate as they would on a FIM-trained model (the weights were never trained
on them: only the mechanics are tested)."""
from __future__ import annotations

import json
from pathlib import Path

RENAMED = {"<issue_start>": "<fim_prefix>", "<issue_comment>": "<fim_suffix>",
           "<issue_closed>": "<fim_middle>", "<jupyter_start>": "<fim_pad>"}


def fim_model_folder(smollm2_dir: Path, folder: Path) -> Path:
    for f in smollm2_dir.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            (folder / f.name).symlink_to(f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (smollm2_dir / name).read_text()
        for old, new in RENAMED.items():
            text = text.replace(json.dumps(old), json.dumps(new))
        (folder / name).write_text(text)
    return folder
