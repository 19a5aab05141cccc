"""Train the demo model's DFlash drafter on the CPU (a tool kept outside the wheel).

    python tools/dflash/train.py --out python/ninfer/demo/dflash [--train-seconds 4200]

Data: windows of PROMPT_MIN..PROMPT_MAX tokens (contexts of every length the drafter meets in
use) cut from the demo's training corpus (CPython stdlib files that are not held out,
tools/demo/corpus.py) tokenized with the demo's tokenizer, each continued greedily by the demo
model for CONTINUE tokens (ninfer's CPU engine). The drafter learns what greedy speculation
verifies: the target's greedy tokens after an anchor. ninfer's CPU model runs the target once
per sequence for the context features (the outputs of `target_layer_ids`, exactly what the
engine hands the drafter; tests/test_dflash.py checks them against transformers' hidden states)
and for its next-token distribution at each position, of which the top TOPK are kept.

Training: each step takes sequences of similar length and samples anchors in the greedy part of
each; a block is the anchor then `block_size - 1` mask tokens at the next positions, attending
to the context positions before its anchor and to its own block (dflash_model.py). The loss at
block position k is the cross-entropy with the target's greedy token plus `--distill` times the
cross-entropy with the target's top-k distribution there (soft labels: which near-misses the
target ranks next), weighted by exp(-(k - 1) / DECAY) as deeper drafts matter less to the
accepted length (the DFlash paper's decay). AdamW with warmup and a cosine decay over the
wall-clock budget. The validation metric is the greedy mean accepted length at
K = block_size - 1 on sequences kept out of training, and the best checkpoint by it is saved
(bf16) with training_record.json next to this script. The data is cached (`--cache`): a second
run with other training options skips the target.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tools" / "demo"))
sys.path.insert(0, str(REPO / "python"))

from dflash_model import DFlashConfig, DFlashDrafter  # noqa: E402

PROMPT_MIN, PROMPT_MAX = 32, 512
CONTINUE = 160
DECAY = 4.0
TOPK = 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--target", type=Path, default=REPO / "python" / "ninfer" / "demo" / "model")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--sequences", type=int, default=512)
    p.add_argument("--val-sequences", type=int, default=48)
    p.add_argument("--train-seconds", type=float, default=4200.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 4, 6])
    p.add_argument("--mask-token-id", type=int, default=0)
    p.add_argument("--cache", type=Path, default=Path("/tmp/dflash_train_data.pt"))
    p.add_argument("--record", type=Path, default=HERE / "training_record.json")
    p.add_argument("--distill", type=float, default=1.0, help="weight of the soft-label term (the target's top-k distribution)")
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def corpus_windows(tok_path: Path, n: int, seed: int) -> tuple[list[list[int]], str, int]:
    """`n` random windows of the non-held-out corpus, PROMPT_MIN..PROMPT_MAX tokens long (the
    drafter meets contexts of every length); the corpus fingerprint and its file count."""
    import corpus
    from tokenizers import Tokenizer

    files = corpus.list_source_files(corpus.stdlib_root())
    train = [f for f in files if not corpus.is_heldout(f.relpath)]
    tok = Tokenizer.from_file(str(tok_path))
    rng = random.Random(seed)
    rng.shuffle(train)
    stream: list[int] = []
    for f in train[:1500]:
        stream.extend(tok.encode(f.text, add_special_tokens=False).ids + [0])
    starts = sorted(rng.sample(range(len(stream) - PROMPT_MAX), n))
    lengths = [rng.randint(PROMPT_MIN, PROMPT_MAX) for _ in starts]
    return [stream[s : s + p] for s, p in zip(starts, lengths)], corpus.fingerprint(files), len(train)


def build_data(args, c: DFlashConfig, drafter: DFlashDrafter) -> dict:
    """Prompts, greedy continuations and the target's context features (cached in args.cache)."""
    if args.cache.exists():
        return torch.load(args.cache)
    import tempfile

    from ninfer import _core
    from safetensors.torch import load_file

    t0 = time.time()
    n = args.sequences + args.val_sequences
    prompts, fp, n_files = corpus_windows(args.target / "tokenizer.json", n, args.seed)
    model = _core.Model(str(args.target))
    seqs = []
    for i in range(0, n, 32):
        toks, _, _ = model.decode_greedy(prompts[i : i + 32], CONTINUE)
        seqs.extend(p + list(t) for p, t in zip(prompts[i : i + 32], toks))
        print(f"greedy {len(seqs)}/{n} {time.time() - t0:.0f}s", flush=True)
    del model
    L = PROMPT_MAX + CONTINUE
    ids = torch.zeros(n, L, dtype=torch.long)
    features = torch.zeros(n, L, len(c.target_layer_ids) * c.hidden_size, dtype=torch.bfloat16)
    # The target's TOPK most likely next tokens at each position and their log-probabilities:
    # the soft labels of the distillation term.
    top_logp = torch.full((n, L, TOPK), -1e4, dtype=torch.float16)
    top_ids = torch.zeros(n, L, TOPK, dtype=torch.int16)
    with tempfile.TemporaryDirectory() as tmp:
        # Any drafter with this config makes ninfer's model keep the features it reads.
        drafter.save(Path(tmp), dtype=torch.float32)
        target = _core.DflashDrafter(str(args.target), tmp, max_tokens=L)
        for i, seq in enumerate(seqs):
            ids[i, : len(seq)] = torch.tensor(seq)
            logits, feats = target.target(seq)
            features[i, : len(seq)] = torch.from_numpy(feats).to(torch.bfloat16)
            v, k = torch.from_numpy(logits).log_softmax(-1).topk(TOPK, -1)
            top_logp[i, : len(seq)], top_ids[i, : len(seq)] = v.half(), k.short()
            if i % 64 == 0:
                print(f"features {i}/{n} {time.time() - t0:.0f}s", flush=True)
    tensors = load_file(str(args.target / "model.safetensors"))
    embed = next(v for k, v in tensors.items() if k.endswith("embed_tokens.weight")).float()
    data = {
        "ids": ids,
        "prompt_lens": torch.tensor([len(p) for p in prompts]),
        "features": features,
        "top_logp": top_logp,
        "top_ids": top_ids,
        "embed": embed,
        "fingerprint": fp,
        "train_files": n_files,
        "seconds": time.time() - t0,
    }
    torch.save(data, args.cache)
    return data


