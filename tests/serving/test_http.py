"""The OpenAI-compatible HTTP API, driven by the official `openai` package against one live server on
the default model (SmolLM2-135M-Instruct) with its three demo adapters, gRPC beside it on the same
engine. One server for the whole module (start-up is model load plus warm-up); its last test drains it.

The demo adapters show at a glance which one answered: `shout` in capitals, `json` as
{"answer": ...}, `pirate` opening with "Ahoy". Two device slots for three adapters, so requests
page adapters in and evict them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import json
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import jax.numpy as jnp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxlora.adapters import Pager
from jaxlora.cli.main import main as jaxlora_main
from jaxlora.config import LoraConfig
from jaxlora.engine import Engine, EngineConfig
from jaxlora.loading import load_model
from serving.client import InferenceClient
from serving.options import ServerOptions
from serving.server import InferenceServer, build_server
from tests.serving.support import wait_until

REPO = Path(__file__).resolve().parents[2]
DEMO = ("json", "pirate", "shout")
BASE = "SmolLM2-135M-Instruct"
USER_KEY, ADMIN_KEY = "user-key", "admin-key"
QUESTION = "Name a fruit."
TEXT_PROMPT = "The capital of France is"  # raw text for /v1/completions (QUESTION alone ends at once)
ANSWER_TOKENS = 6
MAX_STREAMS = 4
LORA = LoraConfig(max_slots=3, max_rank=8)  # two adapter slots for three adapters
CONFIG = EngineConfig(
    max_batch=4, max_seq_len=256, token_budgets=(64,), page_size=16, max_new_tokens_limit=64, max_queue=16, lora=LORA
)


@dataclasses.dataclass
class Live:
    server: InferenceServer
    engine: Engine
    adapter_root: Path
    cli_text: str  # `jaxlora generate --use shout --prompt QUESTION` on this engine, before serving
    warming_error: Exception  # a completion sent before warm-up ended
    warming_health: int

    def client(self, key: str = USER_KEY) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.server.http_port}/v1", api_key=key, max_retries=0, timeout=300
        )

    def grpc_client(self) -> InferenceClient:
        return InferenceClient(f"127.0.0.1:{self.server.port}", api_key=ADMIN_KEY, timeout=300)


@pytest.fixture(scope="module")
def live(smollm2_gguf_path, tmp_path_factory) -> Live:
    root = tmp_path_factory.mktemp("adapter_root")
    for name in DEMO:
        shutil.copytree(REPO / "checkpoints" / "demo" / name, root / name)
    model, tokenizer = load_model(None, dtype=jnp.float32)
    pager = Pager(model.config, LORA, dtype=model.dtype)
    for name in DEMO:
        pager.register(name, root / name)
    engine = Engine(model, tokenizer, CONFIG, pager)
    cli_text = _cli_generate(engine, root)  # also warms the engine up
    server, _ = build_server(
        engine,
        ServerOptions(
            port=0,
            http_port=0,
            metrics_port=0,
            api_key=USER_KEY,
            admin_key=ADMIN_KEY,
            adapter_roots=(str(root),),
            max_concurrent_streams=MAX_STREAMS,
            model_name=BASE,
        ),
    )
    server.start()
    try:
        live = Live(server, engine, root, cli_text, warming_error=None, warming_health=_get(server, "/health")[0])
        with pytest.raises(openai.APIStatusError) as warming:
            live.client().completions.create(model=BASE, prompt="too early", max_tokens=2)
        live.warming_error = warming.value
        server.warm_up()
        yield live
    finally:
        server.shutdown(grace_seconds=0)


def _cli_generate(engine: Engine, root: Path) -> str:
    """What `jaxlora generate --temperature 0` prints for QUESTION with `shout`, run on `engine` (its warm-up is the
    CLI's, so the module pays for one)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr("jaxlora.cli.engine_args.engine_from_args", lambda args, *a, **kw: engine)
        assert (
            jaxlora_main(
                [
                    "generate",
                    "--adapter",
                    f"shout={root / 'shout'}",
                    "--use",
                    "shout",
                    "--prompt",
                    QUESTION,
                    "--max-tokens",
                    str(ANSWER_TOKENS),
                    "--temperature",  # generate samples at 1 by default (OpenAI's); the API call is greedy
                    "0",
                ]
            )
            == 0
        )
    return out.getvalue().removesuffix("\n")


def _get(server: InferenceServer, path: str, port: int | None = None) -> tuple[int, str]:
    url = f"http://127.0.0.1:{port or server.http_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _ask(
    client: openai.OpenAI,
    *,
    chat: bool,
    model: str,
    stream: bool,
    max_tokens: int = ANSWER_TOKENS,
    prompt: str = QUESTION,
) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of one greedy request; a stream is joined from its chunks."""
    kw = dict(model=model, max_tokens=max_tokens, temperature=0)
    if chat:
        kw["messages"] = [{"role": "user", "content": prompt}]
    else:
        kw["prompt"] = prompt
    create = client.chat.completions.create if chat else client.completions.create
    if not stream:
        r = create(**kw)
        choice = r.choices[0]
        assert r.model == model and r.object == ("chat.completion" if chat else "text_completion")
        return (choice.message.content if chat else choice.text), choice.finish_reason, r.usage.model_dump()
    texts, finish, usage = [], None, None
    for c in create(**kw, stream=True, stream_options={"include_usage": True}):
        if c.usage is not None:
            usage = c.usage.model_dump()
            continue
        choice = c.choices[0]
        texts.append((choice.delta.content or "") if chat else choice.text)
        finish = choice.finish_reason or finish
    return "".join(texts), finish, usage


def _metrics(live: Live, port: int | None = None) -> dict[tuple[str, frozenset], float]:
    status, text = _get(live.server, "/metrics", port)
    assert status == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _resident(samples: dict, adapter: str, tier: str) -> float:
    return samples[("jaxlora_adapter_resident", frozenset({("adapter", adapter), ("tier", tier)}))]


def _load_state(samples: dict) -> dict[str, tuple[str, str]]:
    """adapter -> (level, pinned) of `vllm:lora_adapter_loaded`, whose series must all be 1 and carry
    the adapter's rank."""
    state = {}
    for (name, labels), value in samples.items():
        if name == "vllm:lora_adapter_loaded":
            labels = dict(labels)
            assert value == 1 and labels["rank"] == str(_peft_rank(labels["adapter_name"]))
            state[labels["adapter_name"]] = (labels["level"], labels["pinned"])
    return state


