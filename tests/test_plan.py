"""`ninfer plan`: the memory ledger without loading the weights, checked against a hand count of
the Qwen3.5-27B tensors, its verdict and suggestions, its refusals, and the equality of its
ledger with the one the engine's startup prints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ninfer import _core
from ninfer.cli import default_model_dir

# The published Qwen3.5-27B text model: 64 layers = 16 x [3 Gated DeltaNet + 1 full attention].
H, FFN, VOCAB = 5120, 17408, 248320
NH, NKV, HD = 24, 4, 256
NK, NV, KD, VD, KERN = 16, 48, 128, 128, 4
LAYERS = ["linear_attention"] * 3 + ["full_attention"]


def write_qwen35_27b_config(d) -> str:
    text = {
        "model_type": "qwen3_5_text", "hidden_size": H, "intermediate_size": FFN, "num_hidden_layers": 64,
        "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD, "vocab_size": VOCAB,
        "layer_types": LAYERS * 16, "linear_num_key_heads": NK, "linear_num_value_heads": NV,
        "linear_key_head_dim": KD, "linear_value_head_dim": VD, "linear_conv_kernel_dim": KERN,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "attn_output_gate": True, "full_attention_interval": 4, "mtp_num_hidden_layers": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
        "eos_token_id": 248044,
    }
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": False, "text_config": text}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def hand_count():
    """(name, shape, kind) of every tensor of the text model (no MTP head), kind one of matrix
    (quantized by --quantize), head (embedding, LM head), dense (16-bit), f32."""
    t = [("embed_tokens", (VOCAB, H), "head"), ("norm", (H,), "dense"), ("lm_head", (VOCAB, H), "head")]
    conv = 2 * NK * KD + NV * VD
    for i in range(64):
        t += [("input_layernorm", (H,), "dense"), ("post_attention_layernorm", (H,), "dense"),
              ("gate_proj", (FFN, H), "matrix"), ("up_proj", (FFN, H), "matrix"), ("down_proj", (H, FFN), "matrix")]
        if LAYERS[i % 4] == "full_attention":
            t += [("q_proj", (2 * NH * HD, H), "matrix"), ("k_proj", (NKV * HD, H), "matrix"),
                  ("v_proj", (NKV * HD, H), "matrix"), ("o_proj", (H, NH * HD), "matrix"),
                  ("q_norm", (HD,), "dense"), ("k_norm", (HD,), "dense")]
        else:
            t += [("in_proj_qkv", (conv, H), "matrix"), ("in_proj_z", (NV * VD, H), "matrix"),
                  ("in_proj_b", (NV, H), "matrix"), ("in_proj_a", (NV, H), "matrix"),
                  ("conv1d", (conv, 1, KERN), "dense"), ("A_log", (NV,), "f32"), ("dt_bias", (NV,), "f32"),
                  ("linear_attn.norm", (VD,), "dense"), ("out_proj", (H, NV * VD), "matrix")]
    return t


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def q4_bytes(n, k):
    """Q4G64_F16S: 4-bit values and an f16 scale per group of 64 along the row."""
    return n * k // 2 + n * (k // 64) * 2


def run_cli(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ninfer.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=timeout)


def test_qwen35_27b_in_q4_fits_a_32gb_gpu_with_32k_context_by_the_hand_count(tmp_path):
    model = write_qwen35_27b_config(tmp_path)
    tensors = hand_count()
    assert sum(1 for _, _, k in tensors if k == "matrix") == 64 * 3 + 48 * 5 + 16 * 4
    want = {"Q4G64_F16S": 0, "BF16": 0, "F32": 0}
    for _, shape, kind in tensors:
        if kind == "matrix":
            want["Q4G64_F16S"] += q4_bytes(*shape)
        elif kind == "f32":
            want["F32"] += 4 * numel(shape)
        else:
            want["BF16"] += 2 * numel(shape)
    p = _core.plan(model, gpu_memory=32 * 10**9, max_context=32768, max_concurrency=1, quantize="q4")
    assert p["config_only"] is True
    assert {w["format"]: w["bytes"] for w in p["weights"]} == want
    assert {w["format"]: w["tensors"] for w in p["weights"]} == {
        "Q4G64_F16S": 64 * 3 + 48 * 5 + 16 * 4, "F32": 48 * 2, "BF16": 3 + 64 * 2 + 16 * 2 + 48 * 2}
    assert p["weight_bytes"] == sum(want.values())
    # KV: 16 attention layers x K and V x 4 heads x 256 in bf16; state: 48 GDN layers of a bf16
    # conv state (3 inputs of each channel) and an f32 128 x 128 state per value head.
    assert p["kv_bytes_per_token"] == 16 * 2 * NKV * HD * 2
    assert p["kv_capacity_tokens"] == 32768 and p["kv_bytes"] == 32768 * p["kv_bytes_per_token"]
    assert p["state_bytes_per_slot"] == 48 * ((2 * NK * KD + NV * VD) * (KERN - 1) * 2 + NV * KD * VD * 4)
    # One running sequence, the score slot and a prefix snapshot.
    assert p["state_bytes"] == 3 * p["state_bytes_per_slot"]
    reserve = max(32 * 10**9 // 20, 1 << 30)
    assert p["reserve_bytes"] == reserve
    assert p["needed_bytes"] == p["weight_bytes"] + p["kv_bytes"] + p["state_bytes"] + p["workspace_bytes"] + reserve
    assert p["fits"] and p["largest_context"] >= 32768 and p["short_bytes"] == 0

    proc = run_cli(["plan", model, "--gpu-memory", "32GB", "--quantize", "q4", "--max-context", "32768"])
    assert proc.returncode == 0, proc.stderr
    assert "fits: --max-context 32768 at --max-concurrency 1" in proc.stdout
    assert "Q4G64_F16S" in proc.stdout and "config.json only" in proc.stdout


def test_the_mtp_head_counts_with_spec_mtp(tmp_path):
    model = write_qwen35_27b_config(tmp_path)
    plain = _core.plan(model, gpu_memory=32 * 10**9, max_context=4096, quantize="q4")
    mtp = _core.plan(model, gpu_memory=32 * 10**9, max_context=4096, quantize="q4", spec="mtp")
    # fc [H, 2H] and one gated attention + MLP layer in q4; three norms, two layer norms, q/k norms in bf16.
    layer = (q4_bytes(2 * NH * HD, H) + 2 * q4_bytes(NKV * HD, H) + q4_bytes(H, NH * HD)
             + 2 * q4_bytes(FFN, H) + q4_bytes(H, FFN))
    assert mtp["weight_bytes"] - plain["weight_bytes"] == q4_bytes(H, 2 * H) + layer + 2 * (5 * H + 2 * HD)
    assert mtp["kv_bytes_per_token"] - plain["kv_bytes_per_token"] == 2 * NKV * HD * 2
    assert mtp["prefix_reuse"] is True and mtp["state_slots_rollback"] == 1


def test_settings_that_do_not_fit_exit_1_with_the_bytes_short_and_what_fits(tmp_path):
    model = write_qwen35_27b_config(tmp_path)
    args = dict(gpu_memory=32 * 10**9, max_context=131072, max_concurrency=4, quantize="q4")
    p = _core.plan(model, **args)
    assert not p["fits"] and p["short_bytes"] == p["needed_bytes"] - 32 * 10**9
    best_ctx, best_conc = p["largest_context"], p["largest_concurrency"]
    assert 0 < best_ctx < 131072 and 0 < best_conc < 4

    def fits(ctx, conc):
        return _core.plan(model, **{**args, "max_context": ctx, "max_concurrency": conc})["fits"]

    assert fits(best_ctx, 4) and not fits(best_ctx + 1, 4)
    assert fits(131072, best_conc) and not fits(131072, best_conc + 1)

    proc = run_cli(["plan", model, "--gpu-memory", "32GB", "--quantize", "q4", "--max-context", "131072",
                    "--max-concurrency", "4"])
    assert proc.returncode == 1, proc.stderr
    assert f"short by {p['short_bytes']:,} B" in proc.stdout
    assert f"at most --max-context {best_ctx} fits" in proc.stdout
    assert f"at most --max-concurrency {best_conc} fits" in proc.stdout
    # In bf16 the weights alone exceed the device.
    proc = run_cli(["plan", model, "--gpu-memory", "32GiB", "--max-context", "4096"])
    assert proc.returncode == 1 and "nothing fits" in proc.stdout, proc.stdout


@pytest.mark.parametrize("args, needle", [
    (["--gpu-memory", "32XB"], "'32XB'"),
    (["--gpu-memory", "lots"], "'lots'"),
    (["--gpu-memory", "32"], "'32'"),
    (["--gpu-memory", "0GiB"], "'0GiB'"),
    (["--quantize", "q3"], "'q3'"),
    (["--device", "tpu:0"], "'tpu:0'"),
    (["--max-context", "0"], "'0'"),
    (["--kv-dtype", "int4"], "int4"),
    (["--spec", "dflash"], "dflash"),
    (["--quantize-lm-head"], "--quantize-lm-head needs --quantize"),
    (["--gpu-memory", "32GiB", "--device", "cpu"], "not allowed with"),
    (["--gpu-memory", "32GiB", "--kv-dtype", "float32"], "float32 is not supported here"),
    (["--device", "cpu", "--kv-dtype", "bf16"], "bf16 is not supported here"),
    (["--device", "cpu", "--quantize", "int3"], "'int3'"),
])
def test_bad_flags_exit_2_naming_the_value(tmp_path, args, needle):
    model = write_qwen35_27b_config(tmp_path)
    proc = run_cli(["plan", model, *args])
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_sizes_in_both_unit_families_and_format_choices_match_the_core():
    from ninfer.plan import QUANTIZE_FORMATS, parse_size

    assert parse_size("32GiB") == 32 << 30 and parse_size("32GB") == 32 * 10**9
    assert parse_size("24000MiB") == 24000 << 20 and parse_size("1.5TB") == 15 * 10**11
    assert tuple(_core.QUANTIZE_FORMATS) == QUANTIZE_FORMATS


def test_matrices_the_format_cannot_hold_stay_dense(tmp_path):
    """NVFP4 tiles rows by 128 and columns by 64: the 27B's [48, 5120] GDN gate projections
    (in_proj_a, in_proj_b) stay bf16, every other matrix is NVFP4."""
    model = write_qwen35_27b_config(tmp_path)
    p = _core.plan(model, gpu_memory=32 * 10**9, max_context=32768, max_concurrency=1, quantize="nvfp4")
    by = {w["format"]: w for w in p["weights"]}
    assert by["NVFP4"]["tensors"] == 64 * 3 + 48 * 5 + 16 * 4 - 48 * 2
    dense_matrices = 48 * 2 * 2 * 48 * 5120
    assert by["BF16"]["tensors"] == 3 + 64 * 2 + 16 * 2 + 48 * 2 + 48 * 2
    assert by["BF16"]["bytes"] >= dense_matrices and p["fits"]


@pytest.fixture(scope="module")
def tiny_quant_models(tmp_path_factory):
    """Tiny checkpoints whose shapes NVFP4 holds in part (rows a multiple of 128, columns of 64):
    a Qwen3.5 with an MTP head (gated attention, GDN; in_proj_b/in_proj_a and the vocab-397 head
    stay dense under NVFP4) and a Llama with a tied head."""
    from tiny_models import add_mtp_head, make_model

    root = tmp_path_factory.mktemp("plan_quant")
    qwen = add_mtp_head(make_model(root / "qwen3_5", "qwen3_5", hidden_size=128, intermediate_size=256, head_dim=32,
                                   linear_key_head_dim=32, linear_value_head_dim=32, seed=3))
    llama = make_model(root / "llama_tied", "llama_tied", hidden_size=128, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=384, seed=7)
    return {"qwen3_5": qwen, "llama_tied": llama}


FORMAT_NAMES = {"w8": "W8G32_F16S", "q4": "Q4G64_F16S", "q5": "Q5G64_F16S", "q6": "Q6G64_F16S",
                "fp8": "FP8_E4M3FN_ROW_BF16S", "nvfp4": "NVFP4"}


def _matrix_shapes(model_dir):
    """Shapes of the projections `--quantize` quantizes, from the safetensors header."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        return {n: f.get_slice(n).get_shape() for n in f.keys() if re.search(r"(_proj(_\w+)?|^mtp\.fc|^lm_head)\.weight$", n)}


