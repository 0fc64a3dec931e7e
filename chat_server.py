"""Loopback OpenAI / Anthropic / Responses server that records every request as token-exact segments.

    server = ChatServer(generator, tokenizer_path, ChatArgs()); base_url = await server.start()
    ep = server.open_episode()      # Episode: .api_key, .openai_base_url, .anthropic_base_url for a stock SDK
    segments = server.close_episode(ep.id)   # list[Segment]: token_ids, action_mask, logprobs, versions (T,)
Reading order: the chat template as token ids (ChatTemplate, shared with agent.py) -> the canonical request -> the
matcher, this file's one idea: a request is EXTEND / CONTINUE (a prefill) / RETRY / REWRITE / UNRELATED against the
episode's segments, and an EXTEND appends the stored sampled ids, a bridge and the delta tokens of the new messages
(mask 0), never a re-render; going on from inside a segment branches it. Below the machinery banner: Hermes/<think>
parsing, the start-up template check, one section per wire format, then HTTP (ChatServer.parse and WRITERS: the only
protocol switches). Streams are "fake": one engine call, then a protocol-exact SSE sequence. Constrained turns are
marked in Segment.info["constrained"]. Not here: sampling settings (--rollout.*), stateful Responses and Anthropic
threads, remote images, admin HTTP routes."""
import asyncio
import base64
import bisect
import functools
import gc
import io
import json
import logging
import math
import os
import re
import secrets
import sys
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field, replace

import uvicorn
from jinja2 import TemplateError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from generator import Completion, ConstraintError, Segment, decode_image, sampled_record, segment_routing

log = logging.getLogger("chat_server")
APPEND_ROLES = ("tool", "user", "system")


