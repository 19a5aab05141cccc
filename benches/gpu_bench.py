"""The GPU benchmark records: batch-1 decode (Llama-3-8B and Qwen3.5-27B shapes), decode
throughput at several concurrencies (Llama-3-8B shape) and startup time (Qwen3.5-27B shape).

Every part writes record objects (commit, date, device, command, model, metric, value,
fraction_of_ceiling, peer, peer_value, config fields) to the --out JSON: added to the records
already in it, and rewritten after each part
so that a failing part keeps the others' records (a failed part leaves a record with "error").

Checkpoints are random bf16 weights written on the GPU machine itself (torch random tensors,
saved with safetensors, one file per group of layers; tensor names and shapes come from the
transformers model built on the meta device, so ninfer and transformers read the same
checkpoint). The 27B checkpoint is 54 GB on a 64 GiB disk, so the parts run shape by shape and
each checkpoint is deleted after its last part (--keep-checkpoints keeps them).

Ceilings: the device copy rate (bytes read + written per second by a device-to-device copy,
best of 20) measured in the same run. Batch-1 decode: fraction = bytes moved per token x tok/s /
copy rate. Peers: transformers `generate` (bf16, eager) on the same GPU with the same shape,
randomly initialised from the config (no checkpoint load), in a subprocess so that its memory is
freed before ninfer loads; with --quantize q4 --peer-gptfast PATH, the Llama-3-8B batch-1 decode's
peer is gpt-fast's int4 decode (benches/peer_gptfast.py, gpt-fast imported from PATH), in the
same kind of subprocess.

Usage (GPU machine; see docs/performance.md):
    python benches/gpu_bench.py --out OUT/gpu_bench.json --commit SHA [--decode-8b] [--decode-27b] [--decode-qwen2-7b]
        [--throughput] [--startup] [--layers N] [--skip-peer] [--quantize q4 --peer-gptfast PATH]
No part flag: all parts. --tiny runs every part on tiny shapes with ninfer on the CPU and torch
on the CPU (a dry run of the script's logic on a machine without a GPU).
--option OPTION=true|false (repeatable): an engine option (async_scheduling, cuda_graphs,
batch_invariant, device_sampling) given to every engine the parts build, and named in every record.
--ab OPTION=true,false [--ab-rounds N]: the chosen parts once per value of an engine option, each
in its own process, alternated round after round, with a summary by value (benches/gpu_ab.py).
--device-profile FILE: a device profile (routes for this GPU, e.g. {"plan": {"pdl": false}}) given to
every engine the parts build, its path and plan named in every record: a route measured end to end
without a rebuild.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

T0 = time.perf_counter()

#: The --quantize modes the CUDA loader takes (rust_core/src/quant, `QuantizeMode`).
QUANTIZE_MODES = ["w8", "q4", "q5", "q6", "fp8", "nvfp4"]

SHAPES = {
    "llama-3-8b": dict(arch="llama", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336,
                       vocab=128256),
    # Qwen3.5-27B text config (shared/REFERENCES.md): 16 x [3 GDN + 1 gated attention].
    "qwen3_5-27b": dict(arch="qwen3_5", hidden=5120, layers=64, heads=24, kv_heads=4, head_dim=256, ffn=17408,
                        vocab=248320, lin_k_heads=16, lin_v_heads=48, lin_k_dim=128, lin_v_dim=128, conv=4),
    # Qwen2-7B (published config): q/k/v projection biases, the path `linear_bias` runs.
    "qwen2-7b": dict(arch="qwen2", hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, ffn=18944,
                     vocab=152064),
}

#: --tiny: the same two architectures at sizes the CPU runs in seconds, with head sizes the CUDA
#: kernels take (the GPU plan that names a record's weights refuses others).
TINY_SHAPES = {
    "llama-3-8b": dict(arch="llama", hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, ffn=256, vocab=512),
    "qwen3_5-27b": dict(arch="qwen3_5", hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, ffn=256, vocab=512,
                        lin_k_heads=2, lin_v_heads=4, lin_k_dim=64, lin_v_dim=32, conv=4),
    "qwen2-7b": dict(arch="qwen2", hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, ffn=256, vocab=512),
}


def log(msg: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{now} +{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sibling(name: str):
    """benches/NAME.py, loaded beside this file whatever the working directory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpu_ab():
    """benches/gpu_ab.py, the A-B runner."""
    return sibling("gpu_ab")


#: Request fields the timed parts set themselves (greedy over exactly the timed tokens).
OWN_SAMPLING_FIELDS = ("max_tokens", "ignore_eos", "n", "stream")


def parse_sampling(text: str) -> dict:
    """--sampling's JSON object of extra request fields. Raises argparse.ArgumentTypeError naming
    the value when it is not an object or sets a field the parts own."""
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(extra, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object of sampling fields")
    own = sorted(set(extra) & set(OWN_SAMPLING_FIELDS))
    if own:
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(own)} is set by the timed parts themselves")
    return extra


