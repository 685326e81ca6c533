"""LoRA adapters over HTTP (`--lora-modules`, vLLM's multi-LoRA serving) with the official
openai SDK: /v1/models lists each adapter with its base model; a request names its adapter
in `model` and gets the adapter's answer (not the base model's), named so in the response,
on chat, completions and embeddings; the base model's cached prompt pages are not read by an
adapter's request; an unknown name is a 404, and a folder that is no adapter stops the
server at start-up."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.model_config import ModelConfig
from tests.server_helpers import MODEL, openai_client, running_server

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def adapter(smollm2_dir, tmp_path_factory):
    """A random rank-8 adapter of the bundled model's q, v and down projections."""
    from safetensors.torch import save_file
    cfg = ModelConfig.from_hf(smollm2_dir)
    folder = tmp_path_factory.mktemp("adapter")
    g = torch.Generator().manual_seed(0)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"self_attn.q_proj": (q, cfg.hidden_size), "self_attn.v_proj": (kv, cfg.hidden_size),
              "mlp.down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for name, (out, inp) in shapes.items():
            prefix = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, inp, generator=g) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, 8, generator=g) * 0.1
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16,
         "target_modules": ["q_proj", "v_proj", "down_proj"]}))
    return folder


@pytest.fixture(scope="module")
def client(adapter):
    with running_server("--max-model-len", "1024", "--lora-modules",
                        f"sql-lora={adapter}") as s:
        yield openai_client(s.url)


def test_models_list_the_adapter_beside_its_base(client, adapter):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "sql-lora"}
    lora = client.models.retrieve("sql-lora")
    assert (lora.parent, lora.root) == (MODEL, str(adapter))
    assert cards[MODEL].model_extra.get("parent") is None


def test_a_request_naming_the_adapter_gets_its_answer(client):
    def answer(model, **kw):
        return client.chat.completions.create(model=model, messages=ASK, max_tokens=16,
                                              temperature=0.0, **kw)
    base, lora = answer(MODEL), answer("sql-lora")
    assert lora.model == "sql-lora" and base.model == MODEL
    assert lora.choices[0].message.content != base.choices[0].message.content
    assert lora.usage.prompt_tokens_details.cached_tokens == 0    # not the base model's pages
    again = answer("sql-lora")
    assert again.choices[0].message.content == lora.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0    # its own pages
    chunks = list(answer("sql-lora", stream=True))
    assert {c.model for c in chunks} == {"sql-lora"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == lora.choices[0].message.content


def test_completions_and_embeddings_take_the_adapter_too(client):
    kw = dict(prompt="The colour of the sky is", max_tokens=8, temperature=0.0)
    base = client.completions.create(model=MODEL, **kw)
    lora = client.completions.create(model="sql-lora", **kw)
    assert lora.model == "sql-lora" and lora.choices[0].text != base.choices[0].text
    vb = client.embeddings.create(model=MODEL, input="blue sky").data[0].embedding
    e = client.embeddings.create(model="sql-lora", input="blue sky")
    assert e.model == "sql-lora"
    cosine = sum(a * b for a, b in zip(vb, e.data[0].embedding))
    assert cosine < 0.999


def test_an_unknown_adapter_is_a_404(client):
    import openai
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-lora", messages=ASK, max_tokens=2)


def test_a_folder_that_is_no_adapter_stops_the_server(tmp_path, adapter):
    r = subprocess.run([sys.executable, "-m", "server", "serve", "--port", "1",
                        "--lora-modules", f"x={tmp_path}"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "adapter_config.json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "server", "serve", "--port", "1",
                        "--lora-modules", f"{MODEL}={adapter}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "served model's name" in r.stderr


def test_adapters_load_and_unload_while_serving(adapter, tmp_path):
    import httpx
    import openai
    with running_server("--max-model-len", "1024", "--allow-runtime-lora") as s:
        client, url = openai_client(s.url), s.url + "/v1"
        assert [m.id for m in client.models.list().data] == [MODEL]
        r = httpx.post(f"{url}/load_lora_adapter",
                       json={"lora_name": "late", "lora_path": str(adapter)}, timeout=60)
        assert r.status_code == 200 and "late" in r.text, r.text
        assert [m.id for m in client.models.list().data] == [MODEL, "late"]
        answer = client.chat.completions.create(model="late", messages=ASK, max_tokens=8,
                                                temperature=0.0)
        assert answer.model == "late" and answer.choices[0].message.content
        for body, status, param in (
                ({"lora_name": "late", "lora_path": str(adapter)}, 400, "lora_name"),  # loaded
                ({"lora_name": MODEL, "lora_path": str(adapter)}, 400, "lora_name"),
                ({"lora_name": "x", "lora_path": str(tmp_path)}, 400, "lora_path")):
            r = httpx.post(f"{url}/load_lora_adapter", json=body, timeout=60)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
        r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="late", messages=ASK, max_tokens=2)
        r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


def test_runtime_loading_is_off_unless_asked_for(client):
    import httpx
    base = str(client.base_url).rstrip("/")
    r = httpx.post(f"{base}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"})
    assert r.status_code == 404


def test_metrics_count_each_adapters_requests(client):
    import httpx

    from tests.server_helpers import read_metric
    base = str(client.base_url).rstrip("/").removesuffix("/v1")

    def running():
        text = httpx.get(base + "/metrics", timeout=10).text
        return read_metric(text, "strata_lora_requests", 'adapter="sql-lora",state="running"')
    assert running() == 0
    stream = client.chat.completions.create(model="sql-lora", messages=ASK, max_tokens=200,
                                            temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True})
    next(iter(stream))                     # the first chunk: the request is running
    assert running() == 1
    stream.close()
    import time
    deadline = time.time() + 10
    while running() != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert running() == 0
