"""The offline API: `LLM(model_dir).generate(prompts, params)` over the Rust engine.

All prompts of one call are submitted at once and stepped together, so the engine batches them
exactly as it batches concurrent server requests; this class only turns prompts into token ids
and folds the engine's deltas into `RequestOutput`s. It drives `_core.Engine.step()` on the
calling thread (no background thread), one GIL crossing per engine step.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
from typing import Iterator, List, Optional, Sequence, Union

from ninfer import _core
from ninfer.demo import default_drafter
from ninfer.outputs import CompletionOutput, Delta, GenerationError, RequestOutput
from ninfer.sampling_params import SamplingParams

#: What `generate` accepts as prompts: a string, token ids, or a list of either.
Prompts = Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]]

_instance_ids = itertools.count()


class LLM:
    """A model loaded into an engine on this process, for batch and scripted generation.

    The constructor arguments are the engine's (see `_core.Engine`): `max_context` and
    `kv_capacity` in tokens (None: derived from the model and memory), `max_concurrency`
    sequences per step, `prefill_chunk` tokens per step, `prefix_reuse` for the prefix cache,
    `num_threads` for the CPU backend (an error on a GPU), `logits_dtype` "auto" (logits rounded to the 16-bit
    dtype the model runs in, as transformers and vLLM produce them; docs/rounding.md) or "float32", `kv_dtype`
    "auto" or the type the backend keeps its KV cache in by name ("bf16" on a GPU, "float32" on the CPU; another
    is refused before the weights load). None for `device`, `logits_dtype` or `kv_dtype` is the default.
    `async_scheduling` keeps one step in flight while the host finishes the last (where the backend
    overlaps steps); `cuda_graphs` replays captured decode steps; `batch_invariant` makes every
    kernel choice independent of the batch size (a row's bits never depend on its batch, at some
    speed); `device_sampling` samples on the GPU (off: on the host). The last three are CUDA
    options and change nothing on the CPU; `device_profile` is a measured profile (JSON) whose
    routes override the GPU's default table, refused on the CPU. `json_schema_open_objects` lets a
    `response_format` json_schema's objects that do not say `additionalProperties` admit unlisted
    keys, as JSON Schema does (default: only the listed ones, as OpenAI reads them).
    `thinking_budget` is the
    reasoning budget (tokens) of calls that pass no sampling params, as `ninfer serve
    --reasoning-budget` sets it for requests (`SamplingParams.thinking_budget`).
    `spec` turns on speculative
    decoding ("ngram": drafts from the request's own tokens; "mtp": drafts from the model's mtp.*
    head; "dflash": block drafts from the DFlash drafter checkpoint in `drafter` (the bundled demo
    model's own by default; the CPU backend); each verified `draft_tokens`
    (1..8; default 3, dflash 7 and at most its block size - 1) at a time; ngram and mtp on the CPU
    and CUDA backends); greedy outputs are those of plain decoding, and so are seeded sampled ones
    under "ngram" (under "mtp" and "dflash" they follow plain sampling's distribution).
    `spec_adaptive` chooses each request's draft length per step (0..`draft_tokens`) from the
    measured step cost and its running acceptance. `lm_head_draft` (with spec="mtp") drafts over
    the `lm_head_draft_size` most frequent ids of the model directory's draft_vocab.json (default
    32768; `ninfer draft-vocab` makes the file).
    `quantize` ("w8", "q4", "q5", "q6", "fp8" or "nvfp4"; CUDA takes all but "nvfp4") quantizes a bf16/f16
    checkpoint's projection weights on load, round to nearest with the format's scales; the lm_head
    too with `quantize_lm_head` (embeddings stay as stored). A quantized checkpoint (its config.json
    `quantization_config`: FP8 block, AWQ, GPTQ, compressed-tensors) loads as quantized without it.
    """

    def __init__(
        self,
        model_dir: Union[str, os.PathLike],
        device: Optional[str] = "cpu",
        max_context: Optional[int] = None,
        kv_capacity: Optional[int] = None,
        max_concurrency: int = 64,
        prefill_chunk: int = 512,
        prefix_reuse: bool = True,
        num_threads: Optional[int] = None,
        logits_dtype: Optional[str] = "auto",
        kv_dtype: Optional[str] = "auto",
        async_scheduling: bool = True,
        cuda_graphs: bool = True,
        batch_invariant: bool = False,
        device_sampling: bool = True,
        device_profile: Optional[Union[str, os.PathLike]] = None,
        json_schema_open_objects: bool = False,
        thinking_budget: Optional[int] = None,
        spec: Optional[str] = None,
        draft_tokens: Optional[int] = None,
        drafter: Optional[Union[str, os.PathLike]] = None,
        spec_adaptive: bool = False,
        lm_head_draft: bool = False,
        lm_head_draft_size: Optional[int] = None,
        quantize: Optional[str] = None,
        quantize_lm_head: bool = False,
    ) -> None:
        self.model_dir = os.fspath(model_dir)
        device = _option_name("device", device, "cpu")
        logits_dtype = _option_name("logits_dtype", logits_dtype, "auto")
        kv_dtype = _option_name("kv_dtype", kv_dtype, "auto")
        self._core = _core.Engine(
            self.model_dir,
            device=device,
            max_context=max_context,
            kv_capacity=kv_capacity,
            max_concurrency=max_concurrency,
            prefill_chunk=prefill_chunk,
            prefix_reuse=prefix_reuse,
            num_threads=num_threads,
            logits_dtype=logits_dtype,
            kv_dtype=kv_dtype,
            async_scheduling=async_scheduling,
            cuda_graphs=cuda_graphs,
            batch_invariant=batch_invariant,
            device_sampling=device_sampling,
            device_profile=None if device_profile is None else os.fspath(device_profile),
            json_schema_open_objects=json_schema_open_objects,
            spec=spec,
            draft_tokens=draft_tokens,
            drafter=default_drafter(self.model_dir, spec, drafter),
            spec_adaptive=spec_adaptive,
            lm_head_draft=lm_head_draft,
            lm_head_draft_size=lm_head_draft_size,
            quantize=quantize,
            quantize_lm_head=quantize_lm_head,
        )
        self._tokenizer = self._load_tokenizer()
        self._default_params = self._load_default_params()
        if thinking_budget is not None:
            self._default_params = dataclasses.replace(self._default_params, thinking_budget=thinking_budget)
        self._ids = itertools.count()
        self._prefix = f"llm{next(_instance_ids)}"
        self._busy = False

    def _load_tokenizer(self):
        if hasattr(self._core, "tokenizer"):
            return self._core.tokenizer
        try:
            return _core.Tokenizer(self.model_dir)
        except _core.NinferError:
            return None

    def _load_default_params(self) -> SamplingParams:
        """generation_config.json's defaults, as the core parsed them at load."""
        return SamplingParams(**dict(self._core.generation_defaults))

    @property
    def engine(self):
        """The underlying `_core.Engine` (stats, info, scoring)."""
        return self._core

    @property
    def tokenizer(self):
        """The model's `_core.Tokenizer`, or None when the model has no tokenizer.json."""
        return self._tokenizer

    @property
    def max_context(self) -> int:
        """Longest prompt plus completion, in tokens, the engine accepts."""
        return int(self._core.max_context)

    @property
    def eos_token_ids(self) -> List[int]:
        """Token ids that end a completion unless `ignore_eos`."""
        return list(self._core.eos_token_ids)

    def get_default_sampling_params(self) -> SamplingParams:
        """The params used when a call passes none: generation_config.json's, else the defaults."""
        return copy.deepcopy(self._default_params)

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of `text` (with BOS where the tokenizer adds one, as transformers does)."""
        if self._tokenizer is None:
            raise _core.InvalidRequestError(
                f"{self.model_dir} has no tokenizer.json: pass token ids instead of text")
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`."""
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def chat_prompt_ids(
        self,
        messages: Sequence[dict],
        tools: Optional[Sequence[dict]] = None,
        chat_template_kwargs: Optional[dict] = None,
        add_generation_prompt: bool = True,
    ) -> List[int]:
        """Token ids of one conversation rendered with the model's chat template."""
        if self._tokenizer is None or not self._tokenizer.has_chat_template:
            raise _core.InvalidRequestError(
                f"{self.model_dir} has no chat template: use generate() with a plain prompt")
        return list(self._tokenizer.encode_chat(
            json.dumps(list(messages), ensure_ascii=False),
            json.dumps(list(tools), ensure_ascii=False) if tools else None,
            add_generation_prompt,
            json.dumps(chat_template_kwargs, ensure_ascii=False) if chat_template_kwargs else None,
        ))

    def generate(
        self,
        prompts: Prompts,
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
    ) -> List[RequestOutput]:
        """Generate for every prompt at once; one `RequestOutput` per prompt, in order.

        `prompts` is a string, a list of strings, a list of token ids or a list of lists of
        token ids. `params` is one `SamplingParams` for all, one per prompt, or None for the
        model's defaults. Bad input raises before anything runs (InvalidRequestError,
        ContextOverflowError with the numbers). A completion that fails midway (its
        `response_format` grammar cannot go on) raises `GenerationError` once every prompt has
        finished; its `outputs` holds the whole result, the failed completions with
        finish_reason "error" and their `error`.
        """
        items = [(text, self.encode(text) if ids is None else ids)
                 for text, ids in _normalize_prompts(prompts)]
        return self._generate_ids(items, params)

    def chat(
        self,
        messages: Union[Sequence[dict], Sequence[Sequence[dict]]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        tools: Optional[Sequence[dict]] = None,
        chat_template_kwargs: Optional[dict] = None,
        add_generation_prompt: bool = True,
    ) -> List[RequestOutput]:
        """Render each conversation with the chat template, then generate as `generate` does.

        `messages` is one conversation (a list of {"role", "content"} dicts) or a list of them;
        `chat_template_kwargs` such as {"enable_thinking": False} reach the template.
        """
        conversations = _normalize_conversations(messages)
        items = [(None, self.chat_prompt_ids(c, tools, chat_template_kwargs, add_generation_prompt))
                 for c in conversations]
        return self._generate_ids(items, params)

    def score(self, token_ids: Union[str, Sequence[int]]):
        """Logits of every position of `token_ids` (numpy float32 [T, vocab]), one forward."""
        ids = self.encode(token_ids) if isinstance(token_ids, str) else _as_token_ids(token_ids)
        return self._core.score(ids)

    def stream(
        self,
        prompt: Union[str, Sequence[int]],
        params: Optional[SamplingParams] = None,
    ) -> Iterator[Delta]:
        """Yield the engine's deltas for one prompt as they are produced (the CLI's path).

        Each is a `ninfer.Delta` (`delta.text`, or `delta["text"]` as a dict reads). Closing the
        iterator early aborts the request. A request that fails midway raises `GenerationError`
        in place of its last delta (which the exception carries as `delta`).
        """
        ids = self.encode(prompt) if isinstance(prompt, str) else _as_token_ids(prompt)
        params = self._resolve_params(params, 1)[0]
        if params.n != 1:
            raise _core.InvalidRequestError(
                f"invalid request field `n`: {params.n} (stream() gives one completion; use generate())")
        self._enter()
        pending = set()
        try:
            rid = self._submit(ids, params, 0)
            pending.add(rid)
            while pending:
                deltas = self._step_checked(pending)
                for d in deltas:
                    if d.request_id != rid:
                        continue
                    if d.finished:
                        pending.discard(rid)
                    if d.finish_reason == "error":
                        raise GenerationError(d.error or "the request failed", request_id=rid, delta=d)
                    yield d
        finally:
            self._abort_and_drain(pending)
            self._busy = False

    def close(self) -> None:
        """Stop the engine and free its memory; the object is unusable afterwards."""
        shutdown = getattr(self._core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _enter(self) -> None:
        if self._busy:
            raise RuntimeError("LLM is already generating (finish or close the running stream() first)")
        self._busy = True

    def _resolve_params(self, params, count: int) -> List[SamplingParams]:
        if params is None:
            return [self._default_params] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
            raise _core.InvalidRequestError(
                f"params: expected one SamplingParams or a list of {count}, got {len(params)} items")
        return params

    def _submit(self, ids: List[int], params: SamplingParams, index: int) -> str:
        rid = f"{self._prefix}-{next(self._ids)}"
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.max_context - len(ids))
        self._core.submit(rid, ids, params.to_core(max_tokens, params.seed_for(index)))
        return rid

    def _step_checked(self, pending: set) -> list:
        deltas = self._core.step()
        if not deltas and not self._core.has_unfinished():
            raise _core.NinferError(
                f"engine has no unfinished requests but {len(pending)} never finished: {sorted(pending)}")
        return deltas

    def _abort_and_drain(self, pending: set) -> None:
        if not pending:
            return
        for rid in pending:
            try:
                self._core.abort(rid)
            except _core.NinferError:
                pass
        for _ in range(1000):
            if not self._core.has_unfinished():
                break
            self._core.step()

    def _generate_ids(self, items, params) -> List[RequestOutput]:
        all_params = self._resolve_params(params, len(items))
        results = [RequestOutput(text, ids, [CompletionOutput(i) for i in range(p.n)])
                   for (text, ids), p in zip(items, all_params)]
        if not items:
            return results
        self._enter()
        route = {}
        try:
            for result, p in zip(results, all_params):
                for completion in result.outputs:
                    rid = self._submit(result.prompt_token_ids, p, completion.index)
                    route[rid] = completion
            pending = set(route)
            while pending:
                for d in self._step_checked(pending):
                    completion = route.get(d.request_id)
                    if completion is None:
                        continue
                    completion.add_delta(d)
                    if completion.finished:
                        pending.discard(d.request_id)
        finally:
            self._abort_and_drain({rid for rid, c in route.items() if not c.finished})
            self._busy = False
        _raise_failures(results)
        return results


def _option_name(name: str, value, default: str) -> str:
    """A string option of the engine (`device`, `logits_dtype`, `kv_dtype`): None is its default;
    another type is a TypeError naming the argument (the core's own says only "'int' object is
    not an instance of 'str'")."""
    if value is None:
        return default
    if not isinstance(value, str):
        raise TypeError(f"LLM({name}=...) must be a string such as {default!r}, got {type(value).__name__} {value!r}")
    return value


def _raise_failures(results: List[RequestOutput]) -> None:
    """Raise `GenerationError` when a completion failed midway, carrying every result."""
    failed = [(i, c) for i, r in enumerate(results) for c in r.outputs if c.finish_reason == "error"]
    if not failed:
        return
    i, first = failed[0]
    total = sum(len(r.outputs) for r in results)
    raise GenerationError(f"{len(failed)} of {total} completions failed; the first (prompt {i}, completion "
                          f"{first.index}): {first.error or 'the request failed'}", outputs=results)


def _is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def _as_token_ids(x) -> List[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if not _is_token_ids(x):
        raise _core.InvalidRequestError("prompt: expected a string or a list of token ids (ints)")
    bad = [t for t in x if t < 0]
    if bad:
        raise _core.InvalidRequestError(f"prompt: token id {bad[0]} is negative")
    return list(x)


def _normalize_prompts(prompts) -> List[tuple]:
    """(text or None, token ids or None) per prompt."""
    if isinstance(prompts, str):
        return [(prompts, None)]
    if hasattr(prompts, "tolist"):
        prompts = prompts.tolist()
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [(None, _as_token_ids(prompts))]
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, None))
        else:
            out.append((None, _as_token_ids(p)))
    return out


def _normalize_conversations(messages) -> List[list]:
    messages = list(messages)
    if not messages:
        raise _core.InvalidRequestError("messages: at least one message is required")
    if all(isinstance(m, dict) for m in messages):
        return [messages]
    if all(isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c) for c in messages):
        return [list(c) for c in messages]
    raise _core.InvalidRequestError(
        "messages: expected a list of {role, content} dicts or a list of such lists")