def request_params(b: "Bench", max_tokens: int) -> str:
    """The timed requests' sampling: greedy, EOS ignored, plus --sampling's fields."""
    return json.dumps({"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **b.a.sampling})


def _core_params(fields_json: str):
    """The engine's typed sampling params (`_core.SamplingParams`) of a JSON object of fields, or
    the JSON text itself for a build whose `Engine.submit` took text (an --ab-builds run of a
    commit from before the typed params)."""
    from ninfer import _core

    typed = getattr(_core, "SamplingParams", None)
    return fields_json if typed is None else typed(**json.loads(fields_json))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True,
                   help="JSON file for the records (appended to if present; rewritten after each part)")
    p.add_argument("--workdir", default="/tmp/ninfer_bench", help="where the random checkpoints are written")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--decode-8b", action="store_true", help="decode_bs1_tok_s, Llama-3-8B shape")
    p.add_argument("--decode-27b", action="store_true", help="decode_bs1_tok_s, Qwen3.5-27B shape")
    p.add_argument("--decode-qwen2-7b", action="store_true",
                   help="decode_bs1_tok_s, Qwen2-7B shape (q/k/v biases); not part of the default set")
    p.add_argument("--throughput", action="store_true", help="decode_throughput_tok_s, Llama-3-8B shape")
    p.add_argument("--startup", action="store_true", help="startup_s of `ninfer serve`, Qwen3.5-27B shape")
    p.add_argument("--profile", action="store_true",
                   help="batch-1 decode steps under torch.profiler (CUPTI sees our kernels too): GPU busy time "
                        "vs wall time per step and the top kernels, for each shape whose decode part runs "
                        "(the Llama-3-8B shape when none does), into --profile-out with the shape name added")
    p.add_argument("--profile-out", default="decode_profile.txt")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of both shapes (default: the real count); a subset is noted in the records")
    p.add_argument("--prompt", type=int, default=128, help="batch-1 decode: prompt tokens")
    p.add_argument("--tokens", type=int, default=256, help="batch-1 decode: decode tokens timed")
    p.add_argument("--concurrency", default="1,8,32,64", help="throughput: concurrency levels")
    p.add_argument("--tp-model", default="llama-3-8b", choices=["llama-3-8b", "qwen3_5-27b"],
                   help="throughput: the model shape (the issue's table is Llama-3-8B; the 27B shows what a "
                        "batch costs on the hybrid model)")
    p.add_argument("--profile-batch", type=int, default=1,
                   help="profile: decode sequences a step (each with --prompt tokens); 1 is the batch-1 profile")
    p.add_argument("--tp-prompt", type=int, default=1024, help="throughput: prompt tokens per request")
    p.add_argument("--tp-tokens", type=int, default=256, help="throughput: output tokens per request")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="throughput: engine tokens per step")
    p.add_argument("--peer-budget-s", type=float, default=150.0,
                   help="throughput: skip a peer level whose estimated time exceeds this")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--sampling", metavar="JSON", type=parse_sampling, default={},
                   help="decode and throughput: sampling fields added to every ninfer request (a JSON object, e.g. "
                        "'{\"presence_penalty\": 0.5}' to time requests with penalties); recorded in each record; "
                        "needs --skip-peer (the transformers peer samples greedily without them)")
    p.add_argument("--quantize", choices=QUANTIZE_MODES, default=None,
                   help="load the bf16 checkpoint quantized (the engine's --quantize); the ceilings count the "
                        "packed bytes the loader holds (`_core.plan`)")
    p.add_argument("--peer-gptfast", metavar="PATH",
                   help="with --quantize q4: the Llama-3-8B batch-1 decode's peer is gpt-fast's int4 g64 decode "
                        "(torch.compile), gpt-fast imported from its checkout at PATH (benches/peer_gptfast.py)")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, ninfer and torch on the CPU (dry run)")
    p.add_argument("--option", metavar="OPTION=true|false", action="append", default=[],
                   help="an engine option (" + ", ".join(gpu_ab().ENGINE_OPTIONS) + ") given to every engine the "
                        "parts build and recorded in their records (repeatable; not with --startup: the server it "
                        "times takes no engine options)")
    p.add_argument("--device-profile", metavar="FILE",
                   help="a device profile (JSON: version, device, compute_capability, plan) given to every engine "
                        "the parts build, as `ninfer serve --device-profile-path`; its plan is named in every record")
    p.add_argument("--ab", metavar="OPTION=true,false",
                   help="A-B runs (benches/gpu_ab.py): the parts once per value of the engine option, each in its "
                        "own process, alternated for --ab-rounds rounds; records tagged with the value, and a summary")
    p.add_argument("--ab-builds", metavar="COMMIT=SITE,COMMIT=SITE",
                   help="A-B runs of builds (benches/gpu_ab.py): the parts once per directory a ninfer wheel was "
                        "installed into (pip install --target SITE), put first on PYTHONPATH, its records carrying "
                        "COMMIT; alternated as --ab")
    p.add_argument("--ab-rounds", type=int, default=2, help="A-B: rounds of every value (default 2)")
    p.add_argument("--peer-worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.profile_batch < 1:
        p.error(f"--profile-batch {a.profile_batch}: decode sequences a step must be at least 1")
    if a.ab is not None and a.ab_builds is not None:
        p.error("--ab and --ab-builds: one A-B at a time")
    options = {}
    for spec in a.option:
        try:
            name, value = gpu_ab().parse_option(spec)
        except ValueError as e:
            p.error(f"--option {e}")
        if name in options:
            p.error(f"--option {spec!r}: {name} is given twice")
        options[name] = value
    if a.quantize:
        # An --ab-builds run passes it to every build (each must load quantized weights).
        if a.startup:
            p.error(f"--quantize {a.quantize}: with --startup (`ninfer serve` takes no quantize option "
                    "here); name the decode and throughput parts")
        options["quantize"] = a.quantize
    a.device_profile_plan = None
    if a.device_profile is not None:
        a.device_profile_plan = read_device_profile_plan(p, a.device_profile)
        options["device_profile"] = str(Path(a.device_profile).resolve())
    a.options = options
    if a.ab is not None:
        try:
            name, _ = gpu_ab().parse_ab(a.ab)
        except ValueError as e:
            p.error(str(e))
        if name in options:
            p.error(f"--ab {a.ab!r}: --option sets {name} already")
    if a.ab_builds is not None:
        try:
            builds = gpu_ab().parse_ab_builds(a.ab_builds)
        except ValueError as e:
            p.error(str(e))
        for commit, site in builds:
            if not Path(site).is_dir():
                p.error(f"--ab-builds: {commit}'s site {site!r} is not a directory")
    if a.peer_gptfast is not None:
        if a.quantize != "q4":
            p.error(f"--peer-gptfast: gpt-fast's int4 decode is the peer of 4-bit weights; add --quantize q4 "
                    f"(got {'--quantize ' + a.quantize if a.quantize else 'no --quantize'})")
        if a.skip_peer:
            p.error("--peer-gptfast and --skip-peer: choose one")
        missing = [f for f in ("model.py", "quantize.py", "generate.py") if not (Path(a.peer_gptfast) / f).is_file()]
        if missing:
            p.error(f"--peer-gptfast {a.peer_gptfast!r}: no {', '.join(missing)} there (gpt-fast's checkout)")
    if a.sampling and not a.skip_peer and not a.peer_worker:
        p.error("--sampling: the transformers peer cannot apply the same sampling; add --skip-peer")
    if a.ab_rounds < 1:
        p.error(f"--ab-rounds {a.ab_rounds}: at least one round")
    if not (a.decode_8b or a.decode_27b or a.decode_qwen2_7b or a.throughput or a.startup or a.profile):
        a.decode_8b = a.decode_27b = a.throughput = a.startup = True
    if a.startup and (options or a.ab is not None):
        given = "--device-profile" if list(options) == ["device_profile"] else "--option / --ab"
        p.error(f"{given}: the startup part times `ninfer serve`, which takes no engine options; "
                "name the other parts (e.g. --decode-8b --throughput)")
    return a


def read_device_profile_plan(p: argparse.ArgumentParser, path: str) -> dict:
    """The `plan` object of the device profile at `path`, or a usage error naming the file and
    what is wrong with it (the engine checks the rest: its device, version and fields)."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        p.error(f"--device-profile {path!r}: {e.strerror or e}")
    except ValueError as e:
        p.error(f"--device-profile {path!r}: not JSON ({e})")
    if not isinstance(doc, dict) or not isinstance(doc.get("plan", {}), dict):
        p.error(f"--device-profile {path!r}: expected a JSON object whose 'plan' is an object")
    return doc.get("plan", {})


# ---------------------------------------------------------------------------------------------
# Shapes, checkpoints, ceilings


class Bench:
    """What every part shares: the device, shapes, the copy rate, the records written so far."""

    def __init__(self, a: argparse.Namespace):
        import torch

        self.a = a
        self.torch = torch
        self.tiny = a.tiny
        self.dev = "cpu" if a.tiny else "cuda"
        self.ninfer_device = "cpu" if a.tiny else "cuda"
        self.shapes = TINY_SHAPES if a.tiny else SHAPES
        self.workdir = Path(a.workdir)
        # Records already in --out are kept: a second invocation (another shape, another part)
        # adds to them instead of replacing them.
        out = Path(a.out)
        self.records: list = json.loads(out.read_text()) if out.is_file() and out.stat().st_size else []
        self.earlier = len(self.records)
        self.device_name = device_name(a.tiny)
        self._copy_rate = None
        self._weight_bytes: dict = {}

    # -- shapes --

    def shape(self, model: str) -> dict:
        s = dict(self.shapes[model], model=model)
        s["full_layers"] = s["layers"]
        if self.a.layers:
            s["layers"] = self.a.layers if s["arch"] != "qwen3_5" else max(4, self.a.layers - self.a.layers % 4)
        return s

    def max_positions(self) -> int:
        """The checkpoint's context: 8192, or the next power of two that holds a longer batch-1
        run (--prompt + --tokens; the published Llama-3.1-8B config allows 131072)."""
        need = self.a.prompt + self.a.tokens + 64
        return 8192 if need <= 8192 else 1 << (need - 1).bit_length()

    def hf_config(self, s: dict):
        import transformers as tf

        common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], tie_word_embeddings=False,
                      max_position_embeddings=self.max_positions(), bos_token_id=1, eos_token_id=2)
        if s["arch"] == "llama":
            cfg = tf.LlamaConfig(rms_norm_eps=1e-5, rope_theta=500000.0, **common)
            cfg.architectures = ["LlamaForCausalLM"]
        elif s["arch"] == "qwen2":
            cfg = tf.Qwen2Config(rms_norm_eps=1e-6, rope_theta=1000000.0, **common)
            cfg.architectures = ["Qwen2ForCausalLM"]
        else:
            layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(s["layers"])]
            cfg = tf.Qwen3_5TextConfig(rms_norm_eps=1e-6, layer_types=layer_types, linear_num_key_heads=s["lin_k_heads"],
                                       linear_num_value_heads=s["lin_v_heads"], linear_key_head_dim=s["lin_k_dim"],
                                       linear_value_head_dim=s["lin_v_dim"], linear_conv_kernel_dim=s["conv"],
                                       **common)
            cfg.architectures = ["Qwen3_5ForCausalLM"]
        return cfg

    def param_shapes(self, s: dict) -> dict:
        """Tensor name -> shape of the transformers model of shape `s` (built on the meta device)."""
        import transformers as tf

        torch = self.torch
        with torch.device("meta"):
            m = tf.AutoModelForCausalLM.from_config(self.hf_config(s))
        return {k: tuple(v.shape) for k, v in m.state_dict().items()}

    def checkpoint(self, model: str) -> Path:
        """The random checkpoint of `model`, written once per run (a complete one is reused)."""
        s = self.shape(model)
        path = self.workdir / f"{model}-{s['layers']}l"
        if (path / "config.json").exists():
            self.tokenizer_for_grammars(path, s)
            return path
        problem = room_for_checkpoint(path, self.weight_bytes(s, bf16=True)[1])
        if problem:
            raise RuntimeError(problem)
        log(f"writing the random {model} checkpoint ({s['layers']} layers) to {path}")
        t = time.perf_counter()
        try:
            write_checkpoint(self, s, path)
        except BaseException:
            # A half-written checkpoint (tens of GB for the 27B) must not stay behind to fill the
            # disk for the parts and runs after this one.
            shutil.rmtree(path, ignore_errors=True)
            raise
        gb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
        log(f"checkpoint written: {gb:.1f} GB in {time.perf_counter() - t:.1f} s")
        self.tokenizer_for_grammars(path, s)
        return path

    def tokenizer_for_grammars(self, path: Path, s: dict) -> None:
        """A full-vocabulary tokenizer.json beside the weights when --sampling has a
        response_format (the engine compiles grammars against the tokenizer's byte strings)."""
        if "response_format" in self.a.sampling and not (path / "tokenizer.json").exists():
            sibling("bench_tokenizer").write_tokenizer(path, s["vocab"])
            log(f"wrote a {s['vocab']}-token byte-level tokenizer.json for the response_format requests")

    def drop_checkpoint(self, model: str) -> None:
        if self.a.keep_checkpoints:
            return
        path = self.workdir / f"{model}-{self.shape(model)['layers']}l"
        if path.exists():
            shutil.rmtree(path)
            log(f"deleted {path}")

    def weight_bytes(self, s: dict, bf16: bool = False) -> tuple:
        """(bytes of every weight a decode step reads: all but the embedding table, plus one
        embedding row; total checkpoint bytes), bf16. Kept per shape: building the model on the
        meta device takes a noticeable fraction of a second."""
        key = json.dumps(s, sort_keys=True)
        if key not in self._weight_bytes:
            shapes = self.param_shapes(s)
            total = sum(prod(v) for v in shapes.values()) * 2
            embed = sum(prod(v) for k, v in shapes.items() if "embed_tokens" in k) * 2
            if bf16:
                return total - embed + s["hidden"] * 2, total
            if self.a.quantize:
                # What the loader holds (packed weights with their scales; the embedding and
                # lm_head, and any matrix the format cannot hold, bf16), from the plan's ledger.
                from ninfer import _core

                path = self.workdir / f"{s['model']}-{s['layers']}l"
                plan = _core.plan(str(path), gpu_memory=1 << 40, max_context=1024, quantize=self.a.quantize)
                total = sum(w["bytes"] for w in plan["weights"])
            self._weight_bytes[key] = (total - embed + s["hidden"] * 2, total)
        return self._weight_bytes[key]

    def weights_format(self, model: str) -> str:
        """The records' `weights`: bf16, or the packed format --quantize loads (the plan's name)."""
        s = self.shape(model)
        return weights_format(self.workdir / f"{model}-{s['layers']}l", self.a.quantize)

    def bytes_per_token(self, s: dict, context: int, batch: int = 1) -> int:
        """Bytes one decode step of `batch` sequences at `context` tokens moves: the weights once,
        per sequence the KV cache read (attention layers) and the recurrent state read and
        written (Gated DeltaNet layers: f32 delta state, bf16 conv state)."""
        return self.step_bytes(s, [context] * batch)

    def step_bytes(self, s: dict, contexts: list) -> int:
        """Bytes one decode step moves whose sequences are at `contexts` tokens: the weights once,
        plus each sequence's own (`seq_bytes`)."""
        weights, _ = self.weight_bytes(s)
        return weights + sum(self.seq_bytes(s, c) for c in contexts)

    def seq_bytes(self, s: dict, context: int) -> int:
        """Bytes one sequence at `context` tokens adds to a decode step: its KV cache read and its
        recurrent state read and written."""
        if s["arch"] != "qwen3_5":
            n_attn, n_lin = s["layers"], 0
        else:
            n_attn = s["layers"] // 4
            n_lin = s["layers"] - n_attn
        kv = n_attn * 2 * s["kv_heads"] * s["head_dim"] * context * 2
        state = 0
        if n_lin:
            conv_dim = 2 * s["lin_k_heads"] * s["lin_k_dim"] + s["lin_v_heads"] * s["lin_v_dim"]
            delta = s["lin_v_heads"] * s["lin_k_dim"] * s["lin_v_dim"] * 4
            state = n_lin * 2 * (delta + conv_dim * (s["conv"] - 1) * 2)
        return kv + state

    def copy_rate(self) -> float:
        if self._copy_rate is None:
            self._copy_rate = copy_rate(self.torch, self.dev)
            log(f"device copy rate {self._copy_rate / 1e12:.3f} TB/s (read + write)")
        return self._copy_rate

    # -- records --

    def record(self, metric: str, model: str, value, s: dict, **fields) -> dict:
        rec = {
            "commit": self.a.commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": self.device_name,
            "command": "python " + " ".join(sys.argv),
            "model": model,
            "metric": metric,
            "value": value,
            "fraction_of_ceiling": None,
            "peer": None,
            "peer_value": None,
            "layers": s["layers"],
            "dtype": "bf16",
            "weights": self.weights_format(model) if model in self.shapes else "bf16",
            "random_weights": True,
        }
        if s["layers"] != s["full_layers"]:
            rec["subset_note"] = (f"{s['layers']} of {s['full_layers']} layers: the weight bytes per token and the "
                                  "load time scale about linearly with the layers; tok/s does not (the LM head and "
                                  "per-step host costs are fixed), so do not extrapolate it")
        if self.tiny:
            rec["tiny_dry_run"] = "tiny shapes on the CPU: checks the script, measures nothing"
        env = ninfer_settings(os.environ)
        if env:
            rec["env"] = env
        if self.a.options:
            rec["options"] = dict(self.a.options)
        if self.a.device_profile_plan is not None:
            rec["device_profile_plan"] = self.a.device_profile_plan
        if self.a.sampling and metric in ("decode_bs1_tok_s", "decode_throughput_tok_s"):
            rec["sampling"] = self.a.sampling
        rec.update(fields)
        return rec

    def add(self, recs: list) -> None:
        self.records.extend(recs)
        out = Path(self.a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.records, indent=2) + "\n")
        for r in recs:
            log(f"record {r['metric']} {r['model']}: value {r.get('value')}, fraction {r.get('fraction_of_ceiling')}, "
                f"peer {r.get('peer_value')}" + (f", error {r['error']}" if "error" in r else ""))


def weights_format(path: Path, quantize: str | None) -> str:
    """A record's `weights`: bf16 without --quantize, else the packed format the loader makes of
    the checkpoint at `path` with that mode (the plan's name, lower case: q4g64_f16s, ...); the
    mode itself when there is no checkpoint (a part that failed before writing it)."""
    if not quantize:
        return "bf16"
    if not (Path(path) / "config.json").exists():
        return quantize
    from ninfer import _core

    # A short context: the format does not depend on it, and gpu_prefill's checkpoints hold only
    # their longest prompt.
    plan = _core.plan(str(path), gpu_memory=1 << 40, max_context=64, quantize=quantize)
    packed = [w["format"] for w in plan["weights"] if w["format"] not in ("BF16", "F16", "F32")]
    return packed[0].lower() if packed else "bf16"


def ninfer_settings(environ) -> dict:
    """The NINFER_* variables a run was made under (NINFER_EMULATE_ARCH runs the GPU as an older
    one, and a record must say which it measured); paths that change nothing measured are left
    out."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith("NINFER_") and k not in SETTINGS_NOT_RECORDED}


# Variables that locate things rather than choose a form.
SETTINGS_NOT_RECORDED = ("NINFER_KERNEL_CACHE", "NINFER_COMMIT")


def prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def device_name(tiny: bool) -> str:
    if tiny:
        return "cpu (tiny dry run)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        return out[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_checkpoint(b: Bench, s: dict, path: Path) -> None:
    """Random bf16 weights (std 0.02; norms the identity: 1, or 0 for Qwen3.5's zero-centred
    norms; A_log = log(U(1, 16)) and dt_bias 1 as transformers initialises them), one safetensors
    file per group of layers so that host memory stays at one group."""
    from safetensors.torch import save_file

    torch = b.torch
    cfg = b.hf_config(s)
    shapes = b.param_shapes(s)
    path.mkdir(parents=True, exist_ok=True)
    for f in path.glob("*"):
        f.unlink()
    g = torch.Generator(device=b.dev).manual_seed(0)
    zero_centred = s["arch"] == "qwen3_5"

    def tensor(name: str, shape: tuple):
        if name.endswith("A_log"):
            return torch.log(torch.empty(shape, device=b.dev).uniform_(1, 16, generator=g)).to(torch.bfloat16)
        if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            return (torch.zeros if zero_centred else torch.ones)(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=g, device=b.dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)

    def group_of(name: str) -> str:
        if ".layers." in name:
            return f"layers{int(name.split('.layers.')[1].split('.')[0]) // 4:03d}"
        return "embed" if "embed_tokens" in name else "head"

    groups: dict = {}
    for name, shape in shapes.items():
        groups.setdefault(group_of(name), []).append((name, shape))
    index = {}
    for n, (gname, members) in enumerate(sorted(groups.items())):
        fname = f"model-{n:05d}-{gname}.safetensors"
        save_file({name: tensor(name, shape).cpu().contiguous() for name, shape in members}, str(path / fname),
                  metadata={"format": "pt"})
        index.update({name: fname for name, _ in members})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    # Last, so that a present config.json means a complete checkpoint.
    cfg.save_pretrained(str(path))


def room_for_checkpoint(path: Path, needed: int, headroom: float = 1.05) -> str | None:
    """Why a checkpoint of `needed` bytes cannot be written at `path` (None when it fits): the
    free bytes of its file system against `needed` x `headroom`, naming the checkpoints kept
    beside it (--keep-checkpoints) with their sizes. Checked before the write, which would
    otherwise fail minutes in with "No space left on device" (a 64 GiB disk holds the 27B
    checkpoint, 53.8 GB, or the 8B one, 16.1 GB, not both)."""
    parent = path.parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free >= needed * headroom:
        return None
    kept = []
    if parent.exists():
        for d in sorted(parent.iterdir()):
            if d.is_dir() and d != path and (d / "config.json").exists():
                kept.append(f"{d} ({sum(f.stat().st_size for f in d.glob('*') if f.is_file()) / 1e9:.1f} GB)")
    hint = f"; kept checkpoints there: {', '.join(kept)} (delete them)" if kept else ""
    return (f"not enough disk for {path}: needs {needed / 1e9:.1f} GB (+{(headroom - 1) * 100:.0f}%), "
            f"{free / 1e9:.1f} GB free{hint}; or pass --workdir on a larger disk")


def copy_rate(torch, dev: str) -> float:
    """Device copy bytes (read + written) per second, best of 20 copies of 2 GiB (64 MiB on the CPU)."""
    n = (1 << 25) if dev == "cpu" else (1 << 30)
    a = torch.empty(n, dtype=torch.int16, device=dev)
    bb = torch.empty_like(a)
    for _ in range(3):
        bb.copy_(a)
    best = float("inf")
    for _ in range(20):
        if dev == "cpu":
            t = time.perf_counter()
            bb.copy_(a)
            best = min(best, time.perf_counter() - t)
            continue
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        bb.copy_(a)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    del a, bb
    if dev != "cpu":
        torch.cuda.empty_cache()
    return 2 * 2 * n / best


def random_prompt(n: int, vocab: int, seed: int) -> list:
    import random

    r = random.Random(seed)
    return [r.randrange(3, vocab) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Peers: transformers generate in a subprocess


def run_peer(b: Bench, job: dict, timeout_s: float = 1200) -> dict:
    """Runs `job` in a fresh interpreter (`--peer-worker`); returns its JSON answer."""
    cmd = [sys.executable, os.path.abspath(__file__), "--out", os.devnull, "--peer-worker", json.dumps(job)]
    if b.tiny:
        cmd.append("--tiny")
    if b.a.layers:
        cmd += ["--layers", str(b.a.layers)]
    log(f"peer: {job['kind']} {job['model']} (subprocess)")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"peer worker failed ({p.returncode}): {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def gptfast_argv(job: dict, s: dict, tiny: bool) -> list:
    """benches/peer_gptfast.py's arguments for a decode job on shape `s`: the same prompt and
    decode tokens as ninfer's, the layers kept, torch.compile on the GPU (eager in the dry run)."""
    argv = ["--gpt-fast", job["gpt_fast"], "--prompt", str(job["prompt"]), "--tokens", str(job["tokens"])]
    if s["layers"] != s["full_layers"]:
        argv += ["--layers", str(s["layers"])]
    return argv + (["--tiny"] if tiny else ["--compile"])


def peer_worker(a: argparse.Namespace) -> None:
    """transformers `generate`, bf16, eager, random init from the config on the device; or
    gpt-fast's int4 decode (job kind "gptfast")."""
    import torch
    import transformers as tf

    job = json.loads(a.peer_worker)
    b = Bench(a)
    s = b.shape(job["model"])
    if job["kind"] == "gptfast":
        sibling("peer_gptfast").main(gptfast_argv(job, s, a.tiny))
        return
    dev = b.dev
    torch.manual_seed(0)
    with torch.device(dev):
        model = tf.AutoModelForCausalLM.from_config(b.hf_config(s), dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None

    def sync():
        if dev != "cpu":
            torch.cuda.synchronize()

    def gen(ids, k: int) -> float:
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=k,
                           min_new_tokens=k, pad_token_id=0, eos_token_id=None)
        sync()
        return time.perf_counter() - t

    if job["kind"] == "decode":
        ids = torch.tensor([random_prompt(job["prompt"], s["vocab"], 1)], device=dev)
        gen(ids, 4)
        one, full = gen(ids, 1), gen(ids, job["tokens"] + 1)
        print(json.dumps({"tok_s": job["tokens"] / (full - one), "tokens": job["tokens"]}))
    else:
        out = {}
        for c in job["levels"]:
            ids = torch.tensor([random_prompt(job["prompt"], s["vocab"], 100 + i) for i in range(c)], device=dev)
            secs = gen(ids, job["tokens"])
            out[str(c)] = {"tok_s": c * job["tokens"] / secs, "secs": secs}
            print(f"peer throughput c={c}: {out[str(c)]['tok_s']:.1f} tok/s in {secs:.1f} s", file=sys.stderr, flush=True)
        print(json.dumps(out))


# ---------------------------------------------------------------------------------------------
# Parts


def ninfer_engine(b: Bench, path: Path, **kw):
    """An engine on `path` with the arguments `kw` and --option's engine options, and the
    seconds it took to load."""
    from ninfer import _core

    t = time.perf_counter()
    eng = _core.Engine(str(path), device=b.ninfer_device, prefix_reuse=False, **b.a.options, **kw)
    return eng, time.perf_counter() - t


def ninfer_decode(b: Bench, path: Path, prompt: list, n: int) -> tuple:
    """(decode tok/s over the steps after the first token, load seconds, (steps queued ahead of
    the step in flight, those of them split)), one greedy request (plus --sampling's fields)."""
    eng, load_s = ninfer_engine(b, path, max_context=max(2048, len(prompt) + n + 16),
                                kv_capacity=max(4096, len(prompt) + n + 64),
                                max_concurrency=4, prefill_chunk=512)
    params = _core_params(request_params(b, n + 1))

    def run(rid: str) -> tuple:
        eng.submit(rid, prompt, params)
        got = 0
        while got == 0:
            got += sum(len(d["token_ids"]) for d in eng.step())
        t = time.perf_counter()
        while eng.has_unfinished():
            got += sum(len(d["token_ids"]) for d in eng.step())
        return got - 1, time.perf_counter() - t

    run("warmup")
    toks, secs = run("timed")
    stats = eng.stats()
    eng.shutdown()
    # Split lookahead steps (a grammar's forward queued ahead, its sampling after the token in
    # flight) count in both. Builds before either counter (an A-B of older builds) have no such
    # key: None, recorded as unknown rather than as zero.
    return toks / secs, load_s, (stats.get("lookahead_steps"), stats.get("split_lookahead_steps"))


def part_decode(b: Bench, model: str) -> list:
    a = b.a
    s = b.shape(model)
    path = b.checkpoint(model)
    rate = b.copy_rate()
    prompt = random_prompt(a.prompt, s["vocab"], 1)
    peer_tokens = min(a.tokens, 64 if s["arch"] == "qwen3_5" else 128)
    peer = None
    peer_fields = {"peer": "transformers generate (bf16, eager, random init from the config, same GPU)"}
    if a.peer_gptfast and model == "llama-3-8b":
        peer_tokens = a.tokens
        peer_fields = {"peer": "gpt-fast int4 g64 (torch.compile)", "peer_note": None}
        try:
            got = run_peer(b, {"kind": "gptfast", "model": model, "gpt_fast": a.peer_gptfast, "prompt": a.prompt,
                               "tokens": peer_tokens}, timeout_s=max(600, 4 * a.peer_budget_s))
            peer = got["tok_s"]
            peer_fields.update(gptfast_fields(got, rate))
            log(f"gpt-fast int4 bs1 {model}: {peer:.2f} tok/s ({got['peer']}), "
                f"{peer_fields['peer_fraction_of_ceiling']:.3f} of the copy rate on its bytes")
        except Exception as e:  # noqa: BLE001 - a failing peer (compilation, memory) must not lose ninfer's record
            peer_fields["peer_note"] = f"failed: {str(e)[-1500:]}"
            log(f"gpt-fast int4 bs1 {model}: failed: {str(e)[-300:]}")
    elif not a.skip_peer:
        peer = run_peer(b, {"kind": "decode", "model": model, "prompt": a.prompt, "tokens": peer_tokens})["tok_s"]
        log(f"transformers generate bs1 {model}: {peer:.2f} tok/s")
    log(f"ninfer decode bs1 {model}: loading")
    tok_s, load_s, (lookahead, split) = ninfer_decode(b, path, prompt, a.tokens)
    ctx = a.prompt + a.tokens // 2
    moved = b.bytes_per_token(s, ctx)
    frac = moved * tok_s / rate
    log(f"ninfer decode bs1 {model}: {tok_s:.2f} tok/s (load {load_s:.1f} s), {frac:.3f} of the copy rate, "
        f"{lookahead} steps queued ahead ({split} of them split)")
    return [b.record("decode_bs1_tok_s", model, round(tok_s, 2), s,
                     fraction_of_ceiling=round(frac, 4),
                     ceiling="device copy rate: bytes moved per token (weights read, KV read, recurrent state read "
                             "and written, at the mean context) x tok/s / copy rate",
                     copy_rate_bytes_s=round(rate), bytes_moved_per_token=moved,
                     peer_value=round(peer, 2) if peer else None, peer_decode_tokens=peer_tokens, **peer_fields,
                     prompt_tokens=a.prompt, output_tokens=a.tokens, batch=1, ninfer_load_s=round(load_s, 1),
                     lookahead_steps=lookahead, split_lookahead_steps=split)]


def gptfast_fields(got: dict, rate: float) -> dict:
    """The decode record's fields of gpt-fast's answer (benches/peer_gptfast.py's JSON): its name
    (int4 g64, compiled or eager), the bytes its step reads (int4 weights with their scales and
    zeros, the output head included; the whole KV cache its masked attention reads) and that
    traffic at its tok/s as a fraction of the same copy rate, and its torch."""
    return {"peer": got["peer"], "peer_bytes_per_token": got["bytes_per_token"],
            "peer_int4_weight_bytes": got["int4_weight_bytes"],
            "peer_fraction_of_ceiling": round(got["bytes_per_token"] * got["tok_s"] / rate, 4),
            "peer_torch": got["torch"], "peer_output_head_int4": got["output_head_int4"],
            "peer_int4_check_relative_error": got["int4_check_relative_error"]}


def part_throughput(b: Bench) -> list:
    a = b.a
    model = a.tp_model
    s = b.shape(model)
    path = b.checkpoint(model)
    rate = b.copy_rate()
    levels = [int(x) for x in a.concurrency.split(",")]
    plen, olen = a.tp_prompt, a.tp_tokens
    if b.tiny:
        plen, olen = min(plen, 64), min(olen, 16)
    peers: dict = {}
    peer_note = None
    if a.skip_peer:
        peer_note = "--skip-peer"
    else:
        # One level first to estimate the others' time (eager generate is launch-bound: its step
        # time grows slowly with the batch, so the next level takes about as long as this one).
        done: list = []
        for c in levels:
            if done:
                last = peers[str(done[-1])]["secs"]
                if last * 1.5 > a.peer_budget_s:
                    peers[str(c)] = {"skipped": f"estimated {last * 1.5:.0f} s > --peer-budget-s {a.peer_budget_s:.0f}"}
                    continue
            try:
                got = run_peer(b, {"kind": "throughput", "model": model, "prompt": plen, "tokens": olen, "levels": [c]},
                               timeout_s=max(600, 4 * a.peer_budget_s))
                peers.update(got)
                done.append(c)
            except Exception as e:  # noqa: BLE001 - an out-of-memory peer must not lose ninfer's record
                peers[str(c)] = {"skipped": f"failed: {str(e)[-300:]}"}
    eng, load_s = ninfer_engine(b, path, max_context=plen + olen + 16, kv_capacity=max(levels) * (plen + olen + 32),
                                max_concurrency=max(levels), prefill_chunk=a.prefill_chunk)
    params = _core_params(request_params(b, olen))
    eng.submit("warmup", random_prompt(plen, s["vocab"], 7), _core_params('{"max_tokens": 8, "ignore_eos": true}'))
    while eng.has_unfinished():
        eng.step()
    recs = []
    for c in levels:
        first: dict = {}
        counts: dict = {}
        all_first = None  # when the last request got its first token: the decode phase starts
        after_first = 0  # tokens generated in the steps after that
        phase_steps = []  # those steps' sequences' contexts (their bytes are summed after the timed loop)
        t0 = time.perf_counter()
        for i in range(c):
            eng.submit(f"c{c}-{i}", random_prompt(plen, s["vocab"], 1000 * c + i), params)
        while eng.has_unfinished():
            deltas = eng.step()
            now = time.perf_counter()
            contexts = []
            for d in deltas:
                n = len(d["token_ids"])
                if not n:
                    continue
                rid = d["request_id"]
                contexts.append(plen + counts.get(rid, 0))
                counts[rid] = counts.get(rid, 0) + n
                first.setdefault(rid, now)
                if all_first is not None:
                    after_first += n
            if all_first is not None and contexts:
                phase_steps.append(contexts)
            if all_first is None and len(first) == c:
                all_first = now
        t_end = time.perf_counter()
        if all_first is None:
            all_first = t_end
        total = sum(counts.values())
        tok_s = total / (t_end - t0)
        decode_s = t_end - all_first
        decode_tok_s = after_first / decode_s if decode_s > 0 else None
        ctx = plen + olen // 2
        ceiling = c * rate / b.bytes_per_token(s, ctx, batch=c) * 1.0
        decode_frac = decode_tok_s / ceiling if decode_tok_s else None
        ideal_s = sum(b.step_bytes(s, ctxs) for ctxs in phase_steps) / rate  # each step's bytes at the copy rate
        step_frac = ideal_s / decode_s if decode_s > 0 and ideal_s else None
        peer = peers.get(str(c), {})
        log(f"ninfer throughput c={c}: {tok_s:.1f} output tok/s ({total} tokens in {t_end - t0:.1f} s); decode phase "
            f"{decode_tok_s or 0:.1f} tok/s = {decode_frac or 0:.3f} of its bandwidth ceiling at c sequences, "
            f"{step_frac or 0:.3f} of each step's own")
        recs.append(b.record(
            "decode_throughput_tok_s", model, round(tok_s, 1), s,
            fraction_of_ceiling=None,
            ceiling_note=("none for the whole run: it mixes the prefill of the 1k-token prompts (compute-bound) "
                          "with decode (bandwidth-bound). The decode phase alone (after every request's first "
                          "token) is given with its bandwidth roofline: weights once per step plus each "
                          "sequence's KV cache at the mean context, at the copy rate, as if all c sequences ran "
                          "every step (decode_phase_fraction_of_bandwidth); and against each step's own bytes "
                          "(weights plus the KV and state of the sequences that step ran, at their contexts) "
                          "summed over the phase (decode_phase_fraction_of_step_bandwidth): requests that got "
                          "their first token in earlier prefill steps finish earlier, so the phase ends with "
                          "steps of fewer sequences, which the first figure counts as loss"),
            decode_phase_tok_s=round(decode_tok_s, 1) if decode_tok_s else None,
            decode_phase_fraction_of_bandwidth=round(decode_frac, 4) if decode_frac else None,
            decode_phase_fraction_of_step_bandwidth=round(step_frac, 4) if step_frac else None,
            copy_rate_bytes_s=round(rate),
            peer="transformers generate, padded batch of the same size (bf16, eager, random init, same GPU), "
                 "output tokens / generate time",
            peer_value=round(peer["tok_s"], 1) if "tok_s" in peer else None,
            peer_note=peer.get("skipped", peer_note),
            concurrency=c, batch=c, prompt_tokens=plen, output_tokens=olen, requests=c, wall_s=round(t_end - t0, 2),
            prefill_chunk=a.prefill_chunk, ninfer_load_s=round(load_s, 1)))
    eng.shutdown()
    return recs


def preread(path: Path) -> tuple:
    """Reads every file of `path` once (into the page cache); (bytes, seconds)."""
    files = sorted(path.glob("*.safetensors"))
    t = time.perf_counter()

    def read(f: Path) -> int:
        n = 0
        with open(f, "rb", buffering=0) as fh:
            while True:
                chunk = fh.read(64 << 20)
                if not chunk:
                    return n
                n += len(chunk)

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        total = sum(ex.map(read, files))
    return total, time.perf_counter() - t


def free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def first_streamed_token(port: int, prompt: list, deadline: float) -> float:
    """Sends a streaming completion until the server takes it; returns when the first SSE data
    event with a token arrives."""
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "stream": True, "ignore_eos": True, "temperature": 0})
    while time.perf_counter() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status == 503:
                resp.read()
                conn.close()
                time.sleep(0.05)
                continue
            if resp.status != 200:
                raise RuntimeError(f"completion request failed: HTTP {resp.status} {resp.read()[:500]!r}")
            while True:
                line = resp.readline()
                if not line:
                    raise RuntimeError("stream ended without a token")
                if line.startswith(b"data:") and b"choices" in line:
                    t = time.perf_counter()
                    conn.close()
                    return t
        except (ConnectionError, OSError) as e:
            if isinstance(e, socket.timeout):
                raise
            time.sleep(0.05)
    raise TimeoutError("no streamed token before the deadline")