def block_batch(ids, feats, embed, anchors, c: DFlashConfig):
    """Inputs of the drafter forward for blocks at `anchors` [B, M], and labels [B, M, bs-1]."""
    B, L = ids.shape
    M, bs = anchors.shape[1], c.block_size
    offs = torch.arange(bs)
    q_pos = (anchors[..., None] + offs).reshape(B, M * bs)
    block_tokens = torch.full((B, M, bs), c.mask_token_id)
    block_tokens[..., 0] = ids.gather(1, anchors)
    noise = embed[block_tokens.reshape(B, M * bs)]
    labels = ids.gather(1, (anchors[..., None] + offs[1:]).reshape(B, -1)).view(B, M, bs - 1)
    key_pos = torch.arange(L)
    a_rows = anchors.repeat_interleave(bs, 1)  # [B, M*bs]
    ctx_vis = key_pos[None, None, :] < a_rows[..., None]  # [B, M*bs, L]
    blk = torch.arange(M).repeat_interleave(bs)
    blk_vis = (blk[:, None] == blk[None, :])[None].expand(B, -1, -1)
    mask = torch.cat([ctx_vis, blk_vis], -1)
    ctx_pos = key_pos[None].expand(B, -1)
    return feats.float(), ctx_pos, noise, q_pos, mask, labels


def block_logits(drafter, embed, batch, c: DFlashConfig):
    feats, ctx_pos, noise, q_pos, mask, labels = batch
    B, M = labels.shape[:2]
    out = drafter(feats, ctx_pos, noise, q_pos, mask).view(B, M, c.block_size, -1)[:, :, 1:]
    return out @ embed.T, labels


def soft_labels(data, rows, anchors, c: DFlashConfig):
    """The target's top-k next-token distribution at each block row: ids and probabilities
    [B, M, bs-1, TOPK] (the row of the token at `anchor + k` is the target's at `anchor + k - 1`)."""
    at = (anchors[..., None] + torch.arange(c.block_size - 1)).reshape(len(rows), -1)
    ids = data["top_ids"][rows].long()
    logp = data["top_logp"][rows].float()
    idx = at[..., None].expand(-1, -1, TOPK)
    shape = (*anchors.shape, c.block_size - 1, TOPK)
    return ids.gather(1, idx).view(shape), logp.gather(1, idx).softmax(-1).view(shape)


def anchor_range(data, i: int, c: DFlashConfig) -> tuple[int, int]:
    """Anchors of sequence `i` whose whole block lies in the target's greedy continuation."""
    p = int(data["prompt_lens"][i])
    return p - 1, p + CONTINUE - c.block_size + 1


@torch.no_grad()
def validate(drafter, data, val_idx, c: DFlashConfig) -> dict:
    """Greedy accepted length (K = bs - 1) and per-position accuracy over every anchor."""
    drafter.eval()
    accepted, rounds, pos_ok = 0.0, 0, torch.zeros(c.block_size - 1)
    for i in val_idx:
        lo, hi = anchor_range(data, i, c)
        L = hi + c.block_size - 1
        ids, feats = data["ids"][i : i + 1, :L], data["features"][i : i + 1, :L]
        anchors = torch.arange(lo, hi)[None]
        for chunk in anchors.split(32, 1):
            logits, labels = block_logits(drafter, data["embed"], block_batch(ids, feats, data["embed"], chunk, c), c)
            ok = (logits.argmax(-1) == labels).float()[0]  # [M, bs-1]
            accepted += ok.cumprod(-1).sum().item() + ok.shape[0]
            rounds += ok.shape[0]
            pos_ok += ok.sum(0)
    drafter.train()
    return {"mean_accepted_length": accepted / rounds, "top1_by_position": (pos_ok / rounds).tolist(), "anchors": rounds}