@pytest.mark.parametrize("mode", tuple(FORMAT_NAMES))
@pytest.mark.parametrize("name, lm_head", [("qwen3_5", False), ("qwen3_5", True), ("llama_tied", True)])
def test_cpu_quantize_plan_counts_the_bytes_the_cpu_loader_packs(tiny_quant_models, name, lm_head, mode):
    """`ninfer plan --device cpu --quantize` counts what the CPU loader holds: its weight bytes
    are the loaded model's own report, and the quantized tensors are the projections the format
    can hold (NVFP4: rows a multiple of 128, columns of 64), the head with --quantize-lm-head
    (a tied head as a copy beside the f32 embedding)."""
    model_dir = str(tiny_quant_models[name])
    loaded = _core.Model(model_dir, device="cpu", quantize=mode, quantize_lm_head=lm_head)
    p = _core.plan(model_dir, device="cpu", quantize=mode, quantize_lm_head=lm_head)
    assert p["target"] == "cpu"
    assert p["weight_bytes"] == loaded.config["weight_bytes"] == sum(w["bytes"] for w in p["weights"])
    dense = _core.plan(model_dir, device="cpu")
    assert [w["format"] for w in dense["weights"]] == ["F32"]
    assert dense["weight_bytes"] == _core.Model(model_dir, device="cpu").config["weight_bytes"]
    assert p["weight_bytes"] < dense["weight_bytes"]

    shapes = _matrix_shapes(tiny_quant_models[name])
    if loaded.config["tie_word_embeddings"]:
        assert "lm_head.weight" not in shapes
        shapes["lm_head.weight"] = [loaded.config["vocab_size"], loaded.config["hidden_size"]]
    if not lm_head:
        shapes.pop("lm_head.weight")
    held = [n for n, (r, c) in shapes.items() if mode != "nvfp4" or (r % 128 == 0 and c % 64 == 0)]
    by = {w["format"]: w["tensors"] for w in p["weights"]}
    assert by[FORMAT_NAMES[mode]] == len(held), (by, held)
    if mode == "nvfp4":
        assert 0 < len(held) < len(shapes)
    # A quantized gated q_proj (Qwen3.5: the attention layer's and the MTP head's) keeps an output order.
    gated = [n for n in held if n.endswith("q_proj.weight")] if name == "qwen3_5" else []
    assert by.get("U32", 0) == len(gated)

    flags = ["--quantize", mode] + (["--quantize-lm-head"] if lm_head else [])
    proc = run_cli(["plan", model_dir, "--device", "cpu", *flags])
    assert proc.returncode in (0, 1), proc.stderr
    assert FORMAT_NAMES[mode] in proc.stdout and f"({p['needed_bytes']:,} B)" in proc.stdout, proc.stdout