def part_startup(b: Bench) -> list:
    model = "qwen3_5-27b"
    s = b.shape(model)
    path = b.checkpoint(model)
    nbytes, secs = preread(path)
    log(f"pre-read {nbytes / 1e9:.1f} GB in {secs:.1f} s ({nbytes / 1e9 / max(secs, 1e-9):.1f} GB/s) into the page cache")
    cache = os.environ.get("NINFER_KERNEL_CACHE", "")
    kernels_cached = bool(cache) and Path(cache).is_dir() and any(Path(cache).iterdir())
    out_dir = Path(b.a.out).resolve().parent
    log_path = out_dir / "startup_serve.log"
    port = free_port()
    # The server's defaults, as a user starts it: the model's full context, 64 concurrent
    # requests, and the KV pool planned from the device memory left after the weights, so the
    # time includes allocating (and zeroing) that pool and the state slots.
    args = [sys.executable, "-m", "ninfer.server.serve", str(path), "--device", b.ninfer_device, "--port", str(port)]
    prompt = random_prompt(32, s["vocab"], 5)
    with open(log_path, "w") as lf:
        t0 = time.perf_counter()
        proc = subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT)
        try:
            t1 = first_streamed_token(port, prompt, t0 + 900)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    startup = t1 - t0
    lines = log_path.read_text(errors="replace").splitlines()
    loaded = [ln.strip() for ln in lines if "loaded" in ln]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("memory ledger")), len(lines))
    ledger = [ln.strip() for ln in lines[start:start + 9]]
    log(f"startup: first streamed token {startup:.1f} s after the process started; {loaded[-1] if loaded else ''}")
    _, total_bytes = b.weight_bytes(s)
    return [b.record("startup_s", model, round(startup, 2), s,
                     fraction_of_ceiling=None,
                     ceiling_note="none defined (target: under 30 s with the weights in the page cache)",
                     command_measured=" ".join(args[1:]), weights_bytes=total_bytes,
                     page_cache_preread_gb_s=round(nbytes / 1e9 / max(secs, 1e-9), 2),
                     kernel_cache_warm=kernels_cached, server_load_line=loaded[-1] if loaded else None,
                     server_ledger_lines=ledger[:12],
                     prompt_tokens=len(prompt), output_tokens=1, batch=1,
                     peer=None, peer_note="no peer measured for startup")]


