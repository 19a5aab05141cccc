"""Retrain the demo model's MTP head (`mtp.*`) for greedy speculation, its trunk frozen (CPU).

    .ci/dev-build && python tools/demo/train_mtp.py --out OUT_MODEL_DIR [--train-seconds 1800]

The trunk's weights (and so every plain greedy output) stay exactly as shipped: OUT_MODEL_DIR is
a copy of --model whose model.safetensors differs only in the `mtp.*` tensors.

The head is trained for what greedy speculation accepts, as the engine drives it:
- Data: windows of PROMPT_MIN..PROMPT_MAX tokens of the demo's training corpus (the CPython
  stdlib files that are not held out, corpus.py), each continued greedily by the trunk for
  CONTINUE tokens (ninfer's CPU engine), with the trunk's final hidden states (what the engine
  hands the head) and its top-TOPK next-token distribution at every position.
- Labels: the trunk's own greedy tokens (acceptance is agreement with its argmax), plus the
  cross-entropy with its top-k distribution (`--distill`), not the corpus tokens.
- Recursion: from every anchor in the greedy part the head drafts `--depths` tokens, each draft
  row reading the drafted token and the head's own normed output at the previous depth, at the
  next position, attending to the rows of the trunk's hidden states up to the anchor and the
  anchor's earlier draft rows: exactly the MTP KV the engine's drafter sees at K = depths. A head
  trained on depth 1 only is used out of distribution from the second draft on, which is what
  capped the jointly trained head's acceptance at K >= 2.
- Start from the shipped head; AdamW, warmup then cosine decay over the wall-clock budget; the
  checkpoint with the best expected accepted length at K = 3 on validation sequences (training
  corpus windows kept out of the optimisation) is written, rounded to bf16.

The record goes to tools/demo/mtp_training_record.json; the data is cached (`--cache`). Shipping
a head is copying OUT_MODEL_DIR/model.safetensors over the demo's and the record's
`heldout_teacher_forced` MTP figures into training_record.json's `heldout_shipped` /
`heldout_full` (tests/test_mtp_head.py checks the engine reproduces them).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "python"))

import corpus  # noqa: E402
from mtp_head import MtpHead  # noqa: E402

PROMPT_MIN, PROMPT_MAX = 32, 512
CONTINUE = 128
TOPK = 32
EVAL_DEPTHS = 5
FULL_HELDOUT_WINDOWS = 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="model directory to write (a copy of --model)")
    p.add_argument("--model", type=Path, default=REPO / "python" / "ninfer" / "demo" / "model")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--sequences", type=int, default=576)
    p.add_argument("--val-sequences", type=int, default=48)
    p.add_argument("--train-seconds", type=float, default=1800.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--depths", type=int, default=3, help="draft depths trained (the K the head is tuned for)")
    p.add_argument("--depth-weights", type=float, nargs="+", default=[1.0, 1.0, 1.0])
    p.add_argument("--distill", type=float, default=1.0, help="weight of the top-k soft-label term")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", type=Path, default=Path("/tmp/demo_mtp_train_data.pt"))
    p.add_argument("--record", type=Path, default=HERE / "mtp_training_record.json")
    return p.parse_args(argv)


def corpus_prompts(tok_path: Path, n: int, seed: int) -> tuple[list[list[int]], str, int]:
    """`n` random windows of the non-held-out corpus, PROMPT_MIN..PROMPT_MAX tokens long; the
    corpus fingerprint and the number of training files."""
    from tokenizers import Tokenizer

    files = corpus.list_source_files(corpus.stdlib_root())
    train = [f for f in files if not corpus.is_heldout(f.relpath)]
    tok = Tokenizer.from_file(str(tok_path))
    rng = random.Random(seed)
    stream: list[int] = []
    for enc in tok.encode_batch([f.text for f in train], add_special_tokens=False):
        stream.extend(enc.ids + [0])
    starts = rng.sample(range(len(stream) - PROMPT_MAX), n)
    lengths = [rng.randint(PROMPT_MIN, PROMPT_MAX) for _ in starts]
    return [stream[s : s + p] for s, p in zip(starts, lengths)], corpus.fingerprint(files), len(train)


def build_data(args) -> dict:
    """Prompts, greedy continuations, the trunk's hidden states and top-k (cached)."""
    if args.cache.exists():
        return torch.load(args.cache)
    from ninfer import _core

    t0 = time.time()
    n = args.sequences + args.val_sequences
    prompts, fp, n_files = corpus_prompts(args.model / "tokenizer.json", n, args.seed)
    model = _core.Model(str(args.model), num_threads=args.threads)
    seqs = []
    for i in range(0, n, 32):
        toks, _, _ = model.decode_greedy(prompts[i : i + 32], CONTINUE)
        seqs.extend(p + list(t) for p, t in zip(prompts[i : i + 32], toks))
        print(f"greedy {len(seqs)}/{n} {time.time() - t0:.0f}s", flush=True)
    del model
    target = _core.MtpDrafter(str(args.model), num_threads=args.threads, logits_dtype="float32",
                              max_tokens=PROMPT_MAX + CONTINUE + 8)
    ids, hidden, top_logp, top_ids = [], [], [], []
    for i, seq in enumerate(seqs):
        logits, h = target.target(seq)
        v, k = torch.from_numpy(logits).log_softmax(-1).topk(TOPK, -1)
        ids.append(torch.tensor(seq, dtype=torch.long))
        hidden.append(torch.from_numpy(h).clone())
        top_logp.append(v.half())
        top_ids.append(k.short())
        if i % 64 == 0:
            print(f"target {i}/{n} {time.time() - t0:.0f}s", flush=True)
    data = {"ids": ids, "hidden": hidden, "top_logp": top_logp, "top_ids": top_ids,
            "prompt_lens": [len(p) for p in prompts], "fingerprint": fp, "train_files": n_files,
            "seconds": time.time() - t0}
    torch.save(data, args.cache)
    return data