def lr_at(args, progress: float, step: int) -> float:
    """Linear warmup over `args.warmup` steps, then cosine decay to a tenth by the share of the
    wall-clock budget spent (a step count guessed from early step times misjudges a machine
    whose load changes)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    tcfg = json.loads((args.target / "config.json").read_text())
    c = DFlashConfig(
        hidden_size=tcfg["hidden_size"],
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=args.intermediate,
        vocab_size=tcfg["vocab_size"],
        target_layer_ids=args.target_layer_ids,
        block_size=args.block_size,
        mask_token_id=args.mask_token_id,
        num_target_layers=tcfg["num_hidden_layers"],
        rms_norm_eps=tcfg["rms_norm_eps"],
        rope_theta=10000.0,
    )
    drafter = DFlashDrafter(c)
    for m in drafter.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
    data = build_data(args, c, drafter)
    embed = data["embed"]
    n_train = args.sequences
    val_idx = list(range(n_train, n_train + args.val_sequences))
    # Batches of neighbours by length, cut to the longest: less padding to run through.
    by_len = sorted(range(n_train), key=lambda i: int(data["prompt_lens"][i]))
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    weights = torch.exp(-torch.arange(c.block_size - 1) / DECAY)
    t0 = time.time()
    step, curve, evals, best = 0, [], [], None
    while True:
        elapsed = time.time() - t0
        if elapsed > args.train_seconds:
            break
        lr = lr_at(args, elapsed / args.train_seconds, step)
        for g in opt.param_groups:
            g["lr"] = lr
        j = random.randrange(n_train - args.batch + 1)
        rows = torch.tensor(by_len[j : j + args.batch])
        ranges = [anchor_range(data, int(i), c) for i in rows]
        anchors = torch.stack([torch.randperm(hi - lo)[: args.anchors] + lo for lo, hi in ranges])
        L = max(hi for _, hi in ranges) + c.block_size - 1
        batch = block_batch(data["ids"][rows, :L], data["features"][rows, :L], embed, anchors, c)
        logits, labels = block_logits(drafter, embed, batch, c)
        logq = logits.log_softmax(-1)
        hard = -logq.gather(-1, labels[..., None])[..., 0]
        top_ids, top_p = soft_labels(data, rows, anchors, c)
        soft = -(logq.gather(-1, top_ids) * top_p).sum(-1)
        ce = hard + args.distill * soft
        loss = (ce * weights).sum() / (weights.sum() * labels.shape[0] * labels.shape[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            curve.append({"step": step, "loss": round(loss.item(), 4), "hard_ce": round((hard * weights).sum().item() / (weights.sum().item() * labels.shape[0] * labels.shape[1]), 4), "lr": lr, "seconds": round(time.time() - t0, 1)})
            print(curve[-1], flush=True)
        if step % args.eval_every == 0:
            v = validate(drafter, data, val_idx[:16], c)
            evals.append({"step": step, "seconds": round(time.time() - t0, 1), **v})
            print("val", evals[-1], flush=True)
            if best is None or v["mean_accepted_length"] > best[0]:
                best = (v["mean_accepted_length"], step, {k: t.detach().clone() for k, t in drafter.state_dict().items()})
    v = validate(drafter, data, val_idx[:16], c)
    evals.append({"step": step, "seconds": round(time.time() - t0, 1), **v})
    if best is None or v["mean_accepted_length"] > best[0]:
        best = (v["mean_accepted_length"], step, drafter.state_dict())
    drafter.load_state_dict(best[2])
    final = validate(drafter, data, val_idx, c)
    size = drafter.save(args.out)
    record = {
        "description": "DFlash drafter for the ninfer demo model, trained on the CPU by tools/dflash/train.py",
        "command": " ".join(["python", "tools/dflash/train.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": c.to_json(),
        "params": sum(p.numel() for p in drafter.parameters()),
        "safetensors_bytes": size,
        "data": {
            "corpus_fingerprint": data["fingerprint"],
            "train_files": data["train_files"],
            "train_sequences": n_train,
            "val_sequences": args.val_sequences,
            "prompt_tokens": [PROMPT_MIN, PROMPT_MAX],
            "greedy_tokens": CONTINUE,
            "soft_label_top_k": TOPK,
            "seconds": round(data["seconds"], 1),
        },
        "training": {
            "seed": args.seed,
            "steps": step,
            "batch": args.batch,
            "anchors_per_sequence": args.anchors,
            "lr": args.lr,
            "warmup": args.warmup,
            "schedule": "linear warmup, cosine to lr/10 over the wall-clock budget",
            "position_weight_decay": DECAY,
            "distill_weight": args.distill,
            "seconds": round(time.time() - t0, 1),
            "threads": torch.get_num_threads(),
            "best_step": best[1],
        },
        "loss_curve": curve,
        "validation_curve": evals,
        "validation_best": final,
    }
    args.record.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(final), "bytes", size)


if __name__ == "__main__":
    main()
