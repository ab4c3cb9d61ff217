//! The flash attention path (O(S) memory, its own backward) against the explicit path: logits, the
//! loss and the gradient of every parameter (q, k, v and o projections, λ vectors, W_λ, subln,
//! norms, embeddings) for the three variants under MHA and GQA, at sequence lengths that are and
//! are not multiples of the block, on every backend compiled in; the operation alone at edge
//! lengths and blocks, and with bf16 inputs. `golden.rs` checks the same path against the PyTorch
//! reference.

mod common;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Device, Distribution, Gradients, Tensor};
use common::{assert_close, backends, param_grads, tokens, tolerance, whole_grid};
use diffzoo_models::attention::flash::flash_causal_attention;
use diffzoo_models::{AttentionImpl, AttentionKind, Model, ModelConfig};

/// (sequence length, block): a multiple, two remainders, a single partial block. A backend that
/// does not run the whole grid runs GQA at (13, 6).
const LENGTHS: [(usize, usize); 4] = [(12, 4), (12, 5), (13, 6), (7, 16)];

/// (H, H_kv) of the baseline: MHA and GQA (DIFF V1 then has 4 heads reading 1 kv head).
const SHAPES: [(usize, usize); 2] = [(4, 4), (8, 2)];

#[test]
fn flash_matches_the_explicit_path_in_outputs_and_every_gradient() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        for attention in AttentionKind::ALL {
            let shapes = SHAPES
                .into_iter()
                .filter(|&shape| whole_grid(backend) || shape == (8, 2));
            for (heads, kv_heads) in shapes {
                let lengths = LENGTHS
                    .into_iter()
                    .filter(|&point| whole_grid(backend) || point == (13, 6));
                for (seq, block) in lengths {
                    let what = format!("{backend}: {attention} H={heads} H_kv={kv_heads} S={seq}");
                    compare(&what, &device, attention, heads, kv_heads, seq, block);
                }
            }
        }
    }
}

fn compare(
    what: &str,
    device: &Device,
    attention: AttentionKind,
    heads: usize,
    kv_heads: usize,
    seq: usize,
    block: usize,
) {
    let atol = tolerance(what.split(':').next().unwrap_or_default());
    let config = ModelConfig::new(attention, 32, 2, heads, 37, 16).with_kv_heads(Some(kv_heads));
    device.seed(5);
    let explicit = config.clone().init(device);
    // The same weights, computed by blocks.
    let flash = explicit
        .clone()
        .with_attention_impl(AttentionImpl::Flash { block });
    let input = tokens(2, seq, 37, 1, device);
    let targets = tokens(2, seq, 37, 2, device);
    let run = |model: &Model| {
        let logits = model.forward(input.clone());
        let [b, s, v] = logits.dims();
        let loss = CrossEntropyLossConfig::new().init(device).forward(
            logits.clone().reshape([b * s, v]),
            targets.clone().reshape([b * s]),
        );
        let grads = loss.backward();
        (logits, collect(model, &grads))
    };
    let (expected_logits, expected) = run(&explicit);
    let (logits, grads) = run(&flash);
    assert_close(
        &format!("{what} logits"),
        logits,
        expected_logits,
        atol,
        1e-5,
    );
    assert_eq!(
        grads.len(),
        expected.len(),
        "{what}: parameters with gradients"
    );
    for ((name, grad), (expected_name, expected)) in grads.into_iter().zip(expected) {
        assert_eq!(name, expected_name);
        assert_close(&format!("{what} grad {name}"), grad, expected, atol, 1e-5);
    }
}

/// Every parameter's gradient, flattened, by path.
fn collect(model: &Model, grads: &Gradients) -> Vec<(String, Tensor<1>)> {
    param_grads(model, grads)
        .into_iter()
        .map(|(name, grad)| {
            let grad = grad.unwrap_or_else(|| panic!("no gradient reaches {name}"));
            (name, grad)
        })
        .collect()
}

/// `softmax(q·kᵀ/√d + causal mask)·v`, written out.
fn reference(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let [_, _, s, d] = q.dims();
    let logits = q.matmul(k.swap_dims(2, 3)).div_scalar((d as f64).sqrt());
    let future = Tensor::<2, Bool>::tril_mask([s, s], 0, &logits.device()).unsqueeze::<4>();
    softmax(logits.mask_fill(future, f32::NEG_INFINITY), 3).matmul(v)
}

/// Normal(0, 1) values. The device's generator is shared by the tests running in parallel, so a
/// seed does not reproduce a tensor: a test draws its inputs once and differentiates copies.
fn random(shape: [usize; 4], seed: u64, device: &Device) -> Tensor<4> {
    device.seed(seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// A new leaf of the graph holding `x`'s values, with gradients of its own.
fn leaf(x: &Tensor<4>) -> Tensor<4> {
    x.clone().detach().require_grad()
}

#[test]
fn the_operation_matches_attention_at_edge_lengths_and_blocks() {
    let device = Device::flex().autodiff();
    // (S, block): one position, one-position blocks, a block longer than the sequence.
    for (seq, block) in [(1, 4), (6, 1), (5, 8), (11, 3)] {
        let what = format!("S={seq} block={block}");
        let inputs = [(2, 8), (3, 8), (4, 16)]
            .map(|(seed, width)| random([2, 3, seq, width], seed, &device));
        let [q, k, v] = inputs.each_ref().map(leaf);
        let expected = reference(q.clone(), k.clone(), v.clone());
        let weights = random([2, 3, seq, 16], 5, &device);
        let grads = (expected.clone() * weights.clone()).sum().backward();
        let [fq, fk, fv] = inputs.each_ref().map(leaf);
        let out = flash_causal_attention(fq.clone(), fk.clone(), fv.clone(), block);
        assert_close(&format!("{what} out"), out.clone(), expected, 1e-5, 1e-5);
        let flash_grads = (out * weights).sum().backward();
        for (name, a, b) in [("q", &fq, &q), ("k", &fk, &k), ("v", &fv, &v)] {
            let got = a.grad(&flash_grads).expect("gradient reaches the input");
            let want = b.grad(&grads).expect("gradient reaches the input");
            assert_close(&format!("{what} d{name}"), got, want, 1e-5, 1e-5);
        }
    }
}

#[test]
fn half_precision_inputs_are_computed_in_f32() {
    let device = Device::flex().autodiff();
    let inputs = [2, 3, 4].map(|seed| random([1, 2, 40, 8], seed, &device));
    let [q, k, v] = inputs.each_ref().map(leaf);
    let weights = random([1, 2, 40, 8], 5, &device);
    let expected = reference(q.clone(), k.clone(), v.clone());
    let grads = (expected.clone() * weights.clone()).sum().backward();
    let [hq, hk, hv] = inputs.each_ref().map(leaf);
    let bf16 = |x: &Tensor<4>| x.clone().cast(DType::BF16);
    let out = flash_causal_attention(bf16(&hq), bf16(&hk), bf16(&hv), 8);
    assert_eq!(out.dtype(), DType::BF16);
    // Only the inputs', the output's and the gradients' bf16 rounding (8 bits of mantissa) remain.
    let out = out.cast(DType::F32);
    assert_close("bf16 flash", out.clone(), expected, 3e-2, 2e-2);
    let half_grads = (out * weights).sum().backward();
    for (name, a, b) in [("q", &hq, &q), ("k", &hk, &k), ("v", &hv, &v)] {
        let got = a.grad(&half_grads).expect("gradient reaches the input");
        let want = b.grad(&grads).expect("gradient reaches the input");
        assert_close(&format!("bf16 d{name}"), got, want, 5e-2, 3e-2);
    }
}
