"""Train the bundled demo model: a small Qwen3.5 (Gated DeltaNet + gated attention, with MTP).

One command, seeded, on one GPU in about six minutes:

    python tools/demo/train.py --out OUT_DIR [--steps N]

It lists the CPython stdlib's .py files, holds out ~2% of them, trains an 8k byte-level BPE on
the rest, builds chat examples (docstring -> function) from them, trains the model and its MTP
head with AdamW + cosine schedule under bf16 autocast, and writes into OUT_DIR:
    model/                 config.json, generation_config.json, model.safetensors (main + mtp.*),
                           tokenizer.json, tokenizer_config.json, chat_template.jinja
    heldout_tokens.json    a few held-out windows and the perplexity training measured on them
    training_record.json   corpus fingerprint, config, loss curve, held-out metrics, samples

The MTP head trained here (depth 1, on the corpus tokens, jointly with the trunk) is a starting
point only: the shipped head is then retrained by train_mtp.py with this trunk frozen, on the
trunk's own greedy continuations and recursively at the depths it drafts, because greedy
speculation accepts agreement with the trunk's argmax at every draft depth, not the corpus token.

Without --steps the step count is chosen from the measured step time so training fills
--train-seconds; the chosen count is recorded, and passing it as --steps repeats the run
(same data order, same initialization; GPU kernels may still differ in the last bits).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import bpe_tokenizer
import corpus
from heldout_eval import as_saved_fp32, heldout_metrics
from mtp_head import MtpHead

MTP_LOSS_WEIGHT = 0.3
"""The MTP loss is added to the main loss with this weight (as in DeepSeek-V3's MTP training)."""

SHIPPED_HELDOUT_WINDOWS = 8
"""How many held-out windows ship with the model for ninfer's perplexity test."""

SAMPLE_PROMPTS = {
    "fibonacci": "def fibonacci(n):",
    "chat_gcd": "Write a Python function: Return the greatest common divisor of a and b.",
}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; the defaults are those of the shipped model's run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--steps", type=int, default=None, help="fixed step count (default: fit --train-seconds)")
    p.add_argument("--train-seconds", type=float, default=330.0)
    p.add_argument(
        "--deadline-seconds", type=float, default=540.0,
        help="whole-run budget: training stops early enough to evaluate and save before it",
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument(
        "--max-epochs", type=float, default=16.0,
        help="cap on passes over the training tokens (the corpus is small: more only overfits)",
    )
    p.add_argument("--chat-share", type=float, default=0.5, help="max chat examples per code file")
    p.add_argument("--tiny", action="store_true", help="smoke test: few files, tiny model, CPU ok")
    p.add_argument("--max-files", type=int, default=None)
    return p.parse_args(argv)


def build_config(vocab_size: int, tiny: bool, special_ids: dict):
    """The demo architecture: 8 layers, [3 x Gated DeltaNet, 1 x gated attention] x 2."""
    from transformers import Qwen3_5TextConfig

    pattern = ["linear_attention"] * 3 + ["full_attention"]
    hidden, inter, layers = (64, 128, 4) if tiny else (256, 960, 8)
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2 if not tiny else 1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64 if not tiny else 32,
        linear_value_head_dim=64 if not tiny else 32,
        linear_conv_kernel_dim=4,
        layer_types=pattern * (layers // 4),
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=special_ids["eos"],
        pad_token_id=special_ids["pad"],
    )


def tokenize_documents(tok, texts: list[str], eot_id: int) -> list[np.ndarray]:
    """Each document's ids followed by <|endoftext|>, as uint16 arrays."""
    docs = []
    for start in range(0, len(texts), 512):
        for enc in tok.encode_batch(texts[start : start + 512], add_special_tokens=False):
            docs.append(np.asarray(enc.ids + [eot_id], dtype=np.uint16))
    return docs


def heldout_windows(stream: np.ndarray, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of `seq_len` tokens cut from the held-out stream."""
    n = len(stream) // seq_len
    return torch.from_numpy(stream[: n * seq_len].astype(np.int64)).view(n, seq_len)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def training_loss(model, mtp, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Main next-token loss and MTP (token t+2) loss on a batch [B, L+1]."""
    inputs = batch[:, :-1]
    hidden = model.model(input_ids=inputs).last_hidden_state
    logits = model.lm_head(hidden)
    main = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    seq = inputs.shape[1] - 1
    next_embeds = model.model.embed_tokens(inputs[:, 1:])
    position_embeddings = model.model.rotary_emb(next_embeds, rope_positions(seq, batch.device))
    mtp_logits = model.lm_head(mtp(hidden[:, :seq], next_embeds, position_embeddings))
    mtp_loss = F.cross_entropy(mtp_logits.float().reshape(-1, mtp_logits.shape[-1]), batch[:, 2:].reshape(-1))
    return main, mtp_loss


def rope_positions(seq: int, device) -> torch.Tensor:
    """Position ids 0..seq-1 shaped [3, 1, seq]: the text, height and width rows of Qwen3.5's
    multimodal RoPE all equal for text (the shape every transformers 5.x version accepts)."""
    return torch.arange(seq, device=device).view(1, 1, -1).expand(3, 1, -1)


def snapshot(model, mtp) -> tuple[dict, dict]:
    """Detached copies of both state dicts (kept on the device) to restore the best probe."""
    return tuple({k: v.detach().clone() for k, v in m.state_dict().items()} for m in (model, mtp))


def param_groups(modules, weight_decay: float) -> list[dict]:
    """Matrices decay; norms, biases and the GDN decay parameters (A_log, dt_bias) do not."""
    decay, no_decay, seen = [], [], set()
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def greedy_complete(model, tok, prompt: str, max_new_tokens: int, eos_ids: list[int]) -> str:
    """Greedy continuation of `prompt` with transformers' generate (a record for the card)."""
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids], device=next(model.parameters()).device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[-1],
    )
    return tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=False)