def _peft_rank(adapter: str) -> int:
    return json.loads((REPO / "checkpoints" / "demo" / adapter / "adapter_config.json").read_text())["r"]


def _lora_info(samples: dict) -> dict[str, str]:
    [labels] = [dict(k[1]) for k in samples if k[0] == "vllm:lora_requests_info"]
    return labels


def test_warming_up_answers_503(live):
    assert isinstance(live.warming_error, openai.InternalServerError)
    assert live.warming_error.status_code == 503 and "warming up" in live.warming_error.message
    assert live.warming_health == 503 and _get(live.server, "/health") == (200, '{"status":"serving"}')


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_and_whole_answers_with_and_without_adapter(live, chat):
    cases = [(model, stream) for model in (BASE, "shout") for stream in (False, True)]
    prompt = QUESTION if chat else TEXT_PROMPT
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = dict(
            zip(
                cases, pool.map(lambda c: _ask(live.client(), chat=chat, model=c[0], stream=c[1], prompt=prompt), cases)
            )
        )
    for model in (BASE, "shout"):
        whole, streamed = answers[(model, False)], answers[(model, True)]
        assert whole == streamed, model  # same text, finish reason and usage (the last stream chunk)
        text, finish, usage = whole
        assert text and finish in ("stop", "length") and usage["completion_tokens"] <= ANSWER_TOKENS, answers
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert answers[(BASE, False)][0] != answers[("shout", False)][0], answers
    if chat:
        shout = answers[("shout", False)][0]
        assert shout == live.cli_text, "the API's greedy answer differs from `jaxlora generate`'s"
        assert shout.upper() == shout


def test_models_lists_the_base_model_and_every_adapter(live):
    models = {m.id: m for m in live.client().models.list()}
    assert set(models) == {BASE, *DEMO}
    assert models[BASE].parent is None and all(models[a].parent == BASE for a in DEMO)
    assert models[BASE].owned_by == "jaxlora"


def test_concurrent_streams_on_different_adapters(live):
    models = (*DEMO, BASE)
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        texts = dict(
            zip(
                models, (a[0] for a in pool.map(lambda m: _ask(live.client(), chat=True, model=m, stream=True), models))
            )
        )
    assert texts["shout"].upper() == texts["shout"]
    assert texts["json"].startswith('{"answer"')
    assert texts["pirate"].startswith("Ahoy")
    assert not texts[BASE].startswith(("Ahoy", "{")) and texts[BASE].upper() != texts[BASE]


def _completion(client: openai.OpenAI, **kw):
    """A short greedy completion (OpenAI's default temperature of 1 could sample EOS early)."""
    return client.completions.create(**{"model": BASE, "prompt": "hi", "max_tokens": 2, "temperature": 0, **kw})