def timeline_spans(events: list) -> list:
    """(start, end, name) of every profiled kernel and copy that has a time range, by start."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if getattr(e, "time_range", None) is not None and e.time_range.end > e.time_range.start)


def device_idle(events: list, steps: int, first_kernel: str = "embedding_gather") -> dict:
    """The device timeline of profiled decode steps: the union of every kernel's and copy's
    interval (kernels overlap under PDL, so their durations do not add up), and the idle gaps
    in it, split into those that end at a step's first kernel (`first_kernel`: the GPU waiting
    for the host between steps) and the rest (inside a step). Per step, in microseconds."""
    spans = timeline_spans(events)
    busy = between = within = 0.0
    cur_start = cur_end = None
    for start, end, name in spans:
        if cur_end is None:
            cur_start, cur_end = start, end
            continue
        if start > cur_end:
            gap = start - cur_end
            if name == first_kernel:
                between += gap
            else:
                within += gap
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    n = max(steps, 1)
    return {"busy_us_per_step": busy / n, "between_steps_us_per_step": between / n, "within_steps_us_per_step": within / n}


def kernel_path(events: list, steps: int) -> list:
    """Per kernel name: calls and mean profiled duration a step, and the time its calls add to
    the step's timeline (each call's end past the latest end before it, idle gaps left out).
    Under PDL a kernel starts while the one before runs, so its duration includes that wait;
    what it adds is what removing its work could save. Sorted by time added, per step (us)."""
    rows: dict = {}
    last = float("-inf")
    for start, end, name in timeline_spans(events):
        added = end - max(start, last)
        last = max(last, end)
        r = rows.setdefault(name, [0, 0.0, 0.0])
        r[0] += 1
        r[1] += end - start
        r[2] += max(added, 0.0)
    n = max(steps, 1)
    out = [{"name": k, "calls_per_step": round(c / n, 2), "us_per_call": round(d / c, 2), "adds_us_per_step": round(a / n, 1)}
           for k, (c, d, a) in rows.items()]
    return sorted(out, key=lambda r: -r["adds_us_per_step"])


def part_profile(b: Bench, model: str) -> list:
    """Where a decode step's time goes (batch 1, or --profile-batch sequences): kernel time on the GPU (CUPTI records every
    kernel of the process, ours included) against the step's wall time. The difference is time
    the GPU waits for the host (sampling, scheduling, metadata upload, Python)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    a = b.a
    s = b.shape(model)
    path = b.checkpoint(model)
    n = a.profile_batch
    steps = 64
    chunk = max(512, min(8192, n * a.prompt))
    # Past every prefill (chunk tokens a step), then 40 decode steps: the profiled steps are
    # decode steps of all n sequences, none of which finishes inside them.
    warm = 40 + -(-n * a.prompt // chunk)
    ctx = a.prompt + warm + steps + 16
    eng, _ = ninfer_engine(b, path, max_context=max(2048, ctx), kv_capacity=max(4096, n * (ctx + 16)),
                           max_concurrency=max(4, n), prefill_chunk=chunk)
    params = _core_params(json.dumps({"max_tokens": warm + steps + 8, "temperature": 0.0, "ignore_eos": True}))
    for i in range(n):
        eng.submit(f"p{i}", random_prompt(a.prompt, s["vocab"], 2 + i), params)
    for _ in range(warm):
        eng.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = time.perf_counter() - t
    eng.shutdown()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kernels if hasattr(e, "device_time")) if kernels else 0.0
    if not busy_us:
        busy_us = sum(getattr(e, "cuda_time", 0.0) for e in kernels)
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
    idle = device_idle(kernels, steps)
    path = kernel_path(kernels, steps)
    path_text = "\n".join(f"{r['adds_us_per_step']:10.1f} us/step added  {r['calls_per_step']:6.2f} calls  "
                          f"{r['us_per_call']:9.2f} us/call  {r['name']}" for r in path)
    # The profiled steps' bytes at the copy rate (each sequence at prompt + warm + k tokens in
    # step k): the fraction of the bandwidth ceiling the steady state reaches.
    ideal = sum(b.step_bytes(s, [a.prompt + warm + k] * n) for k in range(steps)) / b.copy_rate()
    text = (f"{steps} decode steps, batch {n} ({a.prompt}-token prompts), {model}: wall {wall / steps * 1e3:.3f} ms/step, GPU kernel time "
            f"{busy_us / steps / 1e3:.3f} ms/step, {len(kernels) / steps:.0f} kernels/step; the steps' bytes at the copy rate "
            f"{ideal / steps * 1e3:.3f} ms/step = {ideal / wall:.3f} of the wall time\n"
            f"device timeline: busy (union of kernels and copies) {idle['busy_us_per_step']:.1f} us/step, idle "
            f"before a step's first kernel (host turnaround: result copy, scheduling, metadata upload, graph "
            f"launch) {idle['between_steps_us_per_step']:.1f} us/step, idle inside steps "
            f"{idle['within_steps_us_per_step']:.1f} us/step\n\ntime each kernel adds to the step's timeline "
            f"(its end past the latest end before it):\n{path_text}\n\n{table}\n")
    base = Path(a.out).parent / a.profile_out
    out = base.with_name(f"{base.stem}_{model}{'' if n == 1 else f'_b{n}'}{base.suffix}")
    out.write_text(text)
    log(text[:3000])
    return [b.record("decode_step_profile", model, round(wall / steps * 1e3, 4), s, unit="ms per step",
                     gpu_kernel_ms_per_step=round(busy_us / steps / 1e3, 4), kernels_per_step=len(kernels) / steps,
                     bandwidth_ms_per_step=round(ideal / steps * 1e3, 4), fraction_of_step_bandwidth=round(ideal / wall, 4),
                     copy_rate_bytes_s=round(b.copy_rate()),
                     device_idle_us_per_step=idle, kernels=path[:40],
                     fraction_of_ceiling=None, peer=None, peer_value=None, batch=n, prompt_tokens=a.prompt,
                     table_file=out.name)]


