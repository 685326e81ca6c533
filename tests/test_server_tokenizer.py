"""Tokenizer (tokenizers + jinja2, no torch): chat template, token bytes, and a torch-free server."""
from __future__ import annotations

import subprocess
import sys

import pytest

from server.tokenizer import TemplateError, Tokenizer
from tests.conftest import REPO_ROOT


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_dir)


def test_chat_template_renders_chatml_with_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_chat_prompt_encodes_special_tokens_once(tokenizer):
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids.count(1) == 3                        # <|im_start|>: default system, user, assistant
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_token_bytes_rebuild_multibyte_text(tokenizer):
    text = "naïve 😀 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(bytes(tokenizer.token_bytes(t)) for t in ids).decode("utf-8") == text


def test_template_errors_are_template_errors():
    from tokenizers import Tokenizer as HF
    from tokenizers.models import WordLevel
    bare = Tokenizer(HF(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
                     chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(TemplateError, match="no system role"):
        bare.apply_chat_template([{"role": "user", "content": "a"}])
    with pytest.raises(TemplateError):
        Tokenizer(HF(WordLevel({"a": 0}, unk_token="a"))).apply_chat_template([])


def test_server_modules_do_not_import_torch():
    code = ("import sys, server.api, server.cli, server.tokenizer; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', "
            "'kernels', 'kvstore')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