@pytest.mark.parametrize(
    "kw, error, param",
    [
        (dict(model="no-such-adapter"), openai.NotFoundError, "model"),
        (dict(temperature=-1), openai.BadRequestError, "temperature"),
        (dict(top_p=1.5), openai.BadRequestError, "top_p"),
        (dict(max_tokens=65), openai.BadRequestError, "max_tokens"),  # above the engine limit
        (
            dict(max_tokens=None, extra_body={"max_completion_tokens": 0}),
            openai.BadRequestError,
            "max_completion_tokens",
        ),
        (dict(extra_body={"top_k": 10**6}), openai.BadRequestError, "top_k"),  # above the vocabulary
        (dict(n=2), openai.BadRequestError, "n"),
        (dict(prompt="fruit " * 300), openai.BadRequestError, "prompt"),  # longer than max_seq_len
        (dict(stop=[""]), openai.BadRequestError, "stop"),
    ],
)
def test_request_errors(live, kw, error, param):
    with pytest.raises(error) as e:
        _completion(live.client(), **kw)
    assert e.value.body["param"] == param, e.value.message


def test_unknown_chat_model_and_bad_messages(live):
    client = live.client()
    with pytest.raises(openai.NotFoundError, match="no-such-adapter"):
        client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
    assert e.value.body["param"] == "messages"


def test_keys(live):
    for key in ("wrong", ADMIN_KEY):
        client = live.client(key)
        if key == "wrong":
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        else:  # the admin key works for everything
            assert BASE in {m.id for m in client.models.list()}
    with pytest.raises(openai.PermissionDeniedError, match="admin key"):  # a user key cannot load adapters
        live.client().post("/load_lora_adapter", body={"lora_name": "x", "lora_path": "shout"}, cast_to=str)
    status, body = _get(live.server, "/v1/models")  # no key at all
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    assert _get(live.server, "/health")[0] == 200 and _get(live.server, "/metrics")[0] == 200  # no key needed


def test_adapter_admin_errors(live, tmp_path):
    admin = live.client(ADMIN_KEY)

    def load(name: str, path: str):
        return admin.post("/load_lora_adapter", body={"lora_name": name, "lora_path": path}, cast_to=str)

    shutil.copytree(live.adapter_root / "shout", tmp_path / "outside")
    with pytest.raises(openai.PermissionDeniedError, match="outside every adapter root"):
        load("evil", str(tmp_path / "outside"))
    with pytest.raises(openai.PermissionDeniedError, match="'..'"):
        load("evil", "../outside")
    with pytest.raises(openai.NotFoundError):
        load("nope", "no-such-folder")
    with pytest.raises(openai.ConflictError, match="already loaded"):
        load("shout", "shout")
    with pytest.raises(openai.ConflictError, match="base model"):
        load(BASE, "shout")
    with pytest.raises(openai.BadRequestError) as e:
        admin.post("/load_lora_adapter", body={"lora_name": "x"}, cast_to=str)
    assert e.value.body["param"] == "lora_path"
    with pytest.raises(openai.NotFoundError):
        admin.post("/unload_lora_adapter", body={"lora_name": "never-loaded"}, cast_to=str)


def test_stream_limit_answers_429(live):
    client = live.client()
    streams = [
        client.completions.create(model=BASE, prompt=f"hold {i}", max_tokens=64, stream=True)
        for i in range(MAX_STREAMS)
    ]  # each holds a place from its response's start
    try:
        with pytest.raises(openai.RateLimitError, match="too many streams"):
            _completion(client)
    finally:
        for s in streams:
            s.close()
    wait_until(lambda: live.server.admission.num_streams == 0)
    assert _completion(client).usage.completion_tokens == 2


def test_a_client_that_disconnects_frees_its_row(live):
    cancelled = live.engine.stats()["cancelled"]
    stream = live.client().chat.completions.create(
        model="pirate", messages=[{"role": "user", "content": QUESTION}], max_tokens=64, temperature=0, stream=True
    )
    assert next(c for c in stream if c.choices[0].delta.content)  # a token arrived: it holds a row
    stream.close()
    wait_until(lambda: live.engine.stats()["cancelled"] == cancelled + 1)
    wait_until(lambda: live.engine.stats()["running"] == 0 and not live.engine.pager.snapshot()["refcounts"])
    assert live.server.admission.num_streams == 0


