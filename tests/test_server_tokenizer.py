"""Tokenizer (tokenizers + jinja2, no torch): chat template, token bytes, a torch-free server."""
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


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! My name is"}]


@pytest.mark.parametrize("options", [dict(add_generation_prompt=False),
                                     dict(add_generation_prompt=False,
                                          continue_final_message=True)])
def test_template_switches_render_as_transformers_does(tokenizer, smollm2_dir, options):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    want = hf.apply_chat_template(CONVERSATION, tokenize=False, **options)
    assert tokenizer.apply_chat_template(CONVERSATION, **options) == want
    if options.get("continue_final_message"):
        assert want.endswith("My name is")


def test_continue_final_message_needs_text_to_continue(tokenizer):
    with pytest.raises(TemplateError):
        tokenizer.apply_chat_template(CONVERSATION[:2] + [{"role": "assistant", "content": ""}],
                                      add_generation_prompt=False, continue_final_message=True)


def test_template_kwargs_reach_the_template(tokenizer):
    own, tokenizer.chat_template = (tokenizer.chat_template,
                                    "{{ greeting }} {{ messages[0]['content'] }}")
    try:
        text = tokenizer.apply_chat_template(CONVERSATION[1:2],
                                             template_kwargs={"greeting": "Dear"})
    finally:
        tokenizer.chat_template = own
    assert text == "Dear Hi"


def test_a_template_failing_on_the_requests_values_is_a_template_error(tokenizer):
    own, tokenizer.chat_template = tokenizer.chat_template, "{{ raise_exception('no') }}"
    try:
        for kwargs in ({}, {"raise_exception": 1}):      # the template's own error, or a call
            with pytest.raises(TemplateError):           # of the request's value
                tokenizer.apply_chat_template(CONVERSATION, template_kwargs=kwargs)
    finally:
        tokenizer.chat_template = own


def test_bad_words_become_their_tokens_alone_and_after_a_space(tokenizer):
    from server.sampling import bad_words_token_ids
    seqs = bad_words_token_ids(["Paris", " hello world"], tokenizer)
    for word in ("Paris", " Paris", "hello world", " hello world"):
        ids = tuple(tokenizer.encode(word, add_special_tokens=False))
        assert ids in seqs
    assert len(seqs) == len(set(seqs)) == 4


PLAIN = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}" \
        "{% if add_generation_prompt %}[assistant] {% endif %}"


def test_a_chat_template_over_the_models_from_a_file_or_the_flag(smollm2_dir, tmp_path):
    from server.settings import ServerSettings
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    for flag in (str(path), PLAIN):
        source = ServerSettings(chat_template=flag).chat_template_source()
        tok = Tokenizer.from_folder(smollm2_dir, source)
        assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == \
            "[user] Hi\n[assistant] "
    assert ServerSettings().chat_template_source() is None
    long = "{# " + "x" * 600 + " #}" + PLAIN                  # no file name is that long
    assert ServerSettings(chat_template=long).chat_template_source() == long
    for bad, match in ((str(tmp_path / "missing.jinja"), "no file"),
                       ("{% for %}", "not valid Jinja")):
        with pytest.raises(ValueError, match=match):
            ServerSettings(chat_template=bad)


def test_a_requests_template_renders_that_request_alone(tokenizer):
    hi = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(hi, chat_template=PLAIN) == "[user] Hi\n[assistant] "
    assert tokenizer.apply_chat_template(hi).startswith("<|im_start|>system")
    with pytest.raises(TemplateError, match="not valid Jinja"):
        tokenizer.apply_chat_template(hi, chat_template="{{ messages[0 }}")


def _sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2-style vocabulary built here: BPE over "\u2581"-marked words with byte
    fallback, and the decoder that drops the first leading space."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "\u2581", "P", "a", "r", "i", "s", "\u2581P", "ar", "is", "\u2581Par", "\u2581Paris"]
    merges = [("\u2581", "P"), ("a", "r"), ("i", "s"), ("\u2581P", "ar"), ("\u2581Par", "is")]
    backend = HFTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges,
                                     unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend)


def test_sentencepiece_tokens_keep_their_space_and_bytes():
    tok = _sentencepiece_tokenizer()
    ids = tok.encode("Paris é", add_special_tokens=False)
    assert tok.decode(ids) == "Paris é"
    # each token alone: its space kept ("\u2581Paris" is " Paris", as llama.cpp and OpenAI
    # show it; decoding it alone strips it), a fallback byte as that byte
    assert [tok.token_text(i) for i in ids][:2] == [" Paris", " "]
    assert bytes(b for i in ids for b in tok.token_bytes(i)).decode() == " Paris é"
    e_bytes = [tok.token_bytes(i) for i in ids[2:]]
    assert e_bytes == [[0xC3], [0xA9]]                      # é's two fallback bytes
    assert tok.token_text(ids[2]) == "\ufffd"               # half a character
    assert tok.token_text(2) == "</s>" and tok.token_bytes(2) == list(b"</s>")