def guarded(b: Bench, name: str, model: str, fn) -> None:
    log(f"=== {name} ===")
    t = time.perf_counter()
    try:
        recs = fn()
    except Exception as e:  # noqa: BLE001 - one part's failure must not lose the others' records
        traceback.print_exc()
        s = b.shape(model)
        recs = [b.record(name, model, None, s, error=f"{type(e).__name__}: {str(e)[-1500:]}")]
    log(f"=== {name} done in {time.perf_counter() - t:.1f} s ===")
    b.add(recs)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.peer_worker:
        peer_worker(a)
        return 0
    if a.ab or a.ab_builds:
        return gpu_ab().run_ab(a, sys.argv[1:] if argv is None else list(argv), log)
    b = Bench(a)
    log(f"device {b.device_name}; parts: " + ", ".join(
        n for n, on in (("decode-8b", a.decode_8b), ("profile", a.profile), (f"throughput {a.tp_model}", a.throughput), ("decode-27b", a.decode_27b),
                        ("startup", a.startup), ("decode-qwen2-7b", a.decode_qwen2_7b)) if on))
    # Shape by shape: the two checkpoints do not fit the disk together.
    if a.decode_8b:
        guarded(b, "decode_bs1_tok_s", "llama-3-8b", lambda: part_decode(b, "llama-3-8b"))
    if a.profile and (a.decode_8b or not a.decode_27b):
        guarded(b, "decode_step_profile", "llama-3-8b", lambda: part_profile(b, "llama-3-8b"))
    if a.throughput and a.tp_model == "llama-3-8b":
        guarded(b, "decode_throughput_tok_s", "llama-3-8b", lambda: part_throughput(b))
    b.drop_checkpoint("llama-3-8b")
    if a.decode_qwen2_7b:
        guarded(b, "decode_bs1_tok_s", "qwen2-7b", lambda: part_decode(b, "qwen2-7b"))
        b.drop_checkpoint("qwen2-7b")
    if a.startup:
        guarded(b, "startup_s", "qwen3_5-27b", lambda: part_startup(b))
    if a.decode_27b:
        guarded(b, "decode_bs1_tok_s", "qwen3_5-27b", lambda: part_decode(b, "qwen3_5-27b"))
        if a.profile:
            guarded(b, "decode_step_profile", "qwen3_5-27b", lambda: part_profile(b, "qwen3_5-27b"))
    if a.throughput and a.tp_model == "qwen3_5-27b":
        guarded(b, "decode_throughput_tok_s", "qwen3_5-27b", lambda: part_throughput(b))
    b.drop_checkpoint("qwen3_5-27b")
    new = b.records[b.earlier:]
    errors = [r for r in new if "error" in r]
    log(f"{len(new)} new records in {a.out} ({b.earlier} kept from before), {len(errors)} failed parts")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
