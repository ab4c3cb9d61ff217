//! The planner's activation formulas (`src/plan.rs`) against what a forward pass under autodiff
//! really keeps for the backward pass, measured on Flex in f32: the bytes still allocated once the
//! loss exists, less those allocated before the forward pass. Each variant, MHA and GQA, the
//! explicit and the flash path, short and long sequences; the plan (`diffzoo recipe show --json`)
//! must be within 25% of the measurement.
//!
//! One test in its own binary: the allocator counts every thread's allocations, so nothing else
//! may run beside it.

use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use diffzoo_models::{AttentionImpl, AttentionKind, ModelConfig};
use serde_json::Value;
use std::alloc::{GlobalAlloc, Layout, System};
use std::process::Command;
use std::sync::atomic::{AtomicIsize, Ordering};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const D_MODEL: usize = 64;
const LAYERS: usize = 2;
const VOCAB: usize = 256;

#[test]
fn planned_activations_are_within_a_quarter_of_what_autodiff_keeps() {
    let mut failures = Vec::new();
    for attention in AttentionKind::ALL {
        for (heads, kv_heads) in [(4, 4), (8, 2)] {
            for (implementation, seq) in [("explicit", 128), ("explicit", 512), ("flash", 512)] {
                let planned = planned(attention, heads, kv_heads, implementation, seq);
                let measured = measured(attention, heads, kv_heads, implementation, seq);
                let ratio = planned / measured;
                let line = format!(
                    "{attention} H={heads} H_kv={kv_heads} {implementation} S={seq}: \
                     planned {:.2} MiB, measured {:.2} MiB, ratio {ratio:.3}",
                    planned / 1048576.0,
                    measured / 1048576.0
                );
                println!("{line}");
                if !(0.75..=1.25).contains(&ratio) {
                    failures.push(line);
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The plan's activations for one sequence, from `diffzoo recipe show --json`.
fn planned(
    attention: AttentionKind,
    heads: usize,
    kv_heads: usize,
    implementation: &str,
    seq: usize,
) -> f64 {
    let sets = [
        format!("model.attention=\"{attention}\""),
        format!("model.d_model={D_MODEL}"),
        format!("model.layers={LAYERS}"),
        format!("model.heads={heads}"),
        format!("model.kv_heads={kv_heads}"),
        format!("model.vocab_size={VOCAB}"),
        format!("model.attention_impl=\"{implementation}\""),
        "model.attention_block=64".into(),
        format!("data.seq_len={seq}"),
        format!("training.batch_tokens={seq}"),
        "training.micro_batch=1".into(),
        "training.dtype=\"f32\"".into(),
    ];
    let mut command = Command::new(env!("CARGO_BIN_EXE_diffzoo"));
    command.args(["recipe", "show", "micro", "--gpu", "80", "--json"]);
    for set in &sets {
        command.args(["--set", set]);
    }
    let output = command.output().expect("diffzoo runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let params = json["derived"]["params_total"]
        .as_u64()
        .expect("params_total");
    assert_eq!(
        params,
        config(attention, heads, kv_heads, implementation, seq)
            .param_count()
            .total,
        "the measured model is the planned one"
    );
    json["plan"]["memory"]["activations"]
        .as_f64()
        .expect("activations")
}

fn config(
    attention: AttentionKind,
    heads: usize,
    kv_heads: usize,
    implementation: &str,
    seq: usize,
) -> ModelConfig {
    let implementation = match implementation {
        "flash" => AttentionImpl::Flash { block: 64 },
        _ => AttentionImpl::Explicit,
    };
    ModelConfig::new(attention, D_MODEL, LAYERS, heads, VOCAB, seq)
        .with_kv_heads(Some(kv_heads))
        .with_attention_impl(implementation)
}

/// Bytes a forward pass and its loss leave allocated for the backward pass, on Flex in f32.
fn measured(
    attention: AttentionKind,
    heads: usize,
    kv_heads: usize,
    implementation: &str,
    seq: usize,
) -> f64 {
    let device = Device::flex().autodiff();
    let model = config(attention, heads, kv_heads, implementation, seq).init(&device);
    let ids: Vec<i64> = (0..seq as i64)
        .map(|i| (i * 37 + 11) % VOCAB as i64)
        .collect();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [1, seq]), &device);
    let targets = Tensor::<1, Int>::from_data(TensorData::new(ids, [seq]), &device);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    // A first pass allocates what stays (caches, the rotary tables' first use).
    let warm = loss_fn.forward(
        model.forward(input.clone()).reshape([seq, VOCAB]),
        targets.clone(),
    );
    drop(warm.backward());
    let before = LIVE.load(Ordering::SeqCst);
    let loss = loss_fn.forward(model.forward(input).reshape([seq, VOCAB]), targets);
    let kept = LIVE.load(Ordering::SeqCst) - before;
    drop(loss);
    kept as f64
}
