"""The OpenAI-compatible API, with the official `openai` SDK as the client, through real servers.

Every answer is compared with what `batchstring()` returns for the same prompt (greedy decoding
is batch-invariant, so the two paths must agree exactly), not only checked for shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request

import openai
import pytest

from batchstring.frontdoor.gateway.auth import ENV
from batchstring.server.local import free_ports
from tests.conftest import FRONTDOOR

PROMPTS = ["def parse(line):\n    ", "import os\nimport ", "class Config:\n    def __init__(self"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}def answer():\n    return{% endif %}")
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(sdk):
    assert [m.id for m in sdk.models.list().data] == ["llm"]


def test_completions_equal_batchstring_for_one_prompt_and_a_list(sdk, client):
    expected = client.complete(PROMPTS, max_tokens=10)
    one = sdk.completions.create(model="llm", prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert one.choices[0].text == expected[0].text and one.choices[0].finish_reason == expected[0].finish_reason
    assert one.usage.prompt_tokens == expected[0].prompt_tokens and one.usage.completion_tokens == 10
    many = sdk.completions.create(model="llm", prompt=PROMPTS, max_tokens=10, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [e.text for e in expected]
    assert many.usage.total_tokens == sum(e.prompt_tokens + e.completion_tokens for e in expected)


def test_stop_echo_and_logprobs(sdk, client):
    full = client.batchstring([PROMPTS[0]], max_tokens=12)[0]
    stop = full[3:5]
    cut = sdk.completions.create(model="llm", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop)
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    echoed = sdk.completions.create(model="llm", prompt=PROMPTS[0], max_tokens=12, temperature=0, echo=True,
                                    logprobs=2)
    assert echoed.choices[0].text == PROMPTS[0] + full
    lp = echoed.choices[0].logprobs
    assert "".join(lp.tokens) == full and len(lp.token_logprobs) == 12
    assert lp.text_offset[0] == len(PROMPTS[0]) and all(len(top) <= 2 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)


def test_a_streamed_completion_is_the_same_text_with_usage_last(sdk, client):
    expected = client.complete(PROMPTS, max_tokens=10)
    stream = sdk.completions.create(model="llm", prompt=PROMPTS, max_tokens=10, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    texts, reasons, usage = ["", "", ""], {}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == [e.text for e in expected]
    assert reasons == {i: e.finish_reason for i, e in enumerate(expected)}
    assert usage.completion_tokens == sum(e.completion_tokens for e in expected)


def test_errors_have_openai_shape_and_status(sdk, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        sdk.completions.create(model="llm", prompt="x", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\]: .*text_input is empty"):
        sdk.completions.create(model="llm", prompt=["fine", ""], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="best_of is not supported"):
        sdk.completions.create(model="llm", prompt="x", max_tokens=2, best_of=2)
    with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 16\]"):
        sdk.completions.create(model="llm", prompt="x", max_tokens=2, n=17)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        sdk.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.APIStatusError) as too_big:
        sdk.completions.create(model="llm", prompt="x" * (2 << 20), max_tokens=2)
    assert too_big.value.status_code == 413 and "1048576 bytes" in too_big.value.message
    assert server.model_ready()


@pytest.fixture(scope="module")
def keyed(server, tmp_path_factory):
    """A second front door on the same tritonserver: a chat template, and API keys required."""
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(TEMPLATE)
    http, grpc_port, metrics = free_ports()
    sockets = server.sockets
    env = {**os.environ, ENV: f"other-key,{KEY}"}
    door = subprocess.Popen([*FRONTDOOR, "--http-port", str(http), "--grpc-port", str(grpc_port),
                             "--metrics-port", str(metrics), "--triton-http", str(sockets.http),
                             "--triton-grpc", sockets.grpc_target, "--triton-metrics", str(sockets.metrics),
                             "--chat-template", str(template), "--data-dir", str(tmp_path_factory.mktemp("data"))],
                            env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/v2/models/llm/ready", timeout=2)  # probes need no key
            break
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline and door.poll() is None, "the front door did not start"
            time.sleep(0.2)
    yield url, f"127.0.0.1:{grpc_port}"
    door.terminate()
    door.wait(10)


def test_without_the_key_every_inference_route_says_401(keyed):
    url, grpc_url = keyed
    anonymous = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="requires an API key"):
        anonymous.completions.create(model="llm", prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    request = urllib.request.Request(f"{url}/v2/models/llm/generate", data=b'{"text_input": "x"}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ModelReady(service_pb2.ModelReadyRequest(name="llm"), timeout=10).ready  # health: open
        with pytest.raises(grpc.RpcError) as denied:
            stub.ModelInfer(service_pb2.ModelInferRequest(model_name="llm"), timeout=10)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_chat_completions_render_the_template_and_stream(keyed, client):
    url, _ = keyed
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add two numbers."}]
    prompt = "# system: Be brief.\n# user: Add two numbers.\ndef answer():\n    return"
    expected = client.complete([prompt], max_tokens=8)[0]
    reply = sdk.chat.completions.create(model="llm", messages=messages, max_tokens=8, temperature=0)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    streamed = sdk.chat.completions.create(model="llm", messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.text


def test_the_sse_wire_format_ends_with_done(server):
    body = json.dumps({"model": "llm", "prompt": "def f():", "max_tokens": 3, "stream": True}).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


BAD_BODIES = [  # (body, the field the error names, what it says)
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    (json.dumps({"model": "llm", "prompt": [1, 2, 3]}).encode(), "prompt", "token ids"),
    (json.dumps({"model": "llm", "prompt": []}).encode(), "prompt", "non-empty list"),
    (json.dumps({"model": "llm", "prompt": ["x"] * 257}).encode(), "prompt", "at most 256"),
    (json.dumps({"model": "llm", "prompt": "x", "stop": 5}).encode(), "stop", "string or a list"),
    (json.dumps({"model": "llm", "prompt": "x", "logprobs": 21}).encode(), "logprobs", "[0, 20]"),
    (json.dumps({"model": "llm", "prompt": "x", "stream": "yes"}).encode(), "stream", "true or false"),
    (json.dumps({"model": "llm", "prompt": "x", "suffix": "y"}).encode(), "suffix", "not supported"),
    (json.dumps({"model": "llm", "prompt": "x", "presence_penalty": 5}).encode(), None, "presence_penalty"),
    (json.dumps({"model": "llm", "prompt": "x", "guided_json": {"type": "object"}, "guided_regex": "a"}).encode(),
     "guided_json", "one output constraint"),
    (json.dumps({"model": "llm", "prompt": "x", "response_format": {"type": "xml"}}).encode(), "response_format",
     "json_schema"),
    (json.dumps({"model": "llm", "prompt": "x", "temperature": -1}).encode(), None, "temperature"),
    (json.dumps({"model": "llm", "prompt": "\ud800"}).encode(), "prompt", "lone surrogates"),
]


@pytest.mark.parametrize("body, param, says", BAD_BODIES, ids=[b[2] for b in BAD_BODIES])
def test_bad_bodies_get_a_400_that_names_the_field_and_the_server_stays_up(server, client, body, param, says):
    request = urllib.request.Request(f"http://{server.http_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(refused.value.read())["error"]
    assert refused.value.code == 400 and error["type"] == "invalid_request_error" and says in error["message"]
    assert param is None or error["param"] == param
    assert client.batchstring(["def still_fine():"], max_tokens=2)[0]


def test_chat_messages_of_the_wrong_shape_get_a_400(keyed):
    url, _ = keyed
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    for messages, says in (([], "non-empty list"), ([{"content": "hi"}], "string role"),
                           ([{"role": "user", "content": [{"type": "image_url"}]}], "text only")):
        with pytest.raises(openai.BadRequestError, match=says):
            sdk.chat.completions.create(model="llm", messages=messages, max_tokens=2)


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_n_gives_distinct_choices_that_repeat_on_every_run(sdk, keyed, stream):
    """Choice j of a prompt samples from seed + j: n different samples, the same ones each run, on
    every route that takes n (chat on the front door with a chat template); without a seed they
    still differ."""
    chat_sdk = openai.OpenAI(base_url=f"{keyed[0]}/v1", api_key=KEY, max_retries=0)

    def texts(**body) -> list[list[str]]:
        chat = body.pop("chat", False)
        if chat:
            calls = chat_sdk.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=12, temperature=1.0, stream=stream, **body)
        else:
            calls = sdk.completions.create(model="llm", max_tokens=12, temperature=1.0, stream=stream, **body)
        chunks = list(calls) if stream else [calls]
        by_index: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                piece = (choice.delta.content if stream else choice.message.content) if chat else choice.text
                by_index[choice.index] = by_index.get(choice.index, "") + (piece or "")
        return [by_index[i] for i in sorted(by_index)]

    for seed in (7, 123):
        first = texts(prompt="def shuffle(items):\n    ", n=4, seed=seed)
        assert len(set(first)) == 4, f"seed {seed}: 4 distinct samples, not copies: {first}"
        assert texts(prompt="def shuffle(items):\n    ", n=4, seed=seed) == first, "the same 4 on a second run"
        assert texts(prompt="def shuffle(items):\n    ", n=1, seed=seed) == first[:1], "choice 0 is the n = 1 request"
    two = texts(prompt=["a = ", "def b():\n    "], n=2, seed=3)
    assert len(two) == 4 and two[0] != two[1] and two[2] != two[3]
    assert texts(prompt=["a = ", "def b():\n    "], n=2, seed=3) == two
    chat = texts(chat=True, n=3, seed=11)
    assert len(set(chat)) == 3 and texts(chat=True, n=3, seed=11) == chat
    assert len(set(texts(prompt="def shuffle(items):\n    ", n=4))) > 1, "unseeded choices differ too"
