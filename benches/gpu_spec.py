#!/usr/bin/env python3
"""Speculative decoding on the GPU: the cost of a verify step on real shapes, and tokens per second
with the mean accepted length on the demo model. Records go to --out (JSON list).

Parts (both by default):
  verify  Llama-3-8B and Qwen3.5-27B shapes (random bf16 weights, --layers of them): one verify
          step of K + 1 tokens a sequence (K = 1, 3, 5) against one plain decode step, at batch 1
          and 8, each sequence at the end of a --prompt-token prompt (`_core.Model.step_seconds`:
          the steps as the engine runs them, the verify step with its rollback copies and the
          greedy rows' argmax on the device, ids only to the host). Metric `spec_verify_step_ratio` (median verify step / median plain step); the
          ceiling is 1.0 (decode is bandwidth-bound: the verify step reads the same weights), so
          fraction_of_ceiling = 1 / ratio. Peer (K = 3): the same ratio of transformers' forward with its
          KV cache (K + 1 new tokens against 1), same GPU, same call. On the 27B shape the engine's
          whole MTP round (drafting included; random MTP head) is timed too
          (`spec_round_step_ratio`: mean step time under `--spec mtp` / plain's).
  demo    The bundled demo model on held-out code windows: generated tokens per second and mean
          accepted length for plain, MTP K = 1..5, n-gram K = 3, 5 and DFlash K = 3, 7 (the shipped
          drafter) at batch 1, 8 and 32, greedy; each speculative run's tokens are checked against
          plain's (`equal_to_plain`; `--batch-invariant` runs every route independent of the batch).

Usage: python benches/gpu_spec.py --out FILE [--parts verify,demo] [--layers 16] [--commit SHA] [--tiny]
(`--tiny`: tiny shapes on the CPU, a dry run of the script.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benches"))
import gpu_bench as gb  # noqa: E402

DEMO = REPO / "python" / "ninfer" / "demo"
BATCHES = (1, 8)


def add_mtp_shard(b: gb.Bench, s: dict, path: Path) -> None:
    """A random MTP head (Qwen3.5 names: fc, the two pre-fc norms, one gated full-attention layer,
    its norm) in a shard of its own, declared in config.json: transformers neither builds nor
    saves `mtp.*`."""
    from safetensors.torch import save_file

    torch = b.torch
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("mtp_num_hidden_layers"):
        return
    h, ffn, hd = s["hidden"], s["ffn"], s["head_dim"]
    g = torch.Generator(device=b.dev).manual_seed(7)

    def w(*shape):
        return (torch.randn(shape, generator=g, device=b.dev) * 0.02).to(torch.bfloat16).cpu()

    def norm(n):
        return torch.zeros(n, dtype=torch.bfloat16)

    p = "mtp.layers.0."
    t = {
        "mtp.fc.weight": w(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": norm(h),
        "mtp.pre_fc_norm_hidden.weight": norm(h), "mtp.norm.weight": norm(h),
        p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
        p + "self_attn.q_proj.weight": w(2 * s["heads"] * hd, h), p + "self_attn.k_proj.weight": w(s["kv_heads"] * hd, h),
        p + "self_attn.v_proj.weight": w(s["kv_heads"] * hd, h), p + "self_attn.o_proj.weight": w(h, s["heads"] * hd),
        p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
        p + "mlp.gate_proj.weight": w(ffn, h), p + "mlp.up_proj.weight": w(ffn, h), p + "mlp.down_proj.weight": w(h, ffn),
    }
    save_file(t, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in t})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def peer_ratio(b: gb.Bench, path: Path, prompts: list, k: int, reps: int = 5) -> float | None:
    """transformers: median time of a forward of K + 1 new tokens over a prefilled KV cache /
    that of 1 new token (the cache prefilled again, untimed, before each)."""
    import transformers as tf

    torch = b.torch
    model = getattr(b, "_peer_model", None)
    if model is None or b._peer_path != path:
        b._peer_model = model = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(b.dev).eval()
        b._peer_path = path
    ids = torch.tensor(prompts, device=b.dev)

    def timed(n: int) -> float:
        out = []
        for _ in range(reps + 1):
            with torch.no_grad():
                cache = model(ids, use_cache=True).past_key_values
                new = ids[:, -1:].repeat(1, n)
                sync(torch)
                t = time.perf_counter()
                model(new, past_key_values=cache, use_cache=True)
                sync(torch)
                out.append(time.perf_counter() - t)
        return statistics.median(out[1:])

    return timed(k + 1) / timed(1)


def sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_round_ratio(b: gb.Bench, path: Path, prompts: list, k: int, steps: int = 24) -> tuple:
    """(mean step seconds under --spec mtp K / plain's, mean accepted length): the engine's steps
    after every request's first token, greedy, the same prompts."""
    from ninfer import _core

    def mean_step(**kw) -> tuple:
        eng = _core.Engine(str(path), device=b.ninfer_device, max_context=1024, kv_capacity=len(prompts) * 1024,
                           max_concurrency=len(prompts), prefill_chunk=2048, prefix_reuse=False, **kw)
        params = gb._core_params(json.dumps({"max_tokens": steps * (k + 1) + 8, "temperature": 0.0, "ignore_eos": True}))
        for i, p in enumerate(prompts):
            eng.submit(f"r{i}", p, params)
        seen: set = set()
        while len(seen) < len(prompts):
            seen |= {d["request_id"] for d in eng.step() if d["token_ids"]}
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        dt = (time.perf_counter() - t) / steps
        st = eng.stats()
        eng.shutdown()
        return dt, st.get("spec_mean_accepted_length")

    plain, _ = mean_step()
    spec, acc = mean_step(spec="mtp", draft_tokens=k)
    return spec / plain, acc


def part_verify(b: gb.Bench, model: str) -> list:
    from ninfer import _core

    a = b.a
    s = b.shape(model)
    path = b.checkpoint(model)
    mtp = s["arch"] == "qwen3_5"
    if mtp:
        add_mtp_shard(b, s, path)
    recs = []
    m = _core.Model(str(path), device=b.ninfer_device)
    for batch in BATCHES:
        prompts = [gb.random_prompt(a.prompt, s["vocab"], 10 + i) for i in range(batch)]
        plain = statistics.median(m.step_seconds(prompts, 1, a.steps))
        for k in a.ks:
            verify = statistics.median(m.step_seconds(prompts, k + 1, a.steps))
            ratio = verify / plain
            peer = None
            if not a.skip_peer and k == 3:
                try:
                    peer = peer_ratio(b, path, prompts, k)
                except Exception as e:  # noqa: BLE001 - a peer that cannot run leaves the row without one
                    gb.log(f"peer {model} K={k} batch {batch}: {type(e).__name__}: {e}")
            gb.log(f"verify {model} batch {batch} K={k}: {verify * 1e3:.3f} ms vs plain {plain * 1e3:.3f} ms: "
                   f"{ratio:.3f}x (transformers {peer and round(peer, 3)}x)")
            recs.append(b.record("spec_verify_step_ratio", model, round(ratio, 4), s, weights="bf16", spec="verify",
                                 draft_tokens=k, batch=batch, prompt_tokens=a.prompt,
                                 verify_step_ms=round(verify * 1e3, 4), plain_step_ms=round(plain * 1e3, 4),
                                 fraction_of_ceiling=round(1.0 / ratio, 4),
                                 ceiling="1.0: a verify step reads the same weights as a decode step",
                                 peer="transformers forward with its KV cache, K + 1 new tokens / 1 (bf16, same GPU)",
                                 peer_value=round(peer, 4) if peer else None, steps_timed=a.steps))
    del m
    b.__dict__.pop("_peer_model", None)
    if mtp and not a.skip_round:
        for batch in BATCHES:
            prompts = [gb.random_prompt(a.prompt, s["vocab"], 10 + i) for i in range(batch)]
            for k in a.ks:
                ratio, acc = engine_round_ratio(b, path, prompts, k)
                gb.log(f"MTP round {model} batch {batch} K={k}: {ratio:.3f}x a plain step (mean accepted {acc})")
                recs.append(b.record("spec_round_step_ratio", model, round(ratio, 4), s, weights="bf16", spec="mtp",
                                     draft_tokens=k, batch=batch, prompt_tokens=a.prompt,
                                     mean_accepted_length=acc,
                                     note="the engine's mean step time under --spec mtp (MTP drafting, verify, "
                                          "rollback) over plain's; random weights, so drafts are rarely accepted"))
    b.drop_checkpoint(model)
    return recs


def part_demo(b: gb.Bench) -> list:
    from ninfer import LLM, NinferError, SamplingParams

    a = b.a
    windows = json.loads((DEMO / "heldout_tokens.json").read_text())["sequences"]
    configs = [(None, 0)] + [("mtp", k) for k in range(1, 6)] + [("ngram", 3), ("ngram", 5), ("dflash", 3), ("dflash", 7)]
    recs = []
    for batch in (1, 8, 32):
        prompts = [windows[i % len(windows)][: a.demo_prompt] for i in range(batch)]
        base = None
        for spec, k in configs:
            kw = dict(spec=spec, draft_tokens=k) if spec else {}
            try:
                with LLM(DEMO / "model", device=b.ninfer_device, max_context=a.demo_prompt + a.demo_tokens + 16,
                         max_concurrency=batch, batch_invariant=a.batch_invariant, **kw) as llm:
                    params = SamplingParams(temperature=0.0, max_tokens=a.demo_tokens, ignore_eos=True)
                    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
                    t = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    dt = time.perf_counter() - t
                    st = llm.engine.stats()
            except NinferError as e:  # a method the backend refuses leaves no row
                gb.log(f"demo batch {batch} {spec} K={k}: {type(e).__name__}: {e}")
                continue
            toks = [o.token_ids for o in outs]
            tok_s = sum(map(len, toks)) / dt
            if base is None:
                base = (tok_s, toks)
            acc = st["spec_mean_accepted_length"] if spec else 1.0
            gb.log(f"demo batch {batch} {spec or 'plain'} K={k}: {tok_s:.1f} tok/s ({tok_s / base[0]:.2f}x), "
                   f"mean accepted {acc:.3f}, equal to plain {toks == base[1]}")
            recs.append({**b.record("decode_throughput_tok_s", "bundled demo model", round(tok_s, 2),
                                    dict(layers=None, full_layers=None)),
                         "weights": "bf16", "spec": spec or "none", "draft_tokens": k, "batch": batch,
                         "random_weights": False, "mean_accepted_length": round(acc, 4),
                         "acceptance_by_position": [round(r, 3) for r in st["spec_acceptance_by_position"]] if spec else [],
                         "equal_to_plain": toks == base[1], "speedup_vs_plain": round(tok_s / base[0], 4),
                         "batch_invariant": a.batch_invariant,
                         "peer": "plain decode (no speculation), same engine, same call", "peer_value": round(base[0], 2),
                         "prompt_tokens": a.demo_prompt, "output_tokens": a.demo_tokens,
                         "metric_note": "generated tokens / wall seconds of one generate call (prefill included), "
                                        "greedy, held-out code windows"})
    return recs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="verify,demo")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=40, help="verify: steps timed per configuration")
    p.add_argument("--demo-prompt", type=int, default=256)
    p.add_argument("--demo-tokens", type=int, default=128)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--workdir", default="/tmp/ninfer_spec_bench")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--models", default="llama-3-8b,qwen3_5-27b", help="verify: the shapes")
    p.add_argument("--ks", default="1,3,5", help="verify: the draft lengths K")
    p.add_argument("--skip-round", action="store_true", help="verify: leave out the engine's MTP round")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch-invariant", action="store_true",
                   help="demo: every route independent of the batch size (verify rows as decode rows)")
    a = p.parse_args(argv)
    ga = gb.parse_args(["--out", a.out, "--layers", str(a.layers), "--commit", a.commit, "--workdir", a.workdir,
                        "--prompt", "512", "--skip-peer"] + (["--tiny"] if a.tiny else []))
    ga.steps, ga.demo_prompt, ga.demo_tokens, ga.skip_peer = a.steps, a.demo_prompt, a.demo_tokens, a.skip_peer
    ga.ks, ga.skip_round, ga.batch_invariant = [int(k) for k in a.ks.split(",")], a.skip_round, a.batch_invariant
    b = gb.Bench(ga)
    parts = set(a.parts.split(","))
    if "verify" in parts:
        for model in a.models.split(","):
            gb.guarded(b, "spec_verify_step_ratio", model, lambda m=model: part_verify(b, m))
    if "demo" in parts:
        try:
            b.add(part_demo(b))
        except Exception as e:  # noqa: BLE001 - the verify records are already written
            gb.log(f"demo part failed: {type(e).__name__}: {e}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