@dataclass
class ChatArgs:
    model_name: str = field(default="", metadata={
        "help": "model id /v1/models lists and --chat.strict_model accepts; empty: the tokenizer directory's name"})
    strict_model: bool = field(default=False, metadata={"help": "404 if a request names another model; False: echo it"})
    max_body_mb: int = field(default=32, metadata={"help": "413 for request bodies larger than this many MiB"})
    context_window: int | None = field(default=None, metadata={
        "help": "prompt + completion tokens at most; unset: the generator's --vllm.max_model_len"})
    default_max_tokens: int | None = field(default=None, metadata={
        "help": "completion tokens when a request sets none (OpenAI, Responses); unset: the rest of the window"})
    max_tokens_cap: int | None = field(default=None, metadata={"help": "cap on any request's max_tokens; unset: none"})
    reject_sampling_changes: bool = field(default=True, metadata={
        "help": "400 on n>1, logit_bias, penalties; False: ignore them, count chat/ignored_params"})
    refuse_constrained: bool = field(default=False, metadata={
        "help": "400 on constrained decoding (tool_choice required or named, JSON formats); False: sample under the "
                "constraint, count chat/constrained_requests, mark the turn (training it needs --loss.is_level)"})
    append_roles: tuple[str, ...] = field(default=APPEND_ROLES, metadata={
        "help": "roles a turn may append as delta tokens (Claude Code appends system notes); each must pass the "
                "start-up check, else its turns open a new segment", "choices": APPEND_ROLES})
    check_tool_ids: bool = field(default=True, metadata={"help": "400 for a tool result answering an unknown call id"})
    ping_s: float = field(default=10.0, metadata={"help": "seconds between keep-alive frames during a streamed turn"})

    def __post_init__(self):
        self.append_roles = tuple(self.append_roles)
        if not set(self.append_roles) <= set(APPEND_ROLES):
            raise ValueError(f"--chat.append_roles {self.append_roles}: choose among {APPEND_ROLES}")
        if self.max_body_mb < 1:
            raise ValueError(f"--chat.max_body_mb {self.max_body_mb}: must be >= 1")
        for name in ("context_window", "default_max_tokens", "max_tokens_cap"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--chat.{name} {getattr(self, name)}: must be >= 1, or unset")
        if self.default_max_tokens and self.max_tokens_cap and self.default_max_tokens > self.max_tokens_cap:
            raise ValueError("--chat.default_max_tokens above --chat.max_tokens_cap: the default would always be "
                             "clamped; lower --chat.default_max_tokens or raise --chat.max_tokens_cap")
        if self.ping_s <= 0:
            raise ValueError(f"--chat.ping_s {self.ping_s}: must be > 0")


# --- template: full render, delta render, bridge, and the start-up check that makes deltas safe
MARK = "ASSISTANT-TURN-" + secrets.token_hex(8)   # unguessable: text in a request cannot move the delta's cut
CALL = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
RECENT = 256  # full renders ChatTemplate keeps


class ChatTemplate:
    """Chat template as token ids (agent.py's too): turn ids + bridge(ids) + render_delta(new msgs) extend a segment."""

    def __init__(self, tokenizer_path: str, append_roles: tuple = ("tool", "user")):
        from transformers import AutoConfig, AutoProcessor, AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.eos_id = self.tokenizer.eos_token_id
        self.special_ids = set(self.tokenizer.all_special_ids)
        self.atomic_ids = self.special_ids | set(self.tokenizer.added_tokens_decoder)   # never merged with neighbours
        config = os.path.exists(f"{tokenizer_path}/config.json") and AutoConfig.from_pretrained(tokenizer_path)
        self.image_id = getattr(config, "image_token_id", None)   # LLaVA's config.json spells it image_token_index
        self.processor = None   # a VLM's: expands an image's one rendered image id into its placeholder run
        if self.image_id is not None:
            self.processor = AutoProcessor.from_pretrained(tokenizer_path)
            self.image_run = functools.lru_cache(RECENT)(self.image_run)   # a group's samples share their images
        self.recent = OrderedDict()  # the last RECENT full renders: a group's episodes share their first prompt
        probe = self.render_text([{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}],
                                 add_generation_prompt=False)
        self.turn_end = probe[probe.rindex(MARK) + len(MARK):]          # what the template writes after a turn
        eos = self.tokenizer.eos_token
        self.after_eos = self.encode(self.turn_end[len(eos):]) if self.turn_end.startswith(eos) else None
        self.after_cut = self.encode(self.turn_end)                     # for turns that did not end with eos
        self.refused = {role: why for role in append_roles if (why := append_refusal(self, role))}
        self.append_roles = tuple(r for r in append_roles if r not in self.refused)
        for role, why in self.refused.items():
            log.warning("chat template refused as an append role: %s (%s); such turns open a new segment", role, why)

    def render_text(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
        """Every render goes through here; image parts for a text model are a ValueError (templates print them)."""
        images = sum(isinstance(p, dict) and p.get("type") == "image" for m in messages
                     if isinstance(m.get("content"), list) for p in m["content"])
        if images and self.processor is None:
            raise ValueError(f"model {self.tokenizer.name_or_path} takes no images (its config.json names no "
                             f"image_token_id), and the messages hold {images}: send text content only")
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render_full(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """A whole prompt up to the generation prompt, as a fresh list; the last RECENT distinct renders are kept."""
        key = json.dumps([messages, tools], sort_keys=True, default=str)
        ids = self.recent.pop(key, None) or tuple(self.encode(self.render_text(messages, tools)))
        self.recent[key] = ids
        if len(self.recent) > RECENT:
            self.recent.popitem(last=False)
        return list(ids)

    def render_delta(self, messages: list[dict], last_assistant_had_tool_calls: bool = False) -> list[int]:
        """Tokens of messages after a turn and its bridge (else ValueError): what follows a dummy [user, assistant MARK]
        (calling a tool if the turn did: Llama 3.1 drops content by calls), never a re-render (Qwen3 drops thinking)."""
        def refuse(why: str) -> ValueError:
            return ValueError(f"chat template of {self.tokenizer.name_or_path}: cannot append "
                              f"{[m['role'] for m in messages]} as delta tokens: {why}")
        eos = self.tokenizer.eos_token
        if not eos or not self.turn_end.startswith(eos):
            raise refuse(f"an assistant turn ends with {self.turn_end!r}, not with the eos token {eos!r}")
        turn = {"role": "assistant", "content": MARK}
        if last_assistant_had_tool_calls:
            turn["tool_calls"] = [{**CALL, "function": {"name": "f", "arguments": {"x": MARK}}}]
        try:
            text = self.render_text([{"role": "user", "content": "u"}, turn] + messages)
        except (TemplateError, TypeError) as e:
            raise refuse(f"the template fails to render them ({e})") from e
        end = text.find(eos, text.rindex(MARK) + len(MARK)) if MARK in text else -1
        if end < 0:
            raise refuse(f"the dummy assistant turn is not followed by the eos token {eos!r}")
        if not text.startswith(self.turn_end, end):
            raise refuse(f"an assistant turn followed by them ends with {text[end:end + len(self.turn_end)]!r}, "
                         f"a last one with {self.turn_end!r}")
        delta = self.encode(text[end + len(self.turn_end):])
        if not delta:
            raise refuse("the template renders nothing for them")
        if delta[0] not in self.atomic_ids:
            raise refuse("the delta does not start at a special token, so it could merge across the boundary")
        if self.encode(text)[-len(delta):] != delta:
            raise refuse("the whole render's tokens do not end with the delta's tokens")
        return delta

    def expand_images(self, ids: list[int], images: list[bytes], at: int = 0) -> tuple[list[int], list[tuple]]:
        """Each rendered image id (one per image, in order) replaced by its placeholder run as the processor expands
        it, and the runs' spans [(start + at, end + at, bytes)]; ValueError when the counts differ."""
        if not images:
            return ids, []
        spots = [k for k, i in enumerate(ids) if i == self.image_id]
        if len(spots) != len(images):
            raise ValueError(f"the chat template rendered {len(spots)} image tokens for {len(images)} images")
        out, spans = [], []
        for k, (spot, data) in enumerate(zip(spots, images)):
            out += ids[spots[k - 1] + 1 if k else 0:spot]
            run = self.image_run(data)
            spans.append((at + len(out), at + len(out) + len(run), data))
            out += run
        return out + ids[spots[-1] + 1:], spans

    def image_run(self, data: bytes) -> list[int]:
        return list(self.processor(text=self.tokenizer.convert_ids_to_tokens(self.image_id),
                                   images=[decode_image(data, "image")], add_special_tokens=False)["input_ids"][0])

    def bridge(self, sampled_ids: list[int]) -> list[int]:
        """Tokens the template puts after a sampled turn: the rest of its end-of-turn text (mask 0)."""
        if self.after_eos is None:
            raise ValueError(f"chat template of {self.tokenizer.name_or_path} ends a turn with {self.turn_end!r}, "
                             f"which does not start with the eos token {self.tokenizer.eos_token!r}")
        return list(self.after_eos if sampled_ids and sampled_ids[-1] == self.eos_id else self.after_cut)


# --- canonical form: every protocol parses into (system, tools, [Msg]), hashed as a prefix chain
class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def bad(path: str, problem: str) -> ApiError:
    return ApiError(400, f"{path}: {problem}", param=path)


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: object   # parsed JSON; a client's unparsable string stays a string


@dataclass
class Msg:
    role: str            # system | user | assistant | tool
    content: str | tuple = ""   # a tuple when it holds images: its parts in order, str (text) or bytes (an image)
    reasoning: str = ""
    calls: tuple = ()    # assistant: Call, ...
    call_id: str = ""    # tool: the call it answers

    def key(self) -> tuple:
        """Template-relevant identity: reasoning is left out (clients drop it), arguments compare as JSON."""
        if self.role != "assistant":
            return self.role, self.content, self.call_id
        calls = tuple((c.id, c.name, json.dumps(c.arguments, sort_keys=True)) for c in self.calls)
        return self.role, self.content.strip(), calls

    def to_template(self) -> dict:
        m = {"role": self.role, "content": template_content(self.content)}
        if self.reasoning:
            m["reasoning_content"] = self.reasoning
        if self.calls:
            m["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in self.calls]
        if self.role == "tool":
            m["tool_call_id"] = self.call_id
        return m


def template_content(content: str | tuple | list):
    return content if isinstance(content, str) else [
        {"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in content]


@dataclass
class ChatRequest:
    model: str
    system: str | None
    tools: list          # OpenAI function tools {"type": "function", "function": {name, description, parameters}}
    msgs: list
    call_prefix: str     # the protocol's spelling of the tool call ids we make
    too_long: str        # the protocol's wording of a prompt over the window: .format(n=, window=, limit=)
    max_tokens: int | None = None
    stop: tuple = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    constraint: tuple = (None, "")   # (vLLM structured-output fields, the request field that asked for them)
    server_tools: int = 0            # server-side tools (web search...) the client listed: never offered
    namespaces: tuple = ()           # Responses namespace tools: a call of ns.name goes out as {namespace, name}
    prefill: bool = False            # Anthropic: the last message is the assistant's, continued (its text is prompt)
    changes: list = field(default_factory=list)   # options that would change the distribution sampled from (OpenAI)
    hashes: list = field(default_factory=list)   # hashes[k]: chain over (system, tools) and msgs[:k]

    def template_messages(self) -> list[dict]:
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        return head + [m.to_template() for m in self.msgs[:len(self.msgs) - self.prefill]]

    def images(self, start: int = 0) -> list[bytes]:
        return [p for m in self.msgs[start:] if isinstance(m.content, tuple) for p in m.content if isinstance(p, bytes)]


def chain_hashes(system: str | None, tools: list, msgs: list, prior: list = ()) -> list[int]:
    """hashes[k] covers (system, tools) and msgs[:k]; `prior`, an earlier chain over a prefix of msgs, is reused."""
    hashes = [hash((system, json.dumps(tools, sort_keys=True)))]
    if prior and prior[0] == hashes[0]:
        hashes = list(prior)
    for m in msgs[len(hashes) - 1:]:
        hashes.append(hash((hashes[-1], m.key())))
    return hashes


def common_prefix(a: list[int], b: list[int]) -> int:
    """Messages two chains share (-1: different system or tools); binary search, as chains are prefix-closed."""
    return bisect.bisect_left(range(min(len(a), len(b))), True, key=lambda i: a[i] != b[i]) - 1


# --- matcher: classify a request against the episode's segments, generate, commit
@dataclass
class Turn:
    start: int           # first sampled token
    end: int             # one past the last sampled token
    bridge: list         # tokens that close this turn before the next delta (mask 0)
    finish: str
    sampled: tuple       # (ids, log-probs, versions) as the generator returned them, frozen for the audit
    msgs: int            # the segment's messages up to and including this turn's
    resume: int | None   # where a prefill repeating this turn continues it (its text's end); None: cut at a stop string
    constrained: bool = False   # sampled under constrained decoding: the behaviour policy is the masked sampler
    opens: bool = True   # begins its message (False: continues a prefill), so a RETRY may resample from its start
    calls: int = 0       # tool calls parsed from this turn's reply


@dataclass
class Track:
    """One segment while its episode runs: token rows plus the canonical messages they stand for."""
    index: int
    parent: int | None = None     # the segment this one forked from
    tokens: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    msgs: list = field(default_factory=list)
    hashes: list = field(default_factory=list)   # len(msgs) + 1, as ChatRequest.hashes
    turns: list = field(default_factory=list)
    rewrite_of: int | None = None   # the segment whose conversation this one carries on, rewritten
    experts: object = None          # (T, layers, top_k) int16 routing of the last engine call
    images: list = field(default_factory=list)   # [(start, end, encoded image)]: Segment.images


@dataclass
class Pending:
    reply_id: str         # the turn's first plan's, and its prompt's length: never the plan, whose prompt is
    prompt_tokens: int    # O(context), so that an episode's turns hold O(context) in all, not O(turns x context)
    future: asyncio.Future
    gone: bool = False   # its client left before the reply: an identical resend, marked or not, joins this turn


@dataclass
class Plan:
    kind: str                     # EXTEND | CONTINUE | RETRY | REWRITE | UNRELATED
    reply_id: str
    prompt: list                  # what the engine sees
    pending: Pending | None = None
    track: Track | None = None    # the segment this turn continues (None: a new one)
    base: int = 0                 # tokens of `track` in `prompt`: appended in place if it still holds just these
    images: list = field(default_factory=list)  # the image spans of the whole prompt
    rewrite_of: int | None = None   # the segment a REWRITE carries on
    max_new: int = 0
    clamped: bool = False
    cached: bool = False          # RETRY answered from the earlier turn, no engine call
    gen_s: float = 0.0


@dataclass
class Reply:
    id: str
    prompt_tokens: int
    ids: list = field(default_factory=list)   # the defaults: a stream's opening shell, nothing sampled yet
    finish: str = "stop"          # stop | length
    stop_sequence: str | None = None
    clamped: bool = False         # max_tokens was cut to the context window
    reasoning: str = ""
    content: str = ""
    calls: tuple = ()
    pieces: list | None = None    # per-token text, only when the client asked for logprobs
    logprobs: list = field(default_factory=list)
    handle: str = ""              # stands for the reasoning in a thinking signature / reasoning item (opaque)
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class EpisodeState:
    id: str
    api_key: str
    affinity: str = ""   # the engine key of its requests (agent.py: its group's id); "" = the episode's id
    tracks: list = field(default_factory=list)
    pending: dict = field(default_factory=dict)   # request hash -> Pending (in flight or answered)
    handles: dict = field(default_factory=dict)   # reasoning handle we sent -> the reasoning text it stands for
    parsed: deque = field(default_factory=lambda: deque(maxlen=4))   # recent (protocol, raw messages, request)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tainted: bool = False
    closed: bool = False


class SegmentStore:
    """Plans, generates and commits canonical requests on their episode's segments; knows no protocol."""

    def __init__(self, generator, tokenizer_path: str, args: ChatArgs):
        self.generator, self.args = generator, args
        engine_window = generator.vllm.max_model_len
        if args.context_window is not None and args.context_window > engine_window:
            raise ValueError(f"--chat.context_window {args.context_window} above --vllm.max_model_len {engine_window}: "
                             f"the engine would refuse such prompts; lower it or leave it unset")
        self.window = args.context_window or engine_window
        self.template = ChatTemplate(tokenizer_path, args.append_roles)
        self.counts = Counter()

    def plan_turn(self, ep: EpisodeState, req: ChatRequest, retries: int) -> Plan:
        """Classify a request on the episode's segments (hold ep.lock); none is sealed: a rewrite may be a sub-agent."""
        key, reply_id = req.hashes[-1], secrets.token_hex(12)
        if key in ep.pending and (retries > 0 or ep.pending[key].gone):   # an SDK's retry, or a runner's resend
            pending, ep.pending[key].gone = ep.pending[key], False   # (best-of-n requests are all still connected)
            return Plan("RETRY", pending.reply_id, [], pending=pending, cached=True)
        n, scored = len(req.msgs) - req.prefill, [(t, common_prefix(t.hashes, req.hashes)) for t in reversed(ep.tracks)]
        found = max(((t, L, *a) for t, L in scored if (a := self.anchor(t, L, req, n))), key=lambda s: s[1],
                    default=None)
        prefill = self.template.encode(req.msgs[-1].content) if req.prefill else []   # prompt, never action
        try:   # a new image becomes its placeholder run, as the processor expands it (expand_images)
            if found:
                track, L, kind, u = found
                base = {"CONTINUE": u.resume, "EXTEND": u.end, "RETRY": u.start}[kind]
                prompt, images = track.tokens[:base], [i for i in track.images if i[1] <= base]
                if kind == "EXTEND":
                    delta, new = self.template.expand_images(self.template.render_delta(
                        [m.to_template() for m in req.msgs[L:n]], bool(req.msgs[L - 1].calls)), req.images(L),
                        base + len(u.bridge))
                    prompt, images = prompt + u.bridge + delta, images + new
                plan = Plan(kind, reply_id, prompt + prefill * (kind != "CONTINUE"), track=track, base=base,
                            images=images)
            else:   # a rewrite carries on a conversation we hold (same first message); a side call at most quotes it
                same_task = [s for s in scored if s[0].msgs[0].key() == req.msgs[0].key()] if n > 1 else []
                prompt, images = self.render_request(req)
                plan = Plan("REWRITE" if same_task else "UNRELATED", reply_id, prompt, images=images,
                            rewrite_of=max(same_task, key=lambda s: s[1])[0].index if same_task else None)
        except ValueError as e:
            raise bad("messages", str(e)) from None
        room = self.window - len(plan.prompt)
        if room < 1:
            raise ApiError(400, req.too_long.format(n=len(plan.prompt), window=self.window, limit=self.window - 1),
                           param="messages", code="context_length_exceeded")
        want = req.max_tokens or self.args.default_max_tokens or room
        want = min(want, self.args.max_tokens_cap or want)
        plan.max_new, plan.clamped = min(want, room), want > room
        plan.pending = ep.pending[key] = Pending(reply_id, len(plan.prompt), asyncio.get_running_loop().create_future())
        return plan

    def anchor(self, t: Track, L: int, req: ChatRequest, n: int) -> tuple[str, Turn] | None:
        """Where a request sharing L messages with segment t goes on, if it does: CONTINUE the turn a prefill repeats,
        EXTEND after the turn ending those L messages, or RETRY the turn that answered exactly its n messages. A new
        segment is planned the same whether an earlier one committed or not: concurrency changes nothing trained."""
        ends = {u.msgs: u for u in t.turns}   # the turn ending each message (a continued message: its last part)
        if req.prefill and L == n + 1 and L in ends and ends[L].resume is not None:
            return "CONTINUE", ends[L]
        roles = self.template.append_roles
        if L in ends and L <= n and roles and all(m.role in roles for m in req.msgs[L:n]):
            return "EXTEND", ends[L]
        first = next((u for u in t.turns if u.msgs == n + 1 and u.opens), None)
        return ("RETRY", first) if L >= n and first else None

    def render_request(self, req: ChatRequest) -> tuple[list[int], list[tuple]]:
        ids, images = self.template.expand_images(self.template.render_full(req.template_messages(), req.tools),
                                                  req.images())
        return ids + (self.template.encode(req.msgs[-1].content) if req.prefill else []), images

    async def run_turn(self, ep: EpisodeState, req: ChatRequest, plan: Plan) -> Reply:
        """Generate (no lock held) and commit; raises ApiError only, and taints the episode on a bug of ours."""
        start = time.perf_counter()
        if plan.cached:
            try:
                return await asyncio.shield(plan.pending.future)
            finally:
                plan.gen_s = time.perf_counter() - start
        try:
            try:
                seed = None if req.seed is None else hash((ep.id, req.seed)) & (1 << 63) - 1   # per episode: G differ
                c = await self.generator.generate(plan.prompt, max_new_tokens=plan.max_new, seed=seed,
                                                  request_id=plan.reply_id, affinity=ep.affinity or ep.id,
                                                  constraint=req.constraint[0], images=plan.images)
            except ConstraintError as e:
                raise bad(req.constraint[1], str(e)) from None
            except ValueError:
                raise   # the prompt we built broke the generator's contract: our bug
            except Exception as e:
                raise ApiError(503, f"the rollout engine is unavailable ({e}); retry shortly") from e
            finally:
                plan.gen_s = time.perf_counter() - start
            if c.finish_reason not in ("stop", "length"):
                raise ApiError(503, f"generation ended with {c.finish_reason!r} (engine aborted it); retry shortly")
            async with ep.lock:
                reply = self.commit(ep, req, plan, c)
        except Exception as e:
            if not isinstance(e, ApiError):
                e = self.taint(ep, e, "; the episode is marked tainted and will not be trained")
            if ep.pending.get(req.hashes[-1]) is plan.pending:
                del ep.pending[req.hashes[-1]]
            plan.pending.future.set_exception(e)
            plan.pending.future.exception()   # retrieved: no "never retrieved" warning when no retry waits
            raise e
        plan.pending.future.set_result(reply)
        return reply

    def commit(self, ep: EpisodeState, req: ChatRequest, plan: Plan, c: Completion) -> Reply:
        """Record the sampled ids on the planned segment (or a new one branching off it) and build the reply."""
        ids, logprobs, versions = list(c.token_ids), list(c.logprobs), list(c.versions)
        finish, stop = c.finish_reason, None
        if not ids or not len(ids) == len(logprobs) == len(versions):
            raise RuntimeError(f"generator returned {len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
        shut = finish == "stop" and ids[-1] in self.template.special_ids   # ended by a stop token, which has no text
        text = self.template.decode(ids[:len(ids) - shut])
        cut = cut_at_stop(self.template, ids, req.stop) if req.stop else None
        if cut:
            kept, stop, text = cut
            ids, logprobs, versions, finish = ids[:kept], logprobs[:kept], versions[:kept], "stop"
        reasoning, content, found = parse_reply(text)
        calls = tuple(Call(req.call_prefix + secrets.token_hex(12), name, args) for name, args in found)
        pieces = [self.template.decode([i]) for i in ids] if req.logprobs else None
        reply = Reply(plan.reply_id, len(plan.prompt), ids, finish, stop, plan.clamped, reasoning, content, calls,
                      pieces, logprobs, "vb1-" + secrets.token_urlsafe(24) if reasoning else "")
        if reasoning:
            ep.handles[reply.handle] = reasoning
        if ep.closed:   # the trainer already took this episode's segments
            self.counts["chat/late_turns_dropped"] += 1
            return reply
        t = plan.track
        if t is None or plan.base != len(t.tokens):   # a new segment: a REWRITE, or a branch (another turn went first,
            self.counts["chat/forks"] += t is not None   # a RETRY), whose track's ids are prompt here, trained there
            t = Track(len(ep.tracks), parent=t and t.index, rewrite_of=plan.rewrite_of)
            ep.tracks.append(t)
        added, n = plan.prompt[len(t.tokens):], len(req.msgs) - req.prefill
        t.tokens += added + ids
        t.mask += [False] * len(added) + [True] * len(ids)
        t.logprobs += [0.0] * len(added) + logprobs
        t.versions += [-1] * len(added) + versions
        head = req.msgs[-1].content if req.prefill else ""   # a continued turn is one message: prefill + continuation
        assistant = Msg("assistant", head + content, reasoning, calls)
        t.msgs, t.hashes = req.msgs[:n] + [assistant], req.hashes[:n + 1] + [hash((req.hashes[n], assistant.key()))]
        t.turns.append(Turn(len(t.tokens) - len(ids), len(t.tokens), self.template.bridge(ids), finish,
                            (tuple(ids), tuple(logprobs), tuple(versions)), len(t.msgs),
                            None if cut else len(t.tokens) - shut, req.constraint[0] is not None, not req.prefill,
                            len(calls)))
        t.images = plan.images
        if c.routed_experts is not None:   # this call saw the whole segment
            t.experts = segment_routing(c.routed_experts, len(t.tokens))
        if len(t.tokens) != len(plan.prompt) + len(ids) or len(t.msgs) + 1 != len(t.hashes):
            raise RuntimeError(f"segment {t.index}: {len(t.tokens)} tokens, engine saw {len(plan.prompt) + len(ids)}")
        return reply

    @staticmethod
    def segments(ep: EpisodeState) -> list[Segment]:
        """Every segment of the episode, as training rows (agent.py drops a tainted episode's)."""
        return [Segment(token_ids=t.tokens, action_mask=t.mask, logprobs=t.logprobs, versions=t.versions,
                        episode_id=ep.id, finish_reason=t.turns[-1].finish, truncated=t.turns[-1].finish == "length",
                        routed_experts=t.experts, images=t.images,
                        info={"segment": t.index, "forked_from": t.parent, "rewrite_of": t.rewrite_of,
                              "turns": [(u.start, u.end) for u in t.turns], "tainted": ep.tainted,
                              "tool_calls": sum(u.calls for u in t.turns),
                              "constrained": [(u.start, u.end) for u in t.turns if u.constrained],
                              "sampled": sampled_record(u.sampled for u in t.turns)})
                for t in ep.tracks]

    def taint(self, ep: EpisodeState | None, e: Exception, note: str = "") -> ApiError:
        log.error("internal error (episode %s; its segments are marked tainted)", ep and ep.id, exc_info=e)
        if ep is not None and not ep.tainted:
            ep.tainted = True
            self.counts["chat/tainted_episodes"] += 1
        return ApiError(500, f"internal error: {e!r}{note}")


# === machinery: reply parsing, wire formats, HTTP, template check; read it when you change a protocol or a route
# --- the sampled turn: Hermes tool calls, <think> reasoning, stop strings
TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)   # an unclosed last call runs to the end


def parse_reply(text: str) -> tuple[str, str, list[tuple[str, dict]]]:
    """(reasoning, content, [(name, arguments)]) of a sampled turn's text, as vLLM's hermes parser reads it: content
    is the text before the first <tool_call>; a call that is not {"name": str, "arguments": {}} makes it all content."""
    head, think, rest = text.partition("</think>")
    reasoning, text = (head.removeprefix("<think>").strip("\n"), rest.lstrip("\n")) if think else ("", text)
    start = text.find("<tool_call>")
    try:
        calls = [json.loads(match.group(1)) for match in TOOL_CALL.finditer(text, start)] if start >= 0 else []
    except ValueError:
        return reasoning, text, []
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                            and isinstance(c.get("arguments", {}), dict) for c in calls):
        return reasoning, text, []
    return reasoning, text[:start], [(c["name"], c.get("arguments", {})) for c in calls]


def cut_at_stop(template: ChatTemplate, ids: list[int], stops: tuple) -> tuple[int, str, str] | None:
    """(ids kept, stop string, text before it) at the first stop string: the fewest whole ids covering it; or None."""
    text = template.decode(ids)
    pos, stop = min(((text.find(s), s) for s in stops if s and s in text), default=(-1, ""))
    if pos < 0:
        return None
    kept = 1 + bisect.bisect_left(range(1, len(ids)), pos + len(stop), key=lambda k: len(template.decode(ids[:k])))
    return kept, stop, text[:pos]


# --- the start-up template check behind ChatTemplate.append_roles
CHECK_TOOLS = [{"type": "function", "function": {"name": "calc", "description": "adds",
                                                 "parameters": {"type": "object"}}}]
CHECK_CONVERSATIONS = [   # each ends in an assistant turn: plain, reasoning, calls, unicode, blank content
    ([{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}], None),
    ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "héllo 😀", "reasoning_content": "greet ü"}], None),
    ([{"role": "user", "content": "add"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}], CHECK_TOOLS),
    ([{"role": "user", "content": "two"}, {"role": "assistant", "content": "Calling.", "reasoning_content": "r",
      "tool_calls": [CALL, {**CALL, "id": "call_1",
                            "function": {"name": "g", "arguments": {"é": [1, {"b": "ü"}]}}}]}], None),
    ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "  \n"}, {"role": "user", "content": "v"},
      {"role": "assistant", "content": "", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_0", "content": "1"}, {"role": "assistant", "content": "done"}],
     CHECK_TOOLS),
]
CHECK_APPENDS = {"tool": {"role": "tool", "tool_call_id": "call_0", "content": "résultat: 42"},
                 "user": {"role": "user", "content": "next ü"}, "system": {"role": "system", "content": "note"}}


def append_refusal(t: ChatTemplate, role: str) -> str | None:
    """Why `role` cannot be appended as delta tokens (None: it can): the full render must equal prompt + turn +
    bridge + delta. A conversation the template refuses to render is skipped: no request can carry it."""
    if t.after_eos is None:
        return f"a turn ends with {t.turn_end!r}, not with the eos token: no bridge exists"
    for conv, tools in CHECK_CONVERSATIONS:
        try:
            before = t.render_text(conv, tools, add_generation_prompt=False)
        except TemplateError:
            continue
        if not before.startswith(t.render_text(conv[:-1], tools)):
            return "not prefix-preserving: the generation prompt is not how a rendered assistant turn begins"
        ids = t.encode(before)
        if ids[-1 - len(t.after_eos):] != [t.eos_id] + t.after_eos:
            return "a full render's turn end differs from eos + bridge"
        for appended in ([CHECK_APPENDS[role]], [CHECK_APPENDS[role]] * 2, []):   # []: a new turn after one
            try:
                after = t.render_text(conv + appended, tools)
                if not after.startswith(before):
                    return "not prefix-preserving: appending it changes the rendered history"
                if ids + t.render_delta(appended, bool(conv[-1].get("tool_calls"))) != t.encode(after):
                    return "delta tokens differ from the full render's tokens"
            except (TemplateError, ValueError) as e:
                return str(e)
    return None


# --- wire formats: typed field reads and SSE frames, shared by the three protocols
MAX_IMAGE_PIXELS = 4096 * 4096   # an inline image larger than this is refused before it is decoded (48 MiB as RGB)
TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
              dict: "an object"}


