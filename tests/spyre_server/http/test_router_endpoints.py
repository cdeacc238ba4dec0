"""The endpoints routers call, in vLLM's shapes, on a real micro server: /tokenize, /detokenize,
/v1/*/render (exactly the ids the server runs), /get_load, /server_info, /version, and the
vllm:cache_config_info gauge."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.spyre_server.http.helpers import (
    BLOCK,
    MAX_MODEL_LEN,
    MODEL_NAME,
    USABLE_BLOCKS,
    MakeServer,
    Server,
    chat_prompt_ids,
    slow_down,
    unique_text,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é"}]


def test_tokenize_a_prompt_and_a_chat(micro_server: Server) -> None:
    http = micro_server.http()
    out = http.post("/tokenize", json={"prompt": "ab é", "return_token_strs": True}).json()
    assert out == {
        "count": 5,
        "max_model_len": MAX_MODEL_LEN,
        "tokens": [97, 98, 32, 195, 169],
        "token_strs": ["a", "b", "Ġ", "Ã", "©"],
    }
    chat = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()
    assert chat["tokens"] == chat_prompt_ids(MESSAGES)
    assert chat["count"] == len(chat["tokens"]) and chat["token_strs"] is None
    bare = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    assert bare.json()["tokens"] == list(b"system: Be brief.\nuser: Hi \xc3\xa9\n")


def test_detokenize_and_its_errors(micro_server: Server) -> None:
    http = micro_server.http()
    assert http.post("/detokenize", json={"tokens": [104, 195, 169]}).json() == {"prompt": "hé"}
    bad = http.post("/detokenize", json={"tokens": [256]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong_model = http.post("/tokenize", json={"model": "other", "prompt": "x"})
    assert wrong_model.status_code == 404
    assert wrong_model.json()["error"]["code"] == "model_not_found"


def test_render_returns_exactly_the_ids_the_server_runs(micro_server: Server) -> None:
    http = micro_server.http()
    prompts = [unique_text("render-a", 70), unique_text("render-b", 3)]
    rendered = http.post(
        "/v1/completions/render", json={"prompt": prompts, "max_tokens": 4, "seed": 3}
    ).json()
    assert [r["token_ids"] for r in rendered] == [list(p.encode()) for p in prompts]
    assert all(r["request_id"].startswith("cmpl-") and r["model"] == MODEL_NAME for r in rendered)
    assert rendered[0]["sampling_params"]["max_tokens"] == 4
    assert rendered[0]["sampling_params"]["seed"] == 3
    ran = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1}).json()
    assert ran["usage"]["prompt_tokens"] == sum(len(r["token_ids"]) for r in rendered)

    chat = http.post("/v1/chat/completions/render", json={"messages": MESSAGES}).json()
    assert chat["token_ids"] == chat_prompt_ids(MESSAGES)
    assert chat["request_id"].startswith("chatcmpl-") and chat["assistant_tokens_mask"] is None
    ran_chat = http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}
    ).json()
    assert ran_chat["usage"]["prompt_tokens"] == len(chat["token_ids"])
    too_long = http.post("/v1/completions/render", json={"prompt": "x" * MAX_MODEL_LEN})
    assert too_long.status_code == 400


def test_load_version_server_info_and_cache_config_info(micro_server: Server) -> None:
    http = micro_server.http()
    micro_server.wait_idle()
    assert http.get("/get_load").json() == {"load": 0}
    version = http.get("/version").json()["version"]
    assert isinstance(version, str) and version
    info = http.get("/server_info").json()
    assert info["block_size"] == BLOCK and info["num_blocks"] == USABLE_BLOCKS + 1
    assert info["model"] == MODEL_NAME and info["version"] == version
    assert info["kv_events"]["enabled"] is False
    assert info["kv_events"]["topic"].endswith(f"@{MODEL_NAME}")
    metrics = micro_server.metrics()
    assert (
        metrics.value(
            "vllm:cache_config_info",
            block_size=str(BLOCK),
            num_gpu_blocks=str(USABLE_BLOCKS + 1),
            enable_prefix_caching="True",
        )
        == 1
    )


def test_get_load_counts_the_requests_in_flight(make_server: MakeServer, monkeypatch: Any) -> None:
    server = make_server()
    slow_down(monkeypatch, server, 0.1)
    http = server.http()
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(http.post, "/v1/completions", json={"prompt": "ab", "max_tokens": 4})
            for _ in range(2)
        ]
        loads = []
        for _ in range(200):  # a bound on polling, never an assertion on time
            loads.append(http.get("/get_load").json()["load"])
            if loads[-1] == 2:
                break
        assert 2 in loads, loads
        assert all(f.result().status_code == 200 for f in futures)
    server.wait_idle()
    assert http.get("/get_load").json() == {"load": 0}