def test_the_startup_check_counts_the_weights_as_quantize_packs_them(tiny_quant_models):
    """A start with --quantize is checked against the packed weights, not the dense ones (a 27B
    in Q4 on a 32 GB GPU must not be refused for its bf16 size)."""
    model_dir = str(tiny_quant_models["qwen3_5"])
    for quantize in (None, "q4"):
        with pytest.raises(_core.OutOfMemoryError) as e:
            _core.Engine(model_dir, device="cpu", kv_capacity=10**13, quantize=quantize)
        weights = int(re.search(r"weights (\d+) B", str(e.value)).group(1))
        assert weights == _core.plan(model_dir, device="cpu", quantize=quantize)["weight_bytes"], str(e.value)


def test_an_unknown_quantize_mode_is_refused_naming_the_value(tiny_quant_models):
    model_dir = str(tiny_quant_models["qwen3_5"])
    for device in ("cpu", None):
        with pytest.raises(_core.NinferError, match="`q3`"):
            _core.plan(model_dir, device=device, gpu_memory=None if device else 32 << 30, quantize="q3")
    proc = run_cli(["plan", model_dir, "--device", "cpu", "--quantize", "q3"])
    assert proc.returncode == 2 and "'q3'" in proc.stderr and "--quantize" in proc.stderr, proc.stderr