def get(obj: dict, key: str, types, path: str = "", required: bool = False):
    value = obj.get(key)
    if value is None and required:
        raise bad(path + key, "Field required")
    types = types if isinstance(types, tuple) else (types,)
    if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
        raise bad(path + key, "expected " + " or ".join(TYPE_NAMES[t] for t in types))
    return value


def objects(items: list, path: str, start: int = 0):
    for i in range(start, len(items)):
        if not isinstance(items[i], dict):
            raise bad(f"{path}.{i}", "expected an object")
        yield i, items[i], f"{path}.{i}."


def text_of(value, path: str, kinds: tuple = ("text",), image: str = "") -> str | tuple:
    """A string, null, or text parts joined by newlines; parts of type `image` kept (join_parts); others refused."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise bad(path, "expected a string or an array of content parts")
    parts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if image and kind == image:
            parts.append(image_of(part, f"{path}.{j}."))
        elif kind in kinds:
            parts.append(get(part, "text", str, f"{path}.{j}.", required=True))
        else:
            raise bad(f"{path}.{j}.type", f"only text{' and ' + image if image else ''} content is supported here, "
                                          f"got {kind!r}")
    return join_parts(parts)


def join_parts(parts: list) -> str | tuple:
    return tuple(parts) if any(isinstance(p, bytes) for p in parts) else "\n".join(parts)


def image_of(part: dict, path: str) -> bytes:
    """The encoded bytes of an inline image part: a data URL (OpenAI, Responses) or an Anthropic base64 source."""
    source = part.get("source")
    if isinstance(source, dict):   # Anthropic: {"type": "base64", "media_type": ..., "data": ...}
        if source.get("type") != "base64":
            raise bad(path + "source.type", f"{source.get('type')!r} image sources are not fetched (no network is "
                                            "assumed): send the image as a base64 source")
        where, data = path + "source.data", get(source, "data", str, path + "source.", required=True)
    else:
        url, where = part.get("image_url"), path + "image_url"
        url, where = (url.get("url"), where + ".url") if isinstance(url, dict) else (url, where)
        if not isinstance(url, str) or not url.startswith("data:"):
            got = "a file id" if part.get("file_id") else repr(url)[:60]
            raise bad(where, f"expected an inline data URL (data:image/png;base64,...), got {got}: remote images are "
                             "not fetched (no network is assumed)")
        head, _, data = url.partition(",")
        if not head.endswith(";base64"):
            raise bad(where, "expected a base64 data URL (data:image/...;base64,...)")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as e:   # binascii.Error, or a str with non-ASCII characters
        raise bad(where, f"not valid base64 ({e})") from None
    from PIL import Image
    try:   # its size from the header, before decoding: a 17 kB PNG can hold 144M pixels (432 MB as RGB)
        pixels = math.prod(Image.open(io.BytesIO(raw)).size)
    except Image.DecompressionBombError:   # PIL refuses at twice its own limit, far past ours
        pixels = math.inf
    except (OSError, TypeError):   # not an image: decode_image says so below
        pixels = 0
    if pixels > MAX_IMAGE_PIXELS:
        raise ApiError(400, f"{where}: the image has more than {MAX_IMAGE_PIXELS} pixels, the most this server "
                            "decodes: downscale it", param=where)
    try:
        decode_image(raw, where)
    except ValueError as e:
        raise ApiError(400, str(e), param=where) from None
    return raw


def parse_arguments(raw):
    try:
        return json.loads(raw) if isinstance(raw, str) else {} if raw is None else raw
    except ValueError:   # a client's unparsable arguments string stays a string
        return raw


def parse_tools(tools: list, kind: str = "function", schema: str = "parameters",
                nested: bool = False) -> tuple[list[dict], int]:
    """Client tools of `kind` (spec under "function" when nested) as OpenAI function tools, and the count of server-side
    tools (another type: web search...), never offered; a Responses namespace stands for its tools, named ns.name."""
    out, server = [], 0
    for _, t, p in objects(tools, "tools"):
        if t.get("type", kind) == "namespace" and kind == "function":
            ns = get(t, "name", str, p, required=True)
            inner, more = parse_tools(get(t, "tools", list, p, required=True))
            out += [{"type": "function", "function": {**f["function"], "name": f"{ns}.{f['function']['name']}"}}
                    for f in inner]
            server += more
        elif t.get("type", kind) != kind:
            server += 1
        else:
            fn = get(t, "function", dict, p, required=True) if nested else t
            get(fn, "name", str, p, required=True)
            spec, params = {k: fn[k] for k in ("name", "description") if k in fn}, fn.get(schema)
            out.append({"type": "function", "function": spec if params is None else {**spec, "parameters": params}})
    return out, server


def constrain(tools: list, forced: str | None, fmt: dict | None, paths: tuple[str, str],
              single: bool = False) -> tuple[dict | None, str]:
    """(vLLM structured-output fields, the field that asked) for a forced tool call (forced "": any tool, `single`: one
    call; a name: one call of it) in the Hermes form parse_reply reads, schema-checked arguments; or a JSON format."""
    if forced is not None:
        calls = [t["function"] for t in tools if forced in ("", t["function"]["name"])]
        if not calls:
            raise bad(paths[0], f"no tool named {forced!r}" if forced else "tools are required with this choice")
        tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(f["name"])}, "arguments": ',
                 "content": {"type": "json_schema", "json_schema": f.get("parameters") or {"type": "object"},
                             "max_whitespace_cnt": 1},
                 "end": "}\n</tool_call>"} for f in calls]
        tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                                                    "at_least_one": True, "stop_after_first": single or bool(forced)}}
        return {"structural_tag": json.dumps(tag)}, paths[0]
    if not isinstance(fmt, dict | None):
        raise bad(paths[1], "expected an object")
    kind = (fmt or {}).get("type", "text")
    if kind == "json_object":
        return {"json_object": True}, paths[1]
    if kind == "json_schema":   # OpenAI nests the schema under json_schema; Responses and Anthropic do not
        nested = fmt.get("json_schema") if "json_schema" in fmt else fmt
        if not isinstance(nested, dict):
            raise bad(paths[1] + ".json_schema", "expected an object")
        schema = nested.get("schema")   # as JSON text: vLLM's msgpack link to its core fails on an int past 64 bits
        return {"json": json.dumps(schema if isinstance(schema, dict) else {"type": "object"})}, paths[1]
    if kind != "text":
        raise bad(paths[1] + ".type", f"unsupported format {kind!r}: use text, json_object or json_schema")
    return None, ""


def sse(name: str | None, data: dict) -> str:
    return (f"event: {name}\n" if name else "") + f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def event(kind: str, **data) -> str:
    return sse(kind, {"type": kind, **data})


# --- OpenAI Chat Completions: POST /v1/chat/completions (and /chat/completions)
OPENAI_TOO_LONG = ("This model's maximum context length is {window} tokens. However, your messages resulted in {n} "
                   "tokens. Please reduce the length of the messages.")
OPENAI_TYPES = {401: "invalid_request_error", 404: "not_found_error", 500: "server_error", 503: "server_error"}


def openai_constrain(body: dict, tools: list, fmt, fmt_path: str) -> tuple[dict | None, str]:
    """constrain() under OpenAI's tool_choice ("required": any tool; a function: that one) and parallel_tool_calls."""
    choice, forced = body.get("tool_choice"), None
    if choice == "required":
        forced = ""
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if "function" in choice else choice.get("name")
        forced = name if isinstance(name, str) else ""
    return constrain(tools, forced, fmt, ("tool_choice", fmt_path), body.get("parallel_tool_calls") is False)


