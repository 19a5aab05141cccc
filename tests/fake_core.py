"""A pure-Python stand-in for `_core.Engine`, so the HTTP layer can be tested without a model.

Same interface as the Rust engine (submit / abort / step / start_background / poll / stats /
info / tokenizer). The tokenizer is byte-level plus a few Qwen-style special tokens. Output is
deterministic: a prompt whose last user text contains `say:` makes the "model" emit exactly the
text after it and then EOS (so tests can script tool calls and `<think>` blocks); any other
prompt yields lowercase letters derived from a hash of the prompt and the position (and the
seed when sampling), until max_tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time

from ninfer._core import ContextOverflowError, Delta, InvalidRequestError

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
SKIPPED = {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
EOS = 256 + SPECIALS.index("<|im_end|>")
BLOCK = 16


class FakeTokenizer:
    """Byte-level tokenizer: ids 0..255 are bytes, 256.. are the special strings above."""

    vocab_size = 256 + len(SPECIALS)
    has_chat_template = True
    bos_token = None
    eos_token = "<|im_end|>"

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            for k, sp in enumerate(SPECIALS):
                if text.startswith(sp, i):
                    ids.append(256 + k)
                    i += len(sp)
                    break
            else:
                ids.extend(text[i].encode("utf-8"))
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens=True):
        out, buf = [], bytearray()
        for t in ids:
            if t < 256:
                buf.append(t)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            sp = SPECIALS[t - 256]
            if not (skip_special_tokens and sp in SKIPPED):
                out.append(sp)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_to_id(self, s):
        if s in SPECIALS:
            return 256 + SPECIALS.index(s)
        b = s.encode("utf-8")
        return b[0] if len(b) == 1 else None

    def apply_chat_template(self, messages_json, tools_json=None, add_generation_prompt=True, kwargs_json=None):
        messages = json.loads(messages_json)
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
        text = ""
        if tools_json:
            text += "<|im_start|>system\ntools: " + tools_json + "<|im_end|>\n"
        for m in messages:
            content = m.get("content") or ""
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content)
            text += f"<|im_start|>{m['role']}\n{content}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
            if kwargs.get("enable_thinking") is False:
                text += "<think>\n\n</think>\n\n"
        return text


    def encode_chat(self, messages_json, tools_json=None, add_generation_prompt=True, kwargs_json=None):
        return self.encode(self.apply_chat_template(messages_json, tools_json, add_generation_prompt, kwargs_json))


class _Req:
    def __init__(self, rid, prompt, params, script, cached):
        self.rid = rid
        self.prompt = prompt
        self.params = params
        self.script = script
        self.out = []
        self.sent_text = ""
        self.cached = cached


class FakeCore:
    """Deterministic engine with the `_core.Engine` interface; `step_delay_s` paces the steps."""

    def __init__(self, max_context=512, kv_capacity=4096, max_concurrency=64, step_delay_s=0.002):
        self.tokenizer = FakeTokenizer()
        self.eos_token_ids = [EOS]
        self.max_context = max_context
        self.max_concurrency = max_concurrency
        self.kv_blocks_total = kv_capacity // BLOCK
        self.step_delay_s = step_delay_s
        self._waiting = []
        self._running = []
        self._aborted = set()
        self._seen_blocks = set()
        self._lock = threading.Condition()
        self._out = []
        self._thread = None
        self._stop = False
        self.counters = dict(prefix_hit_tokens=0, prompt_tokens_total=0, generation_tokens_total=0,
                             prefill_tokens_computed=0, max_batch_size_seen=0, steps=0)

    def info(self):
        return {"max_concurrency": self.max_concurrency, "max_context": self.max_context, "device": "fake"}

    def submit(self, request_id, prompt_token_ids, params):
        # The core's typed params (what AsyncEngine sends), or their JSON (tests script requests so).
        params = json.loads(params if isinstance(params, str) else params.to_json())
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty: at least one token is required")
        max_tokens = params.get("max_tokens", 256)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f"invalid request field `max_tokens`: {max_tokens} must be at least 1")
        temp = params.get("temperature", 1.0)
        if temp < 0:
            raise InvalidRequestError(f"invalid request field `temperature`: {temp} must be a finite number >= 0")
        if len(prompt_token_ids) + max_tokens > self.max_context:
            raise ContextOverflowError(
                f"prompt of {len(prompt_token_ids)} tokens plus max_tokens {max_tokens} exceeds the maximum "
                f"context of {self.max_context} tokens")
        text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        script = None
        if "say:" in text:
            tail = text.rsplit("say:", 1)[1].split("<|im_end|>", 1)[0]
            script = self.tokenizer.encode(tail) + [EOS]
        with self._lock:
            cached = self._prefix_hit(prompt_token_ids)
            self._waiting.append(_Req(request_id, list(prompt_token_ids), params, script, cached))
            self._lock.notify_all()

    def submit_chat(self, request_ids, messages_json, params, tools_json=None, chat_template_kwargs_json=None,
                    max_tokens=None, default_max_tokens=None, add_generation_prompt=True):
        """As the core's: render, tokenize and queue one request per id (choice i: seed + i)."""
        text = self.tokenizer.apply_chat_template(messages_json, tools_json, add_generation_prompt,
                                                  chat_template_kwargs_json)
        ids = self.tokenizer.encode(text)
        if max_tokens is None:
            room = self.max_context - len(ids)
            if room < 1:
                err = ContextOverflowError(f"prompt of {len(ids)} tokens leaves no room in the maximum context of "
                                           f"{self.max_context} tokens")
                err.param = "messages"
                raise err
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        params = json.loads(params.to_json())
        for i, rid in enumerate(request_ids):
            p = dict(params, max_tokens=max_tokens)
            if p.get("seed") is not None:
                p["seed"] = (p["seed"] + i) & 0xFFFFFFFFFFFFFFFF
            try:
                self.submit(rid, ids, json.dumps(p))
            except Exception:
                for done in request_ids[:i]:
                    self.abort(done)
                raise
        return len(ids), text.rfind("<think>") > text.rfind("</think>"), True

    def _prefix_hit(self, ids):
        hit, h = 0, b""
        for i in range(0, len(ids) - BLOCK + 1, BLOCK):
            h = hashlib.sha1(h + bytes(str(ids[i:i + BLOCK]), "ascii")).digest()
            if h in self._seen_blocks:
                hit += BLOCK
            else:
                self._seen_blocks.add(h)
        return min(hit, len(ids) - 1) // BLOCK * BLOCK

    def abort(self, request_id):
        with self._lock:
            self._aborted.add(request_id)

    def has_unfinished(self):
        return bool(self._waiting or self._running)

    def _next_token(self, r):
        if r.script is not None:
            return r.script[len(r.out)] if len(r.out) < len(r.script) else EOS
        seed = r.params.get("seed") if r.params.get("temperature", 1.0) > 0 else None
        key = f"{r.prompt}|{len(r.out)}|{seed}".encode()
        return ord("a") + hashlib.sha1(key).digest()[0] % 26

    def step(self):
        deltas = []
        with self._lock:
            for r in self._waiting + self._running:
                if r.rid in self._aborted:
                    deltas.append(self._delta(r, [], "abort"))
            self._waiting = [r for r in self._waiting if r.rid not in self._aborted]
            self._running = [r for r in self._running if r.rid not in self._aborted]
            self._aborted.clear()
            while self._waiting and len(self._running) < self.max_concurrency:
                r = self._waiting.pop(0)
                self.counters["prompt_tokens_total"] += len(r.prompt)
                self.counters["prefix_hit_tokens"] += r.cached
                self.counters["prefill_tokens_computed"] += len(r.prompt) - r.cached
                self._running.append(r)
            if not self._running:
                return deltas
            self.counters["steps"] += 1
            self.counters["max_batch_size_seen"] = max(self.counters["max_batch_size_seen"], len(self._running))
            still = []
            for r in self._running:
                tok = self._next_token(r)
                r.out.append(tok)
                self.counters["generation_tokens_total"] += 1
                finish = None
                if tok in self.eos_token_ids or tok in r.params.get("stop_token_ids", []):
                    if not r.params.get("ignore_eos"):
                        finish = "stop"
                if finish is None and len(r.out) >= r.params.get("max_tokens", 256):
                    finish = "length"
                deltas.append(self._delta(r, [tok], finish))
                if finish is None and deltas[-1]["finish_reason"] is None:
                    still.append(r)
            self._running = still
        return deltas

    def _delta(self, r, toks, finish):
        skip = r.params.get("skip_special_tokens", True)
        full = self.tokenizer.decode(r.out, skip_special_tokens=skip)
        if finish is None and full.endswith("\ufffd"):
            full = full.rstrip("\ufffd")
        matched = None
        for s in r.params.get("stop", []) or []:
            at = full.find(s)
            if at >= 0:
                full, finish, matched = full[:at], "stop", s
        new = full[len(r.sent_text):] if full.startswith(r.sent_text) else ""
        r.sent_text = full if full.startswith(r.sent_text) else r.sent_text
        lp = None
        if r.params.get("logprobs") and toks:
            k = r.params.get("top_logprobs", 0)
            top = [[toks[0], -0.25]] + [[(toks[0] + i) % 256, -1.0 - i] for i in range(1, k)]
            lp = [{"token_id": toks[0], "logprob": -0.25, "top": top[:k]}]
        return Delta(r.rid, toks, new, finish, len(r.prompt), len(r.out), r.cached, lp, stop_reason=matched)

    def start_background(self):
        def loop():
            while not self._stop:
                with self._lock:
                    if not (self._waiting or self._running or self._aborted):
                        self._lock.wait(0.05)
                        continue
                deltas = self.step()
                with self._lock:
                    self._out.extend(deltas)
                    self._lock.notify_all()
                time.sleep(self.step_delay_s)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def poll(self, timeout_s=None):
        """Deltas as they come; None waits until there are some or the core is shut down."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while not self._out and not self._stop:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self._lock.wait(left)
            out, self._out = self._out, []
            return out

    def stats(self):
        with self._lock:
            used = sum(math.ceil((len(r.prompt) + len(r.out)) / BLOCK) for r in self._running)
            return dict(self.counters, running=len(self._running), waiting=len(self._waiting),
                        kv_blocks_used=used, kv_blocks_total=self.kv_blocks_total)

    def shutdown(self):
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2)


class SlowFakeCore(FakeCore):
    """FakeCore with 20 ms steps, so tests can act while a request is still running."""

    def __init__(self, **kwargs):
        kwargs.setdefault("step_delay_s", 0.02)
        super().__init__(**kwargs)


class SlowLoadingFakeCore(FakeCore):
    """FakeCore that takes 1.5 s to "load", so /health can be seen answering 503."""

    def __init__(self, **kwargs):
        time.sleep(1.5)
        super().__init__(**kwargs)


class FailingFakeCore(FakeCore):
    """FakeCore whose poll raises once, after the first few deltas, like an engine-thread failure."""

    def __init__(self, **kwargs):
        kwargs.setdefault("step_delay_s", 0.01)
        super().__init__(**kwargs)
        self.failed = False

    def poll(self, timeout_s):
        if not self.failed and self.counters["generation_tokens_total"] >= 3:
            self.failed = True
            raise RuntimeError("device lost")
        return super().poll(timeout_s)


class MidwayFailingFakeCore(FakeCore):
    """FakeCore that ends a request whose prompt says "fail midway" after three tokens with
    finish_reason "error" and the reason, as the engine ends a request whose grammar fails midway
    (the token it failed on is not output)."""

    ERROR = ("invalid request field `response_format`: grammar matcher failed consuming token 99: "
             "lexer error: too many expressions constructed")

    def _delta(self, r, toks, finish):
        if finish is None and len(r.out) > 3 and "fail midway" in self.tokenizer.decode(r.prompt):
            r.out.pop()
            return Delta(r.rid, [], "", "error", len(r.prompt), len(r.out), r.cached, error=self.ERROR)
        return super()._delta(r, toks, finish)