def test_one_registry_for_http_and_grpc(live):
    admin = live.client(ADMIN_KEY)
    chat = [{"role": "user", "content": QUESTION}]
    with live.grpc_client() as rpc:
        # Loaded over HTTP, used and unloaded over gRPC.
        admin.post("/load_lora_adapter", body={"lora_name": "pirate-2", "lora_path": "pirate"}, cast_to=str)
        assert rpc.generate(messages=chat, adapter="pirate-2", temperature=0, max_tokens=4).text.startswith("Ahoy")
        rpc.unload_adapter("pirate-2")
        assert "pirate-2" not in {m.id for m in admin.models.list()}
        with pytest.raises(openai.NotFoundError):
            _completion(admin, model="pirate-2")
        # Loaded over gRPC, used and unloaded over HTTP.
        rpc.load_adapter("json-2", "json")
        answer = admin.chat.completions.create(model="json-2", messages=chat, max_tokens=4, temperature=0)
        assert answer.choices[0].message.content.startswith('{"')
        admin.post("/unload_lora_adapter", body={"lora_name": "json-2"}, cast_to=str)
        assert "json-2" not in {a.name for a in rpc.list_adapters()}
        with pytest.raises(grpc.RpcError) as e:
            rpc.generate("x", adapter="json-2", temperature=0, max_tokens=2)
        assert e.value.code() is grpc.StatusCode.NOT_FOUND


def test_metrics_show_adapters_paged_in_and_evicted(live):
    client = live.client()
    before = _metrics(live)
    for model in ("shout", "pirate"):  # two slots: these two are on the device, json is not
        _ask(client, chat=True, model=model, stream=False, max_tokens=1)
    middle = _metrics(live)
    assert [_resident(middle, a, "device") for a in ("shout", "pirate", "json")] == [1, 1, 0]
    _ask(client, chat=True, model="json", stream=False, max_tokens=1)  # evicts shout, the least recently used
    after = _metrics(live)
    assert [_resident(after, a, "device") for a in ("shout", "pirate", "json")] == [0, 1, 1]
    assert all(_resident(after, a, "host") == 1 for a in DEMO)
    count = ("jaxlora_adapter_page_in_seconds_count", frozenset({("tier", "device")}))
    assert after[count] >= before[count] + 1 and after[
        ("jaxlora_adapter_page_in_seconds_count", frozenset({("tier", "host")}))
    ] >= len(DEMO)
    assert _lora_info(after)["max_lora"] == "2"
    assert _load_state(middle) == {"shout": ("gpu", "false"), "pirate": ("gpu", "false"), "json": ("cpu", "false")}
    assert _load_state(after) == {"shout": ("cpu", "false"), "pirate": ("gpu", "false"), "json": ("gpu", "false")}
    assert after[("vllm:num_gpu_loaded_lora_adapters", frozenset())] == 2
    assert after[("vllm:max_gpu_lora_adapters", frozenset())] == 2
    [cache] = [dict(k[1]) for k in after if k[0] == "vllm:cache_config_info"]
    assert cache == {"block_size": str(CONFIG.page_size), "num_gpu_blocks": str(live.engine.pages.num_pages)}
    assert after[("vllm:kv_cache_usage_perc", frozenset())] == 0  # idle: every page is free
    # A running request's adapter is listed the way vLLM lists it, on both metrics endpoints.
    stream = client.chat.completions.create(
        model="json", messages=[{"role": "user", "content": QUESTION}], max_tokens=64, temperature=0, stream=True
    )
    try:
        assert next(c for c in stream if c.choices[0].delta.content)
        for port in (live.server.http_port, live.server.metrics_port):
            samples = _metrics(live, port)
            assert _lora_info(samples)["running_lora_adapters"] == "json"
            assert _resident(samples, "json", "device") == 1
            assert samples[("vllm:num_requests_running", frozenset())] == 1
            assert _load_state(samples)["json"] == ("gpu", "true")  # its running request pins it
            assert 0 < samples[("vllm:kv_cache_usage_perc", frozenset())] < 1
            # json's question a second time: the prompt's full pages come from the prefix cache.
            hits, queries = (samples[(f"vllm:prefix_cache_{k}_total", frozenset())] for k in ("hits", "queries"))
            assert 0 < hits < queries and ("jaxlora_prefix_cache_evictions_total", frozenset()) in samples
    finally:
        stream.close()


def test_drain_answers_503_and_lets_streams_finish(live):
    """Last: the module's server stops serving here."""
    client = live.client()
    running = client.completions.create(model="shout", prompt=QUESTION, max_tokens=12, temperature=0, stream=True)
    first = next(running)
    drain = threading.Thread(target=live.server.drain, kwargs=dict(grace_seconds=120))
    drain.start()
    wait_until(lambda: _get(live.server, "/health")[0] == 503)
    with pytest.raises(openai.InternalServerError, match="shutting down") as e:
        _completion(client)
    assert e.value.status_code == 503
    chunks = [first, *running]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")  # finished within the grace period
    drain.join(120)
    assert not drain.is_alive()