def arguments_json(c: Call) -> str:
    return c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments, ensure_ascii=False)


def parse_openai(body: dict, prior: tuple = (0, None, ())) -> ChatRequest:
    """`prior` (raw messages done, system, canonical msgs) is an earlier parse of a prefix of these messages."""
    done, system, msgs = prior[0], prior[1], list(prior[2])   # a copy: prior's list is an earlier request's
    for i, m, p in objects(get(body, "messages", list, required=True), "messages", done):
        role = get(m, "role", str, p, required=True)
        if role in ("system", "developer") and i == 0:
            system = text_of(m.get("content"), p + "content")
        elif role in ("system", "developer", "user"):
            msgs.append(Msg("user" if role == "user" else "system",
                            text_of(m.get("content"), p + "content", image="image_url" if role == "user" else "")))
        elif role == "assistant":
            calls = []
            for _, tc, q in objects(get(m, "tool_calls", list, p) or [], p + "tool_calls"):
                fn = get(tc, "function", dict, q, required=True)
                calls.append(Call(get(tc, "id", str, q, required=True),
                                  get(fn, "name", str, q + "function.", required=True),
                                  parse_arguments(fn.get("arguments"))))
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            msgs.append(Msg("assistant", text_of(m.get("content"), p + "content"),
                            reasoning if isinstance(reasoning, str) else "", tuple(calls)))
        elif role == "tool":
            msgs.append(Msg("tool", text_of(m.get("content"), p + "content"),
                            call_id=get(m, "tool_call_id", str, p, required=True)))
        else:
            raise bad(p + "role", f"unsupported role {role!r}")
    stop, options = get(body, "stop", (str, list)), get(body, "stream_options", dict) or {}
    tools, server = parse_tools(get(body, "tools", list) or [], nested=True)
    constraint = openai_constrain(body, tools, get(body, "response_format", dict), "response_format")
    req = ChatRequest(get(body, "model", str, required=True), system, tools, msgs, "call_", OPENAI_TOO_LONG,
                      constraint=constraint, server_tools=server,
                      max_tokens=get(body, "max_completion_tokens", int) or get(body, "max_tokens", int),
                      stop=(stop,) if isinstance(stop, str) else tuple(s for s in stop or () if isinstance(s, str)),
                      seed=get(body, "seed", int), stream=bool(get(body, "stream", bool)),
                      include_usage=bool(options.get("include_usage")), logprobs=bool(get(body, "logprobs", bool)))
    req.changes = ["n"] * ((get(body, "n", int) or 1) > 1) + ["logit_bias"] * bool(get(body, "logit_bias", dict))
    req.changes += [k for k in ("frequency_penalty", "presence_penalty") if get(body, k, (int, float))]
    return req