class Frozen:
    """The trunk's tensors the head reads (embedding = tied LM head) and its rotary embedding."""

    def __init__(self, model_dir: Path):
        from safetensors.torch import load_file
        from transformers import AutoConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

        self.config = AutoConfig.from_pretrained(str(model_dir))
        self.tensors = load_file(str(model_dir / "model.safetensors"))
        self.embed = self.tensors["model.embed_tokens.weight"].float()
        self.rotary = Qwen3_5TextRotaryEmbedding(self.config)


def layer_rows(mtp: MtpHead, x, cos, sin, ctx, mask):
    """The MTP decoder layer over rows `x` [B, T, H] whose keys are `ctx` (K, V of earlier rows,
    or None) then their own, under the boolean `mask` [B, 1, T, keys]; returns (out, (K, V))."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    layer = mtp.layers[0]
    attn = layer.self_attn
    b, t, _ = x.shape
    hd = attn.head_dim
    h = layer.input_layernorm(x)
    q, gate = torch.chunk(attn.q_proj(h).view(b, t, -1, hd * 2), 2, dim=-1)
    gate = gate.reshape(b, t, -1)
    q = attn.q_norm(q).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(h).view(b, t, -1, hd)).transpose(1, 2)
    v = attn.v_proj(h).view(b, t, -1, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if ctx is not None:
        k, v = torch.cat([ctx[0], k], dim=2), torch.cat([ctx[1], v], dim=2)
    g = attn.num_key_value_groups
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                       attn_mask=mask, scale=attn.scaling)
    o = o.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate)
    x = x + attn.o_proj(o)
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return mtp.norm(x), (k, v)


def head_input(mtp: MtpHead, frozen: Frozen, hidden, tokens):
    return mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(frozen.embed[tokens]), mtp.pre_fc_norm_hidden(hidden)], dim=-1))


def chain_logits(mtp: MtpHead, frozen: Frozen, data: dict, rows: list[int], depths: int):
    """Draft logits of every anchor at depths 1..`depths`: a list of [B, M, V] and the labels
    [B, M, depths] (-1 where the sequence ends first), M = CONTINUE - 1 anchors per sequence
    (the last prompt position and every greedy position after it but the last)."""
    b = len(rows)
    seqs = [data["ids"][r] for r in rows]
    r_max = max(len(s) for s in seqs) - 1
    m = CONTINUE - 1
    hid = torch.zeros(b, r_max, frozen.embed.shape[1])
    nxt = torch.zeros(b, r_max, dtype=torch.long)
    for i, (row, s) in enumerate(zip(rows, seqs)):
        hid[i, : len(s) - 1] = data["hidden"][row][: len(s) - 1]
        nxt[i, : len(s) - 1] = s[1:]
    a0 = torch.tensor([data["prompt_lens"][r] - 1 for r in rows])
    anchors = a0[:, None] + torch.arange(m)[None]  # [B, M]
    labels = torch.full((b, m, depths), -1, dtype=torch.long)
    soft_pos = torch.zeros(b, m, depths, dtype=torch.long)
    for i, s in enumerate(seqs):
        for j in range(1, depths + 1):
            pos = anchors[i] + 1 + j
            ok = pos < len(s)
            labels[i, ok, j - 1] = s[pos[ok]]
            soft_pos[i, :, j - 1] = (pos - 1).clamp(max=len(s) - 1)
    # Base rows: the trunk's hidden state at p and token p + 1, causal.
    base_pos = torch.arange(r_max)[None].expand(b, -1)
    cos, sin = frozen.rotary(hid, base_pos)
    causal = torch.ones(r_max, r_max, dtype=torch.bool).tril()[None, None].expand(b, -1, -1, -1)
    out, (k_ctx, v_ctx) = layer_rows(mtp, head_input(mtp, frozen, hid, nxt), cos, sin, None, causal)
    prev = torch.gather(out, 1, anchors[..., None].expand(-1, -1, out.shape[-1]))
    logits = [prev @ frozen.embed.T]
    base_ok = torch.arange(r_max)[None, None] <= anchors[..., None]  # [B, M, R]
    eye = torch.eye(m, dtype=torch.bool)[None].expand(b, -1, -1)
    for j in range(2, depths + 1):
        tokens = torch.stack([s[(anchors[i] + j).clamp(max=len(s) - 1)] for i, s in enumerate(seqs)])
        pos = anchors + j - 1
        cos, sin = frozen.rotary(prev, pos)
        mask = torch.cat([base_ok] + [eye] * (j - 1), dim=-1)[:, None]
        prev, (k_new, v_new) = layer_rows(mtp, head_input(mtp, frozen, prev, tokens), cos, sin, (k_ctx, v_ctx), mask)
        k_ctx, v_ctx = k_new, v_new
        logits.append(prev @ frozen.embed.T)
    return logits, labels, soft_pos


def loss_on(mtp, frozen, data, rows, args):
    logits, labels, soft_pos = chain_logits(mtp, frozen, data, rows, args.depths)
    total, parts = 0.0, []
    for j, lg in enumerate(logits):
        lab = labels[..., j]
        ok = lab >= 0
        logp = lg.float().log_softmax(-1)[ok]
        hard = F.nll_loss(logp, lab[ok])
        loss = hard
        if args.distill:
            tid = torch.stack([data["top_ids"][r][soft_pos[i, :, j]] for i, r in enumerate(rows)]).long()[ok]
            tlp = torch.stack([data["top_logp"][r][soft_pos[i, :, j]] for i, r in enumerate(rows)]).float()[ok]
            q = tlp.softmax(-1)
            loss = loss + args.distill * -(q * logp.gather(-1, tid)).sum(-1).mean()
        w = args.depth_weights[j] if j < len(args.depth_weights) else args.depth_weights[-1]
        total = total + w * loss
        parts.append(round(hard.item(), 4))
    return total, parts


@torch.no_grad()
def evaluate(mtp, frozen, data, rows, batch: int) -> dict:
    """Per-depth top-1 agreement with the trunk's greedy tokens and the expected tokens per
    verify step at K = 1..EVAL_DEPTHS (1 + the sum of P(drafts 1..j all accepted)), over every
    anchor whose EVAL_DEPTHS labels exist."""
    mtp.eval()
    hits = torch.zeros(EVAL_DEPTHS)
    prefix = torch.zeros(EVAL_DEPTHS)
    count = 0
    for i in range(0, len(rows), batch):
        logits, labels, _ = chain_logits(mtp, frozen, data, rows[i : i + batch], EVAL_DEPTHS)
        ok = (labels >= 0).all(-1)
        right = torch.stack([lg.argmax(-1) for lg in logits], -1) == labels
        right = right[ok].float()
        hits += right.sum(0)
        prefix += right.cumprod(-1).sum(0)
        count += int(ok.sum())
    mtp.train()
    return {
        "top1_by_depth": [round(float(h / count), 4) for h in hits],
        "expected_tokens_per_step_by_k": [round(1 + float(prefix[:k].sum() / count), 4) for k in range(1, EVAL_DEPTHS + 1)],
        "anchors": count,
    }


def lr_at(args, progress: float, step: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def load_head(frozen: Frozen) -> MtpHead:
    mtp = MtpHead(frozen.config)
    state = {k[len("mtp."):]: v.float() for k, v in frozen.tensors.items() if k.startswith("mtp.")}
    mtp.load_state_dict(state)
    return mtp


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = build_data(args)
    frozen = Frozen(args.model)
    mtp = load_head(frozen)
    n = len(data["ids"])
    val_rows = list(range(n - args.val_sequences, n))
    train_rows = list(range(n - args.val_sequences))
    rng = random.Random(args.seed)
    start_eval = evaluate(mtp, frozen, data, val_rows, args.batch)
    print("shipped head:", json.dumps(start_eval), flush=True)
    decay = [p for name, p in mtp.named_parameters() if p.ndim >= 2 and "norm" not in name]
    no_decay = [p for name, p in mtp.named_parameters() if not (p.ndim >= 2 and "norm" not in name)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    best = (start_eval["expected_tokens_per_step_by_k"][2], 0, {k: v.clone() for k, v in mtp.state_dict().items()}, start_eval)
    curve, evals = [], [dict(step=0, seconds=0.0, **start_eval)]
    t0 = time.time()
    step = 0
    order: list[int] = []
    while time.time() - t0 < args.train_seconds:
        if len(order) < args.batch:
            order = train_rows[:]
            rng.shuffle(order)
        rows, order = order[: args.batch], order[args.batch :]
        lr = lr_at(args, (time.time() - t0) / args.train_seconds, step)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, parts = loss_on(mtp, frozen, data, rows, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            curve.append(dict(step=step, seconds=round(time.time() - t0, 1), loss=round(loss.item(), 4), ce_by_depth=parts,
                              lr=lr, grad_norm=round(grad_norm.item(), 3)))
            print(json.dumps(curve[-1]), flush=True)
        if step % args.eval_every == 0:
            ev = evaluate(mtp, frozen, data, val_rows, args.batch)
            evals.append(dict(step=step, seconds=round(time.time() - t0, 1), **ev))
            print(json.dumps(evals[-1]), flush=True)
            if ev["expected_tokens_per_step_by_k"][2] > best[0]:
                best = (ev["expected_tokens_per_step_by_k"][2], step, {k: v.clone() for k, v in mtp.state_dict().items()}, ev)
    ev = evaluate(mtp, frozen, data, val_rows, args.batch)
    evals.append(dict(step=step, seconds=round(time.time() - t0, 1), **ev))
    print(json.dumps(evals[-1]), flush=True)
    if ev["expected_tokens_per_step_by_k"][2] > best[0]:
        best = (ev["expected_tokens_per_step_by_k"][2], step, {k: v.clone() for k, v in mtp.state_dict().items()}, ev)
    mtp.load_state_dict(best[2])
    mtp.to(torch.bfloat16).to(torch.float32)
    saved_eval = evaluate(mtp, frozen, data, val_rows, args.batch)
    print(f"best step {best[1]}; bf16 weights:", json.dumps(saved_eval), flush=True)
    write_model(args.model, args.out, mtp, frozen)
    heldout = heldout_mtp_metrics(args.model, mtp)
    print("held-out:", json.dumps(heldout), flush=True)
    record = {
        "description": "The demo model's MTP head retrained with its trunk frozen, by tools/demo/train_mtp.py",
        "command": "python tools/demo/train_mtp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "data": {"corpus_fingerprint": data["fingerprint"], "train_files": data["train_files"],
                 "train_sequences": len(train_rows), "val_sequences": len(val_rows),
                 "prompt_tokens": [PROMPT_MIN, PROMPT_MAX], "greedy_tokens": CONTINUE, "soft_label_top_k": TOPK,
                 "seconds": round(data["seconds"], 1)},
        "steps": step,
        "best_step": best[1],
        "validation_metric": "expected tokens per verify step at K (1 + sum over j <= K of P(drafts 1..j equal the trunk's greedy tokens)), per anchor of held-back training-corpus sequences",
        "validation_shipped_head": start_eval,
        "validation_saved_head": saved_eval,
        "heldout_teacher_forced": heldout,
        "validation_curve": evals,
        "loss_curve": curve,
    }
    args.record.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out} and {args.record}", flush=True)


def heldout_mtp_metrics(model_dir: Path, mtp: MtpHead) -> dict:
    """The teacher-forced MTP metrics of training_record.json (heldout_eval.py: float32 math on
    the bf16 weights) for `mtp`: on the shipped held-out windows, and on every held-out file of
    the held-out files of the stdlib at hand cut into windows as train.py cuts them (at most
    FULL_HELDOUT_WINDOWS, evenly spread: the pure-PyTorch GDN is slow on the CPU)."""
    import numpy as np
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM

    from heldout_eval import as_saved_fp32, heldout_metrics

    torch.set_float32_matmul_precision("highest")
    model = Qwen3_5ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    head = as_saved_fp32(mtp)
    shipped = json.loads((model_dir.parent / "heldout_tokens.json").read_text())
    windows = torch.tensor(shipped["sequences"])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    held = [f for f in corpus.list_source_files(corpus.stdlib_root()) if corpus.is_heldout(f.relpath)]
    stream = np.concatenate([enc.ids + [0] for enc in tok.encode_batch([f.text for f in held], add_special_tokens=False)])
    seq_len = shipped["seq_len"]
    full = torch.from_numpy(stream[: len(stream) // seq_len * seq_len].astype(np.int64)).view(-1, seq_len)
    full = full[torch.linspace(0, len(full) - 1, min(FULL_HELDOUT_WINDOWS, len(full))).long()]
    keys = ("mtp_top1_accuracy_vs_data", "mtp_top1_agreement_with_main_greedy", "mtp_positions_scored")
    out = {}
    for name, w in (("heldout_shipped", windows), ("heldout_full", full)):
        m = heldout_metrics(model, head, w)
        out[name] = {k: m[k] for k in keys}
    out["heldout_full"]["windows"] = f"{len(full)} windows of {seq_len} tokens of the {len(held)} held-out files of {corpus.stdlib_root()}"
    return out


def write_model(src: Path, dst: Path, mtp: MtpHead, frozen: Frozen) -> None:
    """Copy `src` to `dst` with the head's bf16 tensors in place of its `mtp.*` (trunk untouched)."""
    from safetensors.torch import save_file

    if dst.resolve() != src.resolve():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = dict(frozen.tensors)
    new = mtp.named_checkpoint_tensors()
    assert set(new) == {k for k in tensors if k.startswith("mtp.")}
    for name, t in new.items():
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
