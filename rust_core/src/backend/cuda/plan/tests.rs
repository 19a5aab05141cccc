//! The plan's default table against the routes the code selected before routing became data
//! (routes_before.txt), and the device profile's parsing and checks.

use std::path::Path;

use super::*;
use crate::backend::cuda::ops::{
    decode_attention_launch, default_layout_arg, flash_tile_for, gemv_launch_spec, gemv_kernel, qkv_rope_fits, qkv_rope_launch, GemvOut, PagedAttentionShape,
    GEMV_ROUTE_MAX_M,
};

/// The compute capabilities of the default table, with an SM count and opt-in shared memory a
/// block of a part of each (the figures only have to be the same before and after).
const ARCHES: [((u32, u32), usize, usize); 7] = [
    ((7, 0), 80, 98304),
    ((7, 5), 40, 65536),
    ((8, 0), 108, 166912),
    ((8, 6), 84, 101376),
    ((8, 9), 128, 101376),
    ((9, 0), 132, 232448),
    ((12, 0), 170, 101376),
];

fn facts(cc: (u32, u32), sm_count: usize, smem_optin: usize, nvrtc_major: i32) -> DeviceFacts {
    DeviceFacts { name: format!("sm_{}{}", cc.0, cc.1), compute_capability: cc, sm_count, smem_optin, nvrtc_major }
}