def openai_body(req: ChatRequest, r: Reply) -> dict:
    msg = {"role": "assistant", "content": r.content or (None if r.calls else ""), "refusal": None}
    if r.reasoning:
        msg["reasoning_content"] = r.reasoning
    if r.calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": arguments_json(c)}} for c in r.calls]
    logprobs = None if r.pieces is None else {"refusal": None, "content": [
        {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
        for p, lp in zip(r.pieces, r.logprobs)]}
    finish = "tool_calls" if r.calls else "length" if r.finish == "length" else "stop"
    return {"id": f"chatcmpl-{r.id}", "object": "chat.completion", "created": r.created, "model": req.model,
            "choices": [{"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": finish}],
            "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.ids),
                      "total_tokens": r.prompt_tokens + len(r.ids)}}


class OpenAIWriter:
    """Replies, errors and the model list; a stream is a role chunk at once, then reasoning, content, all tool calls
    whole, finish, usage, [DONE]. Errors after the stream opened are a data line, then the end."""
    ping, overloaded, body = ": keep-alive\n\n", 503, staticmethod(openai_body)   # ping: an SSE comment, skipped

    def __init__(self, req: ChatRequest, plan: Plan):
        self.req, self.base = req, {"id": f"chatcmpl-{plan.reply_id}", "object": "chat.completion.chunk",
                                    "created": int(time.time()), "model": req.model}
        self.head = [self.chunk({"role": "assistant", "content": ""})]   # frames sent at once

    def chunk(self, delta: dict, finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse(None, {**self.base, "choices": [choice]})

    def tail(self, r: Reply) -> list[str]:
        body = openai_body(self.req, r)
        choice, msg = body["choices"][0], body["choices"][0]["message"]
        deltas = [{k: msg[k]} for k in ("reasoning_content", "content") if msg.get(k)]
        if r.calls:
            deltas.append({"tool_calls": [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]})
        out = [self.chunk(d) for d in deltas] + [self.chunk({}, choice["finish_reason"])]
        if self.req.include_usage:
            out.append(sse(None, {**self.base, "choices": [], "usage": body["usage"]}))
        return out + ["data: [DONE]\n\n"]

    def error_event(self, e: ApiError) -> str:
        return sse(None, self.error(e, ""))

    @staticmethod
    def error(e: ApiError, request_id: str) -> dict:
        return {"error": {"message": e.message, "type": e.kind or OPENAI_TYPES.get(e.status, "invalid_request_error"),
                          "param": e.param, "code": e.code}}

    @staticmethod
    def models(name: str, created: int) -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "verbatim"}]}