def main(argv=None) -> None:
    """Run corpus -> tokenizer -> training -> held-out evaluation -> save (see module doc)."""
    args = parse_args(argv)
    t0 = time.time()
    timings: dict[str, float] = {}
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)

    root = corpus.stdlib_root()
    files = corpus.list_source_files(root, limit=args.max_files or (60 if args.tiny else None))
    train_files = [f for f in files if not corpus.is_heldout(f.relpath)]
    held_files = [f for f in files if corpus.is_heldout(f.relpath)]
    if args.tiny and not held_files:
        held_files = train_files[-2:]
        train_files = train_files[:-2]
    rng = random.Random(args.seed)
    chat_texts = []
    for f in train_files:
        examples = corpus.chat_examples(f, rng)
        rng.shuffle(examples)
        keep = examples[: max(1, int(len(examples) * args.chat_share))] if examples else []
        for ex in keep:
            thinking = rng.random() < 0.7
            chat_texts.append(bpe_tokenizer.chat_training_text(ex.request, ex.reasoning, ex.answer, thinking))
    timings["corpus_s"] = time.time() - t0
    print(f"corpus: {len(files)} files ({len(held_files)} held out), {len(chat_texts)} chat examples", flush=True)

    vocab = 512 if args.tiny else args.vocab
    tok = bpe_tokenizer.train_tokenizer((f.text for f in train_files), vocab)
    eot = tok.token_to_id(bpe_tokenizer.ENDOFTEXT)
    im_end = tok.token_to_id(bpe_tokenizer.IM_END)
    bpe_tokenizer.save_tokenizer(tok, model_dir, model_max_length=4096)
    timings["tokenizer_s"] = time.time() - t0

    code_docs = tokenize_documents(tok, [f.text for f in train_files], eot)
    chat_docs = tokenize_documents(tok, chat_texts, eot)
    chat_tokens = sum(len(d) for d in chat_docs)
    docs = code_docs + chat_docs
    rng.shuffle(docs)
    train_stream = np.concatenate(docs)
    held_stream = np.concatenate(tokenize_documents(tok, [f.text for f in held_files], eot))
    timings["encode_s"] = time.time() - t0
    print(f"tokens: train {len(train_stream)}, held-out {len(held_stream)}", flush=True)

    from transformers import GenerationConfig, Qwen3_5ForCausalLM

    config = build_config(vocab, args.tiny, {"eos": im_end, "pad": eot})
    seq_len = 128 if args.tiny else args.seq_len
    model = Qwen3_5ForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
    mtp = MtpHead(model.config).to(device)
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"params: main {n_main}, mtp {n_mtp}", flush=True)

    fused = device.type == "cuda"
    opt = torch.optim.AdamW(
        param_groups([model, mtp], args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused
    )
    torch.set_float32_matmul_precision("high")
    train_tensor = torch.from_numpy(train_stream.astype(np.int64))
    held_windows = heldout_windows(held_stream, seq_len)
    probe_windows = held_windows[torch.linspace(0, len(held_windows) - 1, min(16, len(held_windows))).long()]
    gen = torch.Generator().manual_seed(args.seed)
    batch_size = 4 if args.tiny else args.batch
    total = args.steps if args.steps is not None else (5 if args.tiny else 10**9)
    curve, evals = [], []
    timings["setup_s"] = time.time() - t0
    train_start = time.time()
    measured_from = None
    best = None
    model.train()
    mtp.train()
    step = 0
    while step < total:
        if args.steps is None and not args.tiny:
            if step == 10:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                measured_from = time.time()
            elif step == 40:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                per_step = (time.time() - measured_from) / 30
                budget = min(args.train_seconds, args.deadline_seconds - (train_start - t0) - 75.0)
                remaining = budget - (time.time() - train_start)
                total = 40 + int(remaining / per_step)
                total = min(total, int(args.max_epochs * len(train_stream) / (batch_size * seq_len)))
                print(f"step time {per_step * 1000:.1f} ms -> {total} steps", flush=True)
        lr = lr_at(step, total if total < 10**9 else 10**6, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(train_tensor) - seq_len - 1, (batch_size,), generator=gen)
        batch = torch.stack([train_tensor[o : o + seq_len + 1] for o in offsets.tolist()]).to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            main_loss, mtp_loss = training_loss(model, mtp, batch)
            loss = main_loss + MTP_LOSS_WEIGHT * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(mtp.parameters()), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == total:
            entry = {
                "step": step,
                "loss": round(main_loss.item(), 4),
                "mtp_loss": round(mtp_loss.item(), 4),
                "lr": lr,
                "grad_norm": round(grad_norm.item(), 3),
                "tokens": step * batch_size * seq_len,
                "elapsed_s": round(time.time() - train_start, 1),
            }
            curve.append(entry)
            print(json.dumps(entry), flush=True)
        if step % args.eval_every == 0 or step == total:
            model.eval()
            mtp.eval()
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                probe = heldout_metrics(model, mtp, probe_windows)
            model.train()
            mtp.train()
            evals.append({"step": step, "heldout_loss": round(probe["mean_nll"], 4),
                          "mtp_top1": round(probe.get("mtp_top1_accuracy_vs_data", 0.0), 4)})
            print(json.dumps(evals[-1]), flush=True)
            if best is None or probe["mean_nll"] < best[1]:
                best = (step, probe["mean_nll"], snapshot(model, mtp))
    final_step = step
    if best is not None and best[0] != step:
        model.load_state_dict(best[2][0])
        mtp.load_state_dict(best[2][1])
        print(f"held-out probe was best at step {best[0]}: restored it", flush=True)
    timings["train_s"] = time.time() - train_start

    torch.set_float32_matmul_precision("highest")
    model.eval()
    mtp.eval()
    eval_model, eval_mtp = as_saved_fp32(model), as_saved_fp32(mtp)
    full = heldout_metrics(eval_model, eval_mtp, held_windows)
    pick = torch.linspace(0, len(held_windows) - 1, min(SHIPPED_HELDOUT_WINDOWS, len(held_windows))).long()
    shipped_windows = held_windows[pick]
    shipped = heldout_metrics(eval_model, eval_mtp, shipped_windows)
    timings["eval_s"] = time.time() - t0
    print("held-out:", json.dumps(full), "\nshipped:", json.dumps(shipped), flush=True)

    samples = {}
    for name, text in SAMPLE_PROMPTS.items():
        prompt = text if not name.startswith("chat") else bpe_tokenizer.render_chat([{"role": "user", "content": text}])
        try:
            samples[name] = {"prompt": prompt, "completion": greedy_complete(eval_model, tok, prompt, 200, [im_end, eot])}
        except Exception as exc:  # a record only: a generate() API change must not lose the model
            samples[name] = {"prompt": prompt, "error": repr(exc)}

    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, eot], pad_token_id=eot, bos_token_id=None, max_new_tokens=512
    )
    model.to(torch.bfloat16).save_pretrained(str(model_dir), safe_serialization=True)
    add_mtp_tensors(model_dir, mtp)
    timings["total_s"] = time.time() - t0

    shipped_record = {
        "description": "Held-out CPython stdlib windows (files never trained on). ppl = exp(mean NLL of "
        "tokens 1..L-1 of each window given its prefix, each window scored alone), float32 math "
        "on the bf16 weights in model/.",
        "seq_len": seq_len,
        "sequences": shipped_windows.tolist(),
        "perplexity": shipped["perplexity"],
        "mean_nll": shipped["mean_nll"],
        "tokens_scored": shipped["tokens_scored"],
    }
    (out / "heldout_tokens.json").write_text(json.dumps(shipped_record) + "\n")
    record = {
        "command": "python tools/demo/train.py --out OUT" + (f" --steps {args.steps}" if args.steps else ""),
        "reproduce_with": f"python tools/demo/train.py --out OUT --steps {final_step} --seed {args.seed}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps": final_step,
        "weights_from_step": best[0] if best is not None else final_step,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "corpus": {
            "source": "CPython standard library .py files (PSF license)",
            "python_version": corpus.python_version(),
            "stdlib_root": str(root),
            "files_total": len(files),
            "files_heldout": len(held_files),
            "file_list_sha256": corpus.fingerprint(files),
            "heldout_rule": f"sha256(relpath)[:8] as big-endian int % {corpus.HELDOUT_MODULUS} == 0",
            "chat_examples": len(chat_texts),
            "chat_tokens": chat_tokens,
            "train_tokens": int(len(train_stream)),
            "heldout_tokens": int(len(held_stream)),
        },
        "params": {"main": n_main, "mtp": n_mtp},
        "tokens_seen": step * batch_size * seq_len,
        "epochs_seen": step * batch_size * seq_len / max(1, len(train_stream)),
        "heldout_full": full,
        "heldout_shipped": shipped,
        "loss_curve": curve,
        "heldout_probe_curve": evals,
        "samples": samples,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    (out / "training_record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"done in {timings['total_s']:.0f} s", flush=True)


def add_mtp_tensors(model_dir: Path, mtp: MtpHead) -> None:
    """Append the MTP head's bf16 tensors to model.safetensors and declare it in config.json."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, t in mtp.named_checkpoint_tensors().items():
        tensors[name] = t.to(torch.bfloat16).contiguous().cpu()
    save_file(tensors, str(path), metadata={"format": "pt"})
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["mtp_num_hidden_layers"] = len(mtp.layers)
    config["mtp_use_dedicated_embeddings"] = False
    config_path.write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
