"""--chat-template and --trust-request-chat-template through the server: the flag's template
renders every chat (generation, /tokenize, /render), and a request's own `chat_template`
renders that request alone where the server trusts it (a 400 where it does not)."""
from __future__ import annotations

import pytest

from tests.server_helpers import MODEL, openai_client, running_server

pytestmark = pytest.mark.slow

SERVER_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                   "assistant\n{% endif %}")                   # ChatML without a system turn
OWN = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(SERVER_TEMPLATE)
    with running_server("--chat-template", str(path), "--trust-request-chat-template") as s:
        yield s


def rendered(http, **body) -> str:
    r = http.post("/v1/tokenize", json={"messages": HI, **body})
    assert r.status_code == 200, r.text
    return http.post("/v1/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]


def test_the_flags_template_renders_every_chat(server, http):
    assert rendered(http) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": HI})
    tokens = http.post("/v1/tokenize", json={"messages": HI}).json()["tokens"]
    assert ids.json()["token_ids"] == tokens
    r = openai_client(server.url).chat.completions.create(model=MODEL, messages=HI,
                                                          max_tokens=1)
    assert r.usage.prompt_tokens == len(tokens)


def test_a_trusted_requests_template_renders_it_alone(server, http):
    assert rendered(http, chat_template=OWN) == "HI THERE"
    r = openai_client(server.url).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1, extra_body={"chat_template": OWN})
    assert r.usage.prompt_tokens == len(http.post("/v1/tokenize", json={
        "prompt": "HI THERE", "add_special_tokens": False}).json()["tokens"])
    bad = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI,
                                                   "chat_template": "{{ messages[0 }}"})
    assert bad.status_code == 400 and "Jinja" in bad.json()["error"]["message"]
    assert rendered(http).startswith("<|im_start|>user")        # the next request: the flag's