# --- OpenAI Responses (stateless): POST /v1/responses (and /responses)
def parse_responses(body: dict, handles: dict = {}) -> ChatRequest:
    """A reasoning item whose encrypted_content is one of our `handles` restores its turn's exact reasoning."""
    if body.get("previous_response_id") is not None:
        raise bad("previous_response_id", "this server is stateless: send the whole conversation as input")
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else get(body, "input", list, required=True)
    system, msgs, thought = get(body, "instructions", str), [], ""   # thought: a reasoning item's, for its turn
    for i, it in enumerate(items):
        p, kind = f"input.{i}.", it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message":
            role = get(it, "role", str, p, required=True)
            text = text_of(it.get("content"), p + "content", ("input_text", "output_text", "text"),
                           "input_image" if role == "user" else "")
            if role in ("system", "developer") and system is None and not msgs:
                system = text
            elif role in ("system", "developer", "user", "assistant"):
                msgs.append(Msg("system" if role == "developer" else role, text, thought * (role == "assistant")))
                thought = "" if role == "assistant" else thought
            else:
                raise bad(p + "role", f"unsupported role {role!r}")
        elif kind == "function_call":   # a namespace's tool is sent back as {namespace, name}: the model saw ns.name
            name, ns = get(it, "name", str, p, required=True), get(it, "namespace", str, p)
            call = Call(get(it, "call_id", str, p, required=True), f"{ns}.{name}" if ns else name,
                        parse_arguments(it.get("arguments")))
            if msgs and msgs[-1].role == "assistant" and not thought:   # a turn: [reasoning?, message?, call, ...]
                msgs[-1] = replace(msgs[-1], calls=msgs[-1].calls + (call,))
            else:
                msgs.append(Msg("assistant", reasoning=thought, calls=(call,)))
                thought = ""
        elif kind == "function_call_output":
            output = text_of(it.get("output"), p + "output", ("input_text", "output_text"), "input_image")
            msgs.append(Msg("tool", output, call_id=get(it, "call_id", str, p, required=True)))
        elif kind == "reasoning":   # ours carries a handle; another server's opaque content stays opaque
            thought = handles.get(it.get("encrypted_content"), "")
        else:
            raise bad(p + "type", f"unsupported input item {kind!r}")
    tools, server = parse_tools(get(body, "tools", list) or [])
    constraint = openai_constrain(body, tools, (get(body, "text", dict) or {}).get("format"), "text.format")
    namespaces = tuple(t["name"] for t in body["tools"] if t.get("type") == "namespace") if tools else ()
    return ChatRequest(get(body, "model", str, required=True), system, tools, msgs, "call_", OPENAI_TOO_LONG,
                       max_tokens=get(body, "max_output_tokens", int), constraint=constraint, server_tools=server,
                       seed=get(body, "seed", int), stream=bool(get(body, "stream", bool)), namespaces=namespaces)


def responses_body(req: ChatRequest, r: Reply) -> dict:
    output = [{"type": "reasoning", "id": f"rs_{r.id}", "summary": [], "encrypted_content": r.handle}] \
        if r.reasoning else []   # the handle, never the text: a client sends it back, we map it
    if r.content or not r.calls:
        output.append({"type": "message", "id": f"msg_{r.id}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": r.content, "annotations": [], "logprobs": []}]})
    for c in r.calls:
        ns, _, name = c.name.rpartition(".") if c.name.partition(".")[0] in req.namespaces else ("", "", c.name)
        output.append({"type": "function_call", "id": f"fc_{c.id}", "call_id": c.id, "name": name,
                       "arguments": arguments_json(c), "status": "completed", **({"namespace": ns} if ns else {})})
    status = "incomplete" if r.finish == "length" and not r.calls else "completed"
    usage = {"input_tokens": r.prompt_tokens, "output_tokens": len(r.ids), "total_tokens": r.prompt_tokens + len(r.ids),
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": f"resp_{r.id}", "object": "response", "created_at": r.created, "status": status, "model": req.model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.system, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "metadata": {}}


class ResponsesWriter(OpenAIWriter):
    """OpenAI's errors and pings; a stream is named events with sequence numbers: created, in_progress, per item
    added/delta/done, then completed or incomplete (or an error event)."""
    body = staticmethod(responses_body)

    def __init__(self, req: ChatRequest, plan: Plan):
        self.req, self.seq, empty = req, -1, Reply(plan.reply_id, plan.pending.prompt_tokens)
        shell = {**responses_body(req, empty), "status": "in_progress", "output": [], "usage": None}
        self.head = [self.event("response.created", response=shell), self.event("response.in_progress", response=shell)]

    def event(self, kind: str, **data) -> str:
        self.seq += 1
        return event(kind, sequence_number=self.seq, **data)

    def tail(self, r: Reply) -> list[str]:
        full, out = responses_body(self.req, r), []
        for i, item in enumerate(full["output"]):
            at = {"item_id": item["id"], "output_index": i}
            empty = {"message": {"content": []}, "function_call": {"arguments": ""}}.get(item["type"], {})
            out.append(self.event("response.output_item.added", output_index=i,
                                  item={**item, "status": "in_progress", **empty}))
            if item["type"] == "message":
                part, at = item["content"][0], {**at, "content_index": 0}
                out += [self.event("response.content_part.added", **at, part={**part, "text": ""}),
                        self.event("response.output_text.delta", **at, delta=part["text"], logprobs=[]),
                        self.event("response.output_text.done", **at, text=part["text"], logprobs=[]),
                        self.event("response.content_part.done", **at, part=part)]
            elif item["type"] == "function_call":
                out += [self.event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
                        self.event("response.function_call_arguments.done", **at, name=item["name"],
                                   arguments=item["arguments"])]
            out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out + [self.event(f"response.{full['status']}", response=full)]

    def error_event(self, e: ApiError) -> str:
        return self.event("error", **self.error(e, ""))


# --- Anthropic Messages: POST /v1/messages, /v1/messages/count_tokens
ANTHROPIC_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large", 500: "api_error",
                   503: "overloaded_error"}   # any other status: invalid_request_error


def parse_anthropic(body: dict, counting: bool = False, prior: tuple = (0, None, ()),
                    handles: dict = {}) -> ChatRequest:
    """A thinking block whose signature is one of our `handles` gets the exact reasoning text it stands for."""
    system, messages, (done, _, msgs) = body.get("system"), get(body, "messages", list, required=True), prior
    system, msgs = None if system is None else text_of(system, "system"), list(msgs)
    for _, m, p in objects(messages, "messages", done):
        role, content = get(m, "role", str, p, required=True), m.get("content")
        if role == "system":   # Claude Code sends its environment block as a system message inside messages
            msgs.append(Msg("system", text_of(content, p + "content")))
            continue
        if role not in ("user", "assistant"):
            raise bad(p + "role", f"unsupported role {role!r}: use user, assistant or system")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else \
            get(m, "content", list, p, required=True)
        texts, reasoning, calls, results = [], "", [], 0
        for j, b in enumerate(blocks):
            q, kind = f"{p}content.{j}.", b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(get(b, "text", str, q, required=True))
            elif kind == "image" and role == "user":
                texts.append(image_of(b, q))
            elif kind == "tool_result" and role == "user":
                results += 1
                msgs.append(Msg("tool", text_of(b.get("content"), q + "content", image="image"),
                                call_id=get(b, "tool_use_id", str, q, required=True)))
            elif kind == "tool_use" and role == "assistant":
                calls.append(Call(get(b, "id", str, q, required=True), get(b, "name", str, q, required=True),
                                  get(b, "input", dict, q) or {}))
            elif kind == "thinking" and role == "assistant":
                reasoning = handles.get(b.get("signature"), get(b, "thinking", str, q) or "")
            elif kind != "redacted_thinking" or role != "assistant":
                raise bad(q + "type", f"unsupported content block {kind!r} in a {role} message")
        if role == "assistant":
            msgs.append(Msg("assistant", "\n".join(texts), reasoning, tuple(calls)))
        elif texts or not results:   # tool results first, then the user's own text (the template's order)
            msgs.append(Msg("user", join_parts(texts)))
    max_tokens = None if counting else get(body, "max_tokens", int, required=True)
    tools, server = parse_tools(get(body, "tools", list) or [], "custom", "input_schema")
    choice = get(body, "tool_choice", dict) or {}
    forced = {"any": "", "tool": choice.get("name") if isinstance(choice.get("name"), str) else ""}
    forced = forced.get(get(choice, "type", str, "tool_choice."))   # a non-string type is a 400, not a dict key
    constraint = constrain(tools, forced, (get(body, "output_config", dict) or {}).get("format"),
                           ("tool_choice", "output_config.format"), bool(choice.get("disable_parallel_tool_use")))
    if body.get("thread") is not None:   # the SDK's tool runner then sends the whole conversation (no thread)
        raise ApiError(400, "thread: message threads are not supported here; send the whole conversation",
                       param="thread", code="thread_unsupported_request")
    return ChatRequest(get(body, "model", str, required=True), system, tools, msgs, "toolu_",
                       "prompt is too long: {n} tokens > {limit} maximum", max_tokens=max_tokens,
                       constraint=constraint, server_tools=server, prefill=bool(msgs) and msgs[-1].role == "assistant",
                       stop=tuple(s for s in get(body, "stop_sequences", list) or () if isinstance(s, str)),
                       seed=get(body, "seed", int), stream=bool(get(body, "stream", bool)))