/// A model the benchmarks run (benches/gpu_bench.py): hidden size, its decode GEMVs (label,
/// epilogue, output columns, K) and its attention (q heads, kv heads, head size).
struct BenchModel {
    name: &'static str,
    hidden: usize,
    gemvs: Vec<(&'static str, GemvOut, usize, usize)>,
    attention: (usize, usize, usize),
}

fn bench_models() -> Vec<BenchModel> {
    use GemvOut::{SwiGlu, Store, F32};
    vec![
        BenchModel {
            name: "llama-3-8b",
            hidden: 4096,
            gemvs: vec![("qkv", Store, 6144, 4096), ("o", Store, 4096, 4096), ("gate_up", Store, 28672, 4096), ("gate_up_swiglu", SwiGlu, 14336, 4096), ("down", Store, 4096, 14336), ("lm_head", F32(true), 128256, 4096)],
            attention: (32, 8, 128),
        },
        BenchModel {
            name: "qwen2-7b",
            hidden: 3584,
            gemvs: vec![("qkv_bias", F32(false), 4608, 3584), ("o", Store, 3584, 3584), ("gate_up", Store, 37888, 3584), ("gate_up_swiglu", SwiGlu, 18944, 3584), ("down", Store, 3584, 18944), ("lm_head", F32(true), 152064, 3584)],
            attention: (28, 4, 128),
        },
        BenchModel {
            name: "qwen3_5-27b",
            hidden: 5120,
            gemvs: vec![
                ("attn_qkv_gate", Store, 14336, 5120),
                ("attn_o", Store, 5120, 6144),
                ("gdn_in_proj", Store, 16480, 5120),
                ("gdn_out", Store, 5120, 6144),
                ("gate_up", Store, 34816, 5120),
                ("gate_up_swiglu", SwiGlu, 17408, 5120),
                ("down", Store, 5120, 17408),
                ("lm_head", F32(true), 248320, 5120),
            ],
            attention: (24, 4, 256),
        },
    ]
}

fn join(v: &[i32]) -> String {
    v.iter().map(i32::to_string).collect::<Vec<_>>().join(",")
}

/// Every route of the benchmark shapes under the default plans, one line a launch, in the
/// format of routes_before.txt.
fn route_lines() -> Vec<String> {
    let mut lines = Vec::new();
    for (cc, sms, optin) in ARCHES {
        let arch = format!("sm_{}{}", cc.0, cc.1);
        for invariant in [false, true] {
            let options = CudaOptions { batch_invariant: invariant, ..CudaOptions::default() };
            let inv = invariant as u8;
            for m in bench_models() {
                let plan = Plan::build(&facts(cc, sms, optin, 12), ModelShape { hidden_size: Some(m.hidden) }, &options).unwrap();
                let pdl = plan.pdl as u8;
                for (label, out, n, k) in &m.gemvs {
                    for rows in 1..=64usize {
                        let head = format!("ROUTE gemv {arch} inv={inv} {} {label} m={rows}:", m.name);
                        if rows > GEMV_ROUTE_MAX_M {
                            lines.push(format!("{head} cublas"));
                            continue;
                        }
                        let l = gemv_launch_spec(&plan, plan.gemv_form, *out, rows, *n, *k).unwrap();
                        lines.push(format!("{head} {} grid={} block={} args=[{}] pdl={pdl}", l.name, l.grid, l.block, join(l.ints())));
                    }
                }
                let (_, n, k) = (m.gemvs[0].0, m.gemvs[0].2, m.gemvs[0].3);
                let fits = qkv_rope_fits(gemv_kernel(plan.gemv_form, &plan.gemv_rules, n, k, 1), 1, 128, 128, k) as u8;
                let (grid, block, ints) = qkv_rope_launch(&plan, n, k).unwrap();
                lines.push(format!("ROUTE qkv_rope {arch} inv={inv} {}: fits={fits} grid={grid} block={block} args=[{}] pdl={pdl}", m.name, join(&ints)));
                let (hq, hkv, d) = m.attention;
                for max_blocks in [64usize, 256] {
                    let sh = PagedAttentionShape { n_q_heads: hq, n_kv_heads: hkv, head_dim: d, q_stride: hq * d, block_size: 16, num_blocks: max_blocks, max_blocks_per_seq: max_blocks, scale: 1.0, max_context: 0, partition: 0 };
                    for t in 1..=64usize {
                        let form = plan.decode_attention.form(t, &sh);
                        let l = decode_attention_launch(cc, form, default_layout_arg(form, t, &sh, sms), &sh, t).unwrap();
                        let layout = l.layout_arg.map_or("-".to_string(), |a| a.to_string());
                        lines.push(format!(
                            "ROUTE decode_attn {arch} inv={inv} {} ctx={} t={t}: {form:?} {} grid=({},{}) block={} smem={} layout={layout} pdl={pdl}",
                            m.name,
                            max_blocks * 16,
                            l.name,
                            l.grid.0,
                            l.grid.1,
                            l.block,
                            l.smem
                        ));
                    }
                }
            }
        }
        for nvrtc in [12, 13] {
            let plan = Plan::build(&facts(cc, sms, optin, nvrtc), ModelShape::default(), &CudaOptions::default()).unwrap();
            for d in [64, 96, 128, 256] {
                lines.push(format!("ROUTE prefill_attn {arch} nvrtc={nvrtc} d={d}: flash={} {:?}", (cc.0 >= 8) as u8, flash_tile_for(&plan, d)));
            }
        }
    }
    lines.sort();
    lines
}

fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The must-show of routing as data: for every benchmark shape at batch 1..64, on every compute
/// capability of the table, with and without batch invariance, the plan selects the kernel, the
/// grid, the block, the shared memory and the scalar arguments the code before it selected.
#[test]
fn the_default_plan_selects_every_route_the_code_before_it_selected() {
    let before = include_str!("routes_before.txt");
    let lines = route_lines();
    let mut groups: std::collections::BTreeMap<String, Vec<&str>> = Default::default();
    for l in &lines {
        let key = l.split(' ').skip(1).take(3).collect::<Vec<_>>().join(" ").trim_end_matches(':').to_string();
        groups.entry(key).or_default().push(l);
    }
    let mut want_groups = 0;
    for line in before.lines().filter(|l| l.starts_with("group ")) {
        want_groups += 1;
        let (key, rest) = line["group ".len()..].split_once(" lines=").unwrap();
        let (count, hash) = rest.split_once(" fnv=").unwrap();
        let got = groups.get(key).unwrap_or_else(|| panic!("no routes for {key}"));
        let text = got.join("\n");
        assert_eq!((got.len().to_string(), format!("{:016x}", fnv1a(&text))), (count.to_string(), hash.to_string()), "{key}: the routes differ from before:\n{text}");
    }
    assert_eq!(groups.len(), want_groups, "groups before and now");
    // The sm_90 routes in full, readable.
    for want in before.lines().filter_map(|l| l.strip_prefix("= ")) {
        assert!(lines.iter().any(|l| l.strip_prefix("ROUTE ") == Some(want)), "missing: {want}");
    }
}

/// The defaults per compute capability, as named fields.
#[test]
fn the_default_table_per_compute_capability() {
    use crate::backend::cuda::ops::{GemvForm, PrepForm};
    for (cc, sms, optin) in ARCHES {
        let p = Plan::build(&facts(cc, sms, optin, 13), ModelShape { hidden_size: Some(4096) }, &CudaOptions::default()).unwrap();
        let sm80 = cc.0 >= 8;
        assert_eq!(p.gemv_form, if sm80 { GemvForm::ByShape } else { GemvForm::Simt }, "{cc:?}");
        assert_eq!((p.pdl, p.decode_attention.tensor_cores, p.gdn_prep == PrepForm::TensorCores), (cc.0 >= 9, sm80, sm80), "{cc:?}");
        assert_eq!(p.prefill_warp_specialized, cc == (9, 0), "{cc:?}");
        assert_eq!((p.cc_ksplit, p.cc_warps, p.cc_prefetch_vectors, p.tc_prefetch_steps), (2, 4, 0, 16));
        assert!(p.fused_rope && p.cuda_graphs && p.device_sampling && !p.batch_invariant && p.smem_carveout.is_none());
        assert_eq!(p.q4_ring, None, "the tiled 4-bit GEMV's form follows each model's K");
    }
    // The K split by hidden size: 2 up to the 8B's, unsplit from the 27B's and without a model.
    let f = facts((9, 0), 132, 232448, 13);
    let split = |h| Plan::build(&f, ModelShape { hidden_size: h }, &CudaOptions::default()).unwrap();
    assert_eq!([Some(3584), Some(4096), Some(5120), None].map(|h| (split(h).cc_ksplit, split(h).cc_warps)), [(2, 4), (2, 4), (1, 8), (1, 8)]);
    // Batch invariance: one tensor-core instance a shape, every decode attention in the scaled form.
    let inv = Plan::build(&f, ModelShape::default(), &CudaOptions { batch_invariant: true, ..Default::default() }).unwrap();
    assert_eq!((inv.gemv_form, inv.decode_attention.batch_invariant), (GemvForm::TensorCores, true));
    let nvrtc12 = Plan::build(&facts((9, 0), 132, 232448, 12), ModelShape::default(), &CudaOptions::default()).unwrap();
    assert!(!nvrtc12.prefill_warp_specialized, "the warp-specialized form is NVRTC 13's build");
}

fn profile(path: &str, text: &str, cc: (u32, u32)) -> Result<Plan> {
    let mut plan = default_plan(&facts(cc, 132, 232448, 13), ModelShape { hidden_size: Some(4096) }, &CudaOptions::default());
    let path = Path::new(path);
    DeviceProfile::parse(path, text)?.apply(path, &mut plan)?;
    Ok(plan)
}

#[test]
fn a_profile_overrides_the_fields_it_names_and_keeps_the_rest() {
    let text = r#"{"version": 1, "device": "sm_90", "compute_capability": "9.0",
        "plan": {"cc_ksplit": 1, "cc_warps": 8, "tc_prefetch_steps": 32, "smem_carveout": 50, "pdl": false, "q4_ring": true,
                 "gemv_rules": [{"max_rows": 8192, "kernel": "w16u4h"}, {"kernel": "W8U8H", "cuda_cores_at_batch_1": true}]}}"#;
    let p = profile("h200.json", text, (9, 0)).unwrap();
    assert_eq!((p.cc_ksplit, p.cc_warps, p.tc_prefetch_steps, p.smem_carveout, p.pdl), (1, 8, 32, Some(50), false));
    assert_eq!(p.q4_ring, Some(true));
    assert_eq!(p.gemv_rules.len(), 2);
    assert_eq!((p.gemv_rules[0].max_rows, p.gemv_rules[0].config.label(), p.gemv_rules[0].cuda_cores), (8192, "w16u4h".to_string(), false));
    assert_eq!((p.gemv_rules[1].max_rows, p.gemv_rules[1].config.label(), p.gemv_rules[1].cuda_cores), (usize::MAX, "w8u8h".to_string(), true));
    assert!(p.fused_rope && p.decode_attention.tensor_cores, "fields the profile leaves keep the default");
    let pass = r#"{"version": 1, "device": "sm_90", "compute_capability": "9.0", "plan": {"q4_ring": false}}"#;
    assert_eq!(profile("h100.json", pass, (9, 0)).unwrap().q4_ring, Some(false));
    let empty = profile("h200.json", r#"{"version": 1, "device": "sm_90", "compute_capability": "9.0"}"#, (9, 0)).unwrap();
    assert_eq!(empty, default_plan(&facts((9, 0), 132, 232448, 13), ModelShape { hidden_size: Some(4096) }, &CudaOptions::default()));
}

#[test]
fn a_bad_profile_is_an_error_naming_the_file_and_the_field() {
    let head = r#""version": 1, "device": "sm_90", "compute_capability": "9.0""#;
    for (text, cc, field) in [
        (r#"{"version": 2, "device": "sm_90", "compute_capability": "9.0"}"#.to_string(), (9, 0), "version"),
        (r#"{"version": 1, "device": "sm_90", "compute_capability": "8.0"}"#.to_string(), (9, 0), "compute_capability"),
        (r#"{"version": 1, "device": "NVIDIA A100", "compute_capability": "9.0"}"#.to_string(), (9, 0), "device"),
        (format!(r#"{{{head}, "plan": {{"cc_ksplit": 3}}}}"#), (9, 0), "plan.cc_ksplit"),
        (format!(r#"{{{head}, "plan": {{"cc_ksplit": 8, "cc_warps": 4}}}}"#), (9, 0), "plan.cc_ksplit"),
        (format!(r#"{{{head}, "plan": {{"cc_warps": 16}}}}"#), (9, 0), "plan.cc_warps"),
        (format!(r#"{{{head}, "plan": {{"tc_prefetch_steps": 513}}}}"#), (9, 0), "plan.tc_prefetch_steps"),
        (format!(r#"{{{head}, "plan": {{"smem_carveout": 101}}}}"#), (9, 0), "plan.smem_carveout"),
        (format!(r#"{{{head}, "plan": {{"gemv_rules": [{{"kernel": "w32u4"}}]}}}}"#), (9, 0), "plan.gemv_rules[0].kernel"),
        (format!(r#"{{{head}, "plan": {{"cc_split": 2}}}}"#), (9, 0), "cc_split"),
        (format!(r#"{{{head}, "plan": {{"cc_ksplit": "two"}}}}"#), (9, 0), "line 1"),
    ] {
        let e = profile("/tmp/dev.json", &text, cc).unwrap_err().to_string();
        assert!(e.contains("/tmp/dev.json") && e.contains(field), "{field}: {e}");
    }
    // Routes the device lacks are refused, naming it.
    let sm86 = r#"{"version": 1, "device": "sm_86", "compute_capability": "8.6", "plan": {"pdl": true}}"#;
    let e = profile("p.json", sm86, (8, 6)).unwrap_err().to_string();
    assert!(e.contains("plan.pdl") && e.contains("8.6"), "{e}");
    let sm75 = r#"{"version": 1, "device": "sm_75", "compute_capability": "7.5", "plan": {"gemv_rules": []}}"#;
    assert!(profile("p.json", sm75, (7, 5)).unwrap_err().to_string().contains("plan.gemv_rules"));
    let sm75 = r#"{"version": 1, "device": "sm_75", "compute_capability": "7.5", "plan": {"q4_ring": false}}"#;
    let e = profile("p.json", sm75, (7, 5)).unwrap_err().to_string();
    assert!(e.contains("plan.q4_ring") && e.contains("7.5"), "{e}");
    let e = Plan::build(&facts((9, 0), 132, 232448, 13), ModelShape::default(), &CudaOptions { profile: Some("/nonexistent/p.json".into()), ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("/nonexistent/p.json") && e.contains("cannot be read"), "{e}");
}

#[test]
fn the_gdn_scan_form_is_the_plans_per_key_head_size_as_the_shared_memory_allows() {
    use crate::backend::cuda::ops::ScanForm::{Simt, TensorCores, Wide};
    // The eight-warp scan needs 71,680 B (dk 64) / 112,640 B (dk 128) of shared memory: sm_80
    // and sm_90 take it for both, the 99 KiB parts at dk 64 only (dk 128 falls to the plain
    // tensor-core scan: the pipelined one needs 114,688 B), and below sm_80 the scan runs on
    // CUDA cores.
    let want = [Simt, Simt, Wide, Wide, Wide, Wide, Wide];
    let want128 = [Simt, Simt, Wide, TensorCores, TensorCores, Wide, TensorCores];
    for (i, (cc, sms, smem)) in ARCHES.into_iter().enumerate() {
        let plan = default_plan(&facts(cc, sms, smem, 13), ModelShape::default(), &CudaOptions::default());
        assert_eq!((plan.gdn_scan.for_dk(64), plan.gdn_scan.for_dk(128)), (want[i], want128[i]), "sm_{}{}", cc.0, cc.1);
    }
}