#: A tiny Llama the CUDA backend loads: head_dim 64, every projection's rows a multiple of 16.
CUDA_LLAMA = dict(hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed", "fp8"])
def test_a_quantized_hf_checkpoint_plans_its_stored_bytes_and_starts(tmp_path, method):
    """A quantized HF checkpoint is planned from its headers (the weights as stored, on both
    backends), so `ninfer plan` and the engine's startup check take it; the CPU figure is the
    loaded model's own."""
    from test_quantized_model import build_hf_quantized
    from tiny_models import make_model
    from safetensors import safe_open

    # Shapes the CUDA kernels take (head_dim 64) and whose fused parts cut at whole row units.
    src = make_model(tmp_path / "src", "llama", seed=5, **CUDA_LLAMA)
    qdir, _ = build_hf_quantized(src, tmp_path, method)
    cpu = _core.plan(str(qdir), device="cpu")
    model = _core.Model(str(qdir), device="cpu")
    assert cpu["weight_bytes"] == model.config["weight_bytes"]
    fmt = {"awq": "HF_AWQ4", "gptq": "HF_GPTQ4", "compressed": "HF_PACK_QUANTIZED4", "fp8": "HF_FP8_BLOCK"}[method]
    by = {w["format"]: w for w in cpu["weights"]}
    projections = 3 * 7  # q, k, v, o, gate, up, down in each of the 3 layers
    assert by[fmt]["tensors"] == projections
    # Hand count: the bytes of every tensor the quantized modules store.
    stored = 0
    with safe_open(str(qdir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if re.search(r"_proj\.(qweight|qzeros|scales|g_idx|weight_packed|weight_scale|weight_scale_inv)$", name) or (
                    method == "fp8" and name.endswith("_proj.weight")):
                t = f.get_tensor(name)
                stored += t.numel() * t.element_size()
    assert by[fmt]["bytes"] == stored
    if method == "gptq":
        # On the GPU a fused projection keeps one g_idx: act-order parts whose g_idx differ are
        # refused by the CUDA loader, and so by the plan, naming the projection and the reason.
        with pytest.raises(_core.NinferError, match=r"q_proj\.weight.*HF_GPTQ4.*different g_idx"):
            _core.plan(str(qdir), gpu_memory=32 << 30)
    else:
        gpu = _core.plan(str(qdir), gpu_memory=32 << 30)
        gpu_by = {w["format"]: w for w in gpu["weights"]}
        assert gpu_by[fmt]["tensors"] == projections and gpu_by[fmt]["bytes"] == stored
        assert gpu["workspace_bytes"] > _core.plan(str(src), gpu_memory=32 << 30)["workspace_bytes"]
    # The engine's startup check plans it too.
    from ninfer import LLM

    with LLM(str(qdir), device="cpu", max_concurrency=1) as llm:
        assert llm.engine.info()["weight_bytes"] == cpu["weight_bytes"]
    with pytest.raises(_core.NinferError, match=f"already quantized.*{fmt}"):
        _core.plan(str(qdir), device="cpu", quantize="q4")


def test_a_quantized_hybrid_with_an_mtp_head_plans_what_the_cpu_loader_holds(tiny_quant_models, tmp_path):
    """FP8 blocks over Qwen3.5's projections and its MTP head's: the CPU keeps each gated
    q_proj's output order beside it (U32, the model's attention layer and the head's)."""
    from test_quantized_model import build_hf_quantized

    qdir, _ = build_hf_quantized(tiny_quant_models["qwen3_5"], tmp_path, "fp8")
    p = _core.plan(str(qdir), device="cpu")
    assert p["weight_bytes"] == _core.Model(str(qdir), device="cpu").config["weight_bytes"]
    by = {w["format"]: w["tensors"] for w in p["weights"]}
    assert by["U32"] == 2 and by["HF_FP8_BLOCK"] == len(_matrix_shapes(tiny_quant_models["qwen3_5"])) - 1  # all but lm_head
    # Without its safetensors, which modules are quantized cannot be known: refused, naming why.
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((qdir / "config.json").read_text())
    with pytest.raises(_core.NinferError, match="quantization_config.*HF_FP8_BLOCK.*no safetensors"):
        _core.plan(str(config_only), device="cpu")


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="this machine has a GPU: --device cuda:0 plans for it")
def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    model = write_qwen35_27b_config(tmp_path)
    proc = run_cli(["plan", model, "--device", "cuda:0", "--quantize", "q4"])
    assert proc.returncode == 2 and "cuda:0" in proc.stderr and "CUDA" in proc.stderr, proc.stderr


def _demo():
    demo = default_model_dir()
    if demo is None:
        pytest.skip("no bundled demo model in this checkout")
    return demo


LEDGER_KEYS = ("weight_bytes", "kv_bytes_per_token", "kv_capacity_tokens", "num_blocks", "kv_bytes",
               "state_bytes_per_slot", "state_bytes", "state_slots_running", "state_slots_snapshot", "max_context",
               "max_concurrency", "prefill_chunk")


def test_the_demo_plan_equals_the_startup_ledger_of_ninfer_run():
    demo = _demo()
    from ninfer import LLM

    info = LLM(demo, device="cpu", max_concurrency=1).engine.info()
    p = _core.plan(demo, device="cpu", max_concurrency=1)
    assert p["config_only"] is False
    assert {k: p[k] for k in LEDGER_KEYS} == {k: info[k] for k in LEDGER_KEYS}

    run = run_cli(["run", "--device", "cpu", "--prompt", "hi", "--raw", "--max-new", "1", "--greedy"])
    plan = run_cli(["plan", demo, "--device", "cpu"])
    assert run.returncode == 0, run.stderr
    assert plan.returncode == 0, plan.stderr + plan.stdout
    heads = ("weights ", "KV cache", "GDN state", "max context")

    def ledger_lines(text):
        return [line.strip() for line in text.splitlines() if line.strip().startswith(heads)]

    assert len(ledger_lines(plan.stdout)) == 4
    assert ledger_lines(plan.stdout) == ledger_lines(run.stderr)


def test_a_start_that_cannot_fit_fails_before_loading_with_the_bytes_and_what_fits():
    demo = _demo()
    with pytest.raises(_core.OutOfMemoryError) as e:
        _core.Engine(demo, device="cpu", kv_capacity=10**13)
    msg = str(e.value)
    assert "before loading" in msg and "needs" in msg and "available" in msg and "--max-context" in msg, msg
    proc = run_cli(["run", "--device", "cpu", "--prompt", "hi", "--kv-capacity", str(10**13)])
    assert proc.returncode == 1 and "before loading" in proc.stderr, proc.stderr


def test_the_server_refuses_the_same_start_before_loading():
    _demo()
    proc = run_cli(["serve", "--device", "cpu", "--port", "0", "--kv-capacity", str(10**13)], timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "before loading" in proc.stderr and "at most --kv-capacity" in proc.stderr, proc.stderr


def test_the_gpu_plan_refuses_what_the_cuda_loader_refuses(tmp_path):
    """Settings the CUDA loader would refuse are refused by `ninfer plan` for a GPU (exit 2,
    naming the tensor, the format and the reason), where the CPU plan of the same still fits:
    an FP8-block fused gate|up whose parts cut inside a 16-row scale block, a quantized K the
    kernels cannot decode 8 values at a time, an MTP head of two layers, a head_dim the
    attention kernels do not take."""
    from test_quantized_model import build_hf_quantized
    from tiny_models import make_model

    src = make_model(tmp_path / "src", "llama", seed=5, **{**CUDA_LLAMA, "intermediate_size": 136})
    qdir, _ = build_hf_quantized(src, tmp_path, "fp8")
    assert _core.plan(str(qdir), device="cpu")["weight_bytes"] > 0
    proc = run_cli(["plan", str(qdir), "--gpu-memory", "32GiB"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"gate_proj\.weight\|.*up_proj\.weight: HF_FP8_BLOCK parts cut at rows that are not multiples of 16",
                     proc.stderr), proc.stderr
    assert "fits" not in proc.stdout

    # down_proj's K = 17412 is not a multiple of 8 (config.json only: the shapes decide).
    odd = tmp_path / "odd_ffn"
    odd.mkdir()
    write_qwen35_27b_config(odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 17412
    (odd / "config.json").write_text(json.dumps(cfg))
    proc = run_cli(["plan", str(odd), "--gpu-memory", "32GB", "--quantize", "w8", "--max-context", "4096"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "model.layers.0.mlp.down_proj.weight" in proc.stderr and "W8G32_F16S" in proc.stderr and "K = 17412" in proc.stderr, proc.stderr
    assert run_cli(["plan", str(odd), "--gpu-memory", "80GB", "--max-context", "4096"]).returncode == 0

    two = tmp_path / "two_mtp"
    two.mkdir()
    write_qwen35_27b_config(two)
    cfg = json.loads((two / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 2
    (two / "config.json").write_text(json.dumps(cfg))
    proc = run_cli(["plan", str(two), "--gpu-memory", "32GB", "--quantize", "q4", "--max-context", "4096", "--spec", "mtp"])
    assert proc.returncode == 2 and "2 MTP layers" in proc.stderr, proc.stderr

    small = make_model(tmp_path / "small", "llama", seed=5)  # head_dim 12
    proc = run_cli(["plan", str(small), "--gpu-memory", "32GB"])
    assert proc.returncode == 2 and "head_dim 12" in proc.stderr and "CUDA" in proc.stderr, proc.stderr


def test_the_workspace_counts_cublaslt_and_the_verify_steps(tmp_path):
    """The workspace line holds cuBLASLt's 32 MiB where --quantize fp8 weights take the FP8
    tensor-core route, and under --spec the largest verify step's logits (and the device
    sampler's copy of them) and the MTP head's step buffers, by a hand count."""
    model = write_qwen35_27b_config(tmp_path)
    args = dict(gpu_memory=32 * 10**9, max_context=4096)
    ws = {q: _core.plan(model, quantize=q, **args)["workspace_bytes"] for q in ("w8", "fp8", "q4")}
    # Every format dequantizes into the same workspace (the largest fused projection).
    assert ws["w8"] == ws["q4"] and ws["fp8"] - ws["w8"] == 32 << 20
    fp8 = _core.plan(model, quantize="fp8", **args)
    assert fp8["workspace_cublaslt_bytes"] == 32 << 20 and _core.plan(model, quantize="q4", **args)["workspace_cublaslt_bytes"] == 0
    # The dequantization workspace: the largest fused projection, gate|up [2 x 17408, 5120], bf16.
    assert fp8["workspace_dequant_bytes"] == 2 * FFN * H * 2
    proc = run_cli(["plan", model, "--gpu-memory", "32GB", "--quantize", "fp8", "--max-context", "4096"])
    assert "dequantization 340.0 MiB, cuBLASLt 32.0 MiB" in proc.stdout, proc.stdout
    plain = _core.plan(model, quantize="q4", **args)
    ngram = _core.plan(model, quantize="q4", spec="ngram", **args)
    mtp = _core.plan(model, quantize="q4", spec="mtp", **args)
    # One sequence verifying up to 8 drafts: 9 rows, the sequence padded to 8 (72 rows, padded
    # to 128 rows of logits) instead of one decode row (padded to 8); f32 logits and the
    # sampler's copy over the vocabulary. The activations stay those of a 512-token step.
    verify = 2 * (128 - 8) * VOCAB * 4
    assert ngram["workspace_bytes"] - plain["workspace_bytes"] == verify
    # The MTP head keeps the hidden rows of a 512-row forward and gathers a 512-row step's
    # inputs (H) and halves (2H), bf16.
    assert mtp["workspace_bytes"] - plain["workspace_bytes"] == verify + (512 + 3 * 512) * H * 2


DEMO_DRAFTER_LEDGER = ("weight_bytes", "kv_bytes_per_token", "kv_capacity_tokens", "kv_bytes", "max_context")


def test_spec_dflash_counts_the_drafter_as_the_startup_ledger_does():
    """`ninfer plan --spec dflash --drafter DIR` counts the drafter's weights and its context
    bytes per token, as the engine's startup ledger does; a missing drafter is a bad flag."""
    demo = _demo()
    drafter = os.path.join(os.path.dirname(demo), "dflash")
    if not os.path.isdir(drafter):
        pytest.skip("no bundled demo drafter in this checkout")
    from ninfer import LLM

    plain = _core.plan(demo, device="cpu", max_concurrency=1)
    p = _core.plan(demo, device="cpu", max_concurrency=1, spec="dflash", drafter=drafter)
    with LLM(demo, device="cpu", max_concurrency=1, spec="dflash", drafter=drafter) as llm:
        info = llm.engine.info()
    assert {k: p[k] for k in DEMO_DRAFTER_LEDGER} == {k: info[k] for k in DEMO_DRAFTER_LEDGER}
    line = next(w for w in p["weights"] if w["format"] == "F32 DFlash drafter")
    assert p["weight_bytes"] - plain["weight_bytes"] == line["bytes"] > 0
    cfg = json.loads(open(os.path.join(drafter, "config.json")).read())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert p["kv_bytes_per_token"] - plain["kv_bytes_per_token"] == cfg["num_hidden_layers"] * 2 * heads * head_dim * 4

    proc = run_cli(["plan", demo, "--device", "cpu", "--spec", "dflash", "--drafter", drafter])
    assert proc.returncode == 0 and "F32 DFlash drafter" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli(["plan", demo, "--device", "cpu", "--spec", "dflash", "--drafter", os.path.join(drafter, "nope")])
    assert proc.returncode == 2 and "--drafter" in proc.stderr, proc.stderr