def anthropic_body(req: ChatRequest, r: Reply) -> dict:
    stop = "tool_use" if r.calls else "stop_sequence" if r.stop_sequence else "end_turn"
    if r.finish == "length" and not r.calls:
        stop = "model_context_window_exceeded" if r.clamped else "max_tokens"
    blocks = [{"type": "thinking", "thinking": r.reasoning, "signature": r.handle}] if r.reasoning else []
    if r.content or not r.calls:
        blocks.append({"type": "text", "text": r.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in r.calls]
    return {"id": f"msg_{r.id}", "type": "message", "role": "assistant", "model": req.model, "content": blocks,
            "stop_reason": stop, "stop_sequence": r.stop_sequence,
            "usage": {"input_tokens": r.prompt_tokens, "output_tokens": len(r.ids)}}


class AnthropicWriter:
    """Replies, errors (529 for an engine down) and the model list; a stream is named events: message_start, pings
    while generating, per block start/delta/stop, message_delta, message_stop (or an error event)."""
    ping, overloaded, body = event("ping"), 529, staticmethod(anthropic_body)

    def __init__(self, req: ChatRequest, plan: Plan):
        self.req, empty = req, Reply(plan.reply_id, plan.pending.prompt_tokens)
        self.head = [event("message_start", message={**anthropic_body(req, empty), "content": [], "stop_reason": None})]

    def tail(self, r: Reply) -> list[str]:
        body, out = anthropic_body(self.req, r), []
        for i, block in enumerate(body["content"]):
            if block["type"] == "tool_use":
                start = {**block, "input": {}}
                deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
            else:   # text, or thinking with the signature last, in its own delta, as Anthropic sends it
                fields = ("thinking", "signature") if block["type"] == "thinking" else ("text",)
                start = {**block, **dict.fromkeys(fields, "")}
                deltas = [{"type": f"{f}_delta", f: block[f]} for f in fields]
            out += [event("content_block_start", index=i, content_block=start),
                    *[event("content_block_delta", index=i, delta=d) for d in deltas],
                    event("content_block_stop", index=i)]
        return out + [event("message_delta", usage={"output_tokens": len(r.ids)},
                            delta={k: body[k] for k in ("stop_reason", "stop_sequence")}), event("message_stop")]

    def error_event(self, e: ApiError) -> str:
        return sse("error", self.error(e, ""))

    @staticmethod
    def error(e: ApiError, request_id: str) -> dict:
        kind = ANTHROPIC_TYPES.get(e.status, "invalid_request_error")
        details = {"details": {"error_code": e.code}} if e.code == "thread_unsupported_request" else {}
        return {"type": "error", "error": {"type": kind, "message": e.message, **details}, "request_id": request_id}

    @staticmethod
    def models(name: str, created: int) -> dict:
        return {"data": [{"type": "model", "id": name, "display_name": name,
                          "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))}],
                "has_more": False, "first_id": name, "last_id": name}


# --- HTTP: the two protocol dispatch points (ChatServer.parse, WRITERS), attribution, routes, streaming
WRITERS = {"openai": OpenAIWriter, "anthropic": AnthropicWriter, "responses": ResponsesWriter}   # all written back


@dataclass
class Episode:
    id: str
    api_key: str
    openai_base_url: str      # OpenAI(base_url=..., api_key=<any but another episode's key>): by the path
    anthropic_base_url: str   # Anthropic(base_url=..., api_key=<the same>)


class ChatServer(SegmentStore):
    """The HTTP front over the segment store: episodes and their keys, routes, and the metrics."""

    def __init__(self, generator, tokenizer_path: str, args: ChatArgs = ChatArgs()):
        super().__init__(generator, tokenizer_path, args)
        self.model_name = args.model_name or tokenizer_path.rstrip("/").rsplit("/", 1)[-1]
        self.closed = OrderedDict()           # recently closed ids and keys -> True, for a clear 400
        self.episodes, self.keys, self.overheads_ms = {}, {}, deque(maxlen=100_000)
        self.tasks, self.base_url, self._uvicorn, self._serving, self.created = set(), "", None, None, int(time.time())
        routes = [("POST", "/v1/chat/completions", self.turn, "openai"),
                  ("POST", "/chat/completions", self.turn, "openai"), ("POST", "/v1/messages", self.turn, "anthropic"),
                  ("POST", "/v1/messages/count_tokens", self.count_tokens, "anthropic"),
                  ("POST", "/v1/responses", self.turn, "responses"), ("POST", "/responses", self.turn, "responses"),
                  ("GET", "/v1/models", self.models, None), ("GET", "/models", self.models, None),
                  ("GET", "/health", self.health, None)]   # protocol None: the anthropic-version header decides
        self.app = Starlette(routes=[Route(prefix + path, self.endpoint(fn, protocol), methods=[method])
                                     for prefix in ("", "/e/{episode}") for method, path, fn, protocol in routes],
                             exception_handlers={HTTPException: self.http_error})
        self.app.router.redirect_slashes = False   # a path with a trailing slash is a 404 in the protocol's shape

    async def start(self) -> str:
        """Serve on 127.0.0.1 at an OS-assigned port inside the running event loop; returns the base URL."""
        self._uvicorn = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                      access_log=False, lifespan="off"))
        self._serving = asyncio.create_task(self._uvicorn.serve())
        while not self._uvicorn.started:
            if self._serving.done():
                raise RuntimeError(f"chat server did not start: {self._serving.exception()!r}")
            await asyncio.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{self._uvicorn.servers[0].sockets[0].getsockname()[1]}"
        gc.freeze()   # ~500k long-lived start-up objects (torch, transformers): full collections stalled the loop 0.7 s
        return self.base_url

    async def stop(self) -> None:
        self._uvicorn.should_exit = True
        await self._serving

    def open_episode(self, affinity: str = "") -> Episode:
        """A new episode's URLs and key; its requests go to the engine that `affinity` picks (default: its own id)."""
        ep = EpisodeState(secrets.token_urlsafe(16), "sk-ep-" + secrets.token_urlsafe(24), affinity)
        self.episodes[ep.id], self.keys[ep.api_key] = ep, ep.id
        return Episode(ep.id, ep.api_key, f"{self.base_url}/e/{ep.id}/v1", f"{self.base_url}/e/{ep.id}")

    def close_episode(self, episode_id: str) -> list[Segment]:
        """Seal every segment of the episode and hand them over; later requests for it get a 400."""
        ep = self.episodes.pop(episode_id)
        del self.keys[ep.api_key]
        ep.closed = True
        self.closed.update({ep.id: True, ep.api_key: True})
        while len(self.closed) > 100_000:
            self.closed.popitem(last=False)
        return self.segments(ep)

    def metrics(self) -> dict:
        ms = sorted(self.overheads_ms)
        pct = {f"chat/overhead_ms_p{q}": ms[min(len(ms) - 1, len(ms) * q // 100)] for q in (50, 99)} if ms else {}
        return {**self.counts, **pct, "chat/open_episodes": len(self.episodes)}

    def parse(self, protocol: str, body: dict, ep: EpisodeState | None = None, counting: bool = False) -> ChatRequest:
        """The one dispatch for requests: the canonical form and every policy check, before any state changes. Messages
        extending a recent request's raw ones are parsed and hashed alone: a resent history costs O(new messages)."""
        raw, prior, hashes = body.get("messages"), (0, None, ()), ()
        for kind, seen, old in ep.parsed if ep is not None and isinstance(raw, list) else ():
            if kind == protocol and len(seen) <= len(raw) and raw[:len(seen)] == seen:
                prior, hashes = (len(seen), old.system, old.msgs), old.hashes
                break
        handles = ep.handles if ep is not None else {}
        if protocol == "openai":
            req = parse_openai(body, prior)
        elif protocol == "anthropic":
            req = parse_anthropic(body, counting, prior, handles)
        else:   # responses: items merge into turns across items, so always parsed whole, never remembered
            req, raw = parse_responses(body, handles), None
        if self.args.strict_model and req.model != self.model_name:
            unknown = f"model: {req.model}" if protocol == "anthropic" else f"The model '{req.model}' does not exist"
            raise ApiError(404, unknown, param="model", code="model_not_found", kind="invalid_request_error")
        ignored = sum(body.get(k) is not None for k in ("temperature", "top_p", "top_k"))
        self.counts["chat/ignored_sampling_params"] += ignored   # the generator's --rollout.* settings rule
        if req.changes and self.args.reject_sampling_changes:
            raise bad(req.changes[0], "changes the sampling distribution the trainer learns from; the server samples "
                                      "with the trainer's settings (--chat.reject_sampling_changes false ignores it)")
        self.counts["chat/ignored_params"] += len(req.changes)
        if req.constraint[0] and self.args.refuse_constrained:
            raise bad(req.constraint[1], "constrained decoding is refused here (--chat.refuse_constrained); "
                                         "--chat.refuse_constrained false samples under the constraint")
        self.counts["chat/constrained_requests"] += req.constraint[0] is not None
        self.counts["chat/server_tools_ignored"] += req.server_tools
        if req.max_tokens is not None and req.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if req.seed is not None and not -1 << 63 <= req.seed < 1 << 63:   # OpenAI's range; vLLM fails past 2**64
            raise bad("seed", "must be a 64-bit signed integer")
        if not req.msgs and req.system is None:
            raise bad("messages", "at least one message is required")
        if req.prefill and (req.msgs[-1].calls or req.msgs[-1].reasoning):
            raise bad(f"messages.{len(body['messages']) - 1}.content", "a prefill (a last, assistant message) is "
                                                                      "continued as text: it may hold text blocks only")
        seen = set()
        for m in req.msgs if self.args.check_tool_ids else ():
            seen.update(c.id for c in m.calls)
            if m.role == "tool" and m.call_id not in seen:
                raise bad("messages", f"tool result for unknown tool call id {m.call_id!r}")
        req.hashes = chain_hashes(req.system, req.tools, req.msgs, hashes)
        if ep is not None and isinstance(raw, list):
            ep.parsed.appendleft((protocol, raw, req))
        return req

    def attribute(self, request: Request) -> EpisodeState:
        """The episode: path /e/{id}/..., else the API key (Bearer wins over X-Api-Key). Both are secrets; on a
        path any key is accepted (SDKs insist on one) except another episode's, which is refused like a bad key."""
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        token = episode = request.path_params.get("episode")
        if token is None:
            token, episode = key, self.keys.get(key)
        if token in self.closed:
            raise ApiError(400, "episode closed: its segments were handed to the trainer; start a new episode")
        if episode not in self.episodes or self.keys.get(key, episode) != episode or key in self.closed:
            raise ApiError(401, "unknown API key or episode, or the key of another episode than the path's",
                           code="invalid_api_key")
        request.state.episode = self.episodes[episode]
        return request.state.episode

    async def read_json(self, request: Request) -> tuple[dict, float]:
        """The body as a JSON object, and the time it had fully arrived (overhead is counted from there)."""
        limit, size, chunks = self.args.max_body_mb << 20, 0, []
        async for chunk in request.stream():   # read to the end even past the limit, so the client sees the 413
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
        if size > limit:
            raise ApiError(413, f"request body of {size} bytes exceeds --chat.max_body_mb {self.args.max_body_mb} MiB")
        arrived = time.perf_counter()
        try:
            body = json.loads(data := b"".join(chunks))
            if b"\\u" in data:   # an escaped lone surrogate parses, then breaks tokenizers and UTF-8 replies
                json.dumps(body, ensure_ascii=False).encode()
        except ValueError as e:
            raise ApiError(400, f"could not parse JSON body: {e}", code="invalid_json")
        if not isinstance(body, dict):
            raise ApiError(400, "could not parse JSON body: expected an object", code="invalid_json")
        return body, arrived

    def endpoint(self, handler, protocol: str | None):
        async def run(request: Request) -> Response:
            proto = protocol or ("anthropic" if "anthropic-version" in request.headers else "openai")
            try:
                return await handler(request, proto)
            except RecursionError:   # what recurses here follows the request's nesting (JSON, namespace tools)
                deep = f"the request nests JSON too deeply (past Python's recursion limit, {sys.getrecursionlimit()})"
                return self.error_response(proto, ApiError(400, deep + ": flatten it"))
            except Exception as e:   # any other than an ApiError is a bug of ours: a 500, the episode never trained
                e = e if isinstance(e, ApiError) else self.taint(getattr(request.state, "episode", None), e)
                return self.error_response(proto, e)
        return run

    async def http_error(self, request: Request, e: HTTPException) -> Response:
        proto = "anthropic" if "anthropic-version" in request.headers else "openai"   # a path no route knows
        return self.error_response(proto, ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

    def error_response(self, protocol: str, e: ApiError) -> Response:
        request_id, w = "req_" + secrets.token_hex(12), WRITERS[protocol]
        retry = {"x-should-retry": "true", "retry-after": "2"} if e.status == 503 else {"x-should-retry": "false"}
        return JSONResponse(w.error(self.counted(e), request_id), headers={**retry, "request-id": request_id},
                            status_code=w.overloaded if e.status == 503 else e.status)

    def counted(self, e: ApiError) -> ApiError:
        self.counts[f"chat/errors_{e.status}"] += 1   # by our status: 503 is the engine being down, in any protocol
        return e

    async def turn(self, request: Request, protocol: str) -> Response:
        ep = self.attribute(request)
        body, start = await self.read_json(request)
        req = self.parse(protocol, body, ep)
        retries = request.headers.get("x-stainless-retry-count", "0")
        retried = retries.isascii() and retries.isdigit() and retries.strip("0") != ""   # int("²") would raise
        async with ep.lock:
            plan = self.plan_turn(ep, req, int(retried))
        self.counts[f"chat/requests_{plan.kind.lower()}"] += 1
        task = asyncio.ensure_future(self.run_turn(ep, req, plan))   # runs to commit even if the client leaves
        self.tasks.add(task)
        task.add_done_callback(lambda t: (self.tasks.discard(t), t.cancelled() or t.exception()))
        if req.stream:
            return StreamingResponse(self.stream(ep, WRITERS[protocol](req, plan), task, plan, start),
                                     media_type="text/event-stream", headers={"cache-control": "no-cache"})
        watch = asyncio.ensure_future(self.watch(request, plan.pending))
        try:
            response = JSONResponse(WRITERS[protocol].body(req, await asyncio.shield(task)))
        finally:
            watch.cancel()
        self.overheads_ms.append((time.perf_counter() - start - plan.gen_s) * 1000)
        return response

    @staticmethod
    async def watch(request: Request, pending: Pending) -> None:
        """Mark the turn when its client disconnects before the reply (the body is read: only that message is left)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        pending.gone = True

    async def stream(self, ep: EpisodeState, w, task: asyncio.Task, plan: Plan, start: float):
        """Headers and first frames at once, keep-alive frames while generating, then the whole turn; an error after
        the headers is the protocol's error event. A client leaving before the whole turn marks it, as `watch` does."""
        sent = False
        try:
            for frame in w.head:
                yield frame
            while not (await asyncio.wait({task}, timeout=self.args.ping_s))[0]:   # nothing done within ping_s
                yield w.ping
            frames, sent = w.tail(task.result()), True
            for frame in frames:
                yield frame
            self.overheads_ms.append((time.perf_counter() - start - plan.gen_s) * 1000)
        except Exception as e:   # any other than an ApiError is a bug of ours, as in `endpoint`
            yield w.error_event(self.counted(e) if isinstance(e, ApiError) else self.taint(ep, e))
        finally:
            plan.pending.gone = plan.pending.gone or not sent

    async def count_tokens(self, request: Request, protocol: str) -> Response:
        self.attribute(request)
        req = self.parse(protocol, (await self.read_json(request))[0], counting=True)
        try:
            return JSONResponse({"input_tokens": len(self.render_request(req)[0])})
        except ValueError as e:
            raise bad("messages", str(e)) from None

    async def models(self, request: Request, protocol: str) -> Response:
        return JSONResponse(WRITERS[protocol].models(self.model_name, self.created))

    async def health(self, request: Request, protocol: str) -> Response:
        return JSONResponse({"status": "ok"})
