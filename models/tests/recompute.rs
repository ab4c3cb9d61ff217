//! Per-block recomputation (`Model::backward_recomputed`) against one ordinary backward pass:
//! the loss and the gradient of every parameter, summed over the partial backward passes, for
//! the three variants, MHA and GQA, tied and untied embeddings, explicit and flash attention, on
//! every backend compiled in.

mod common;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{DType, Device, FloatDType, Int, Tensor};
use common::{
    assert_bf16_gradients, assert_close, backends, param_grads, tokens, tolerance, whole_grid,
};
use diffzoo_models::{AttentionImpl, AttentionKind, Model, ModelConfig};

/// (H, H_kv, tied embeddings, attention). A backend that does not run the whole grid runs the
/// tied GQA flash point.
const CASES: [(usize, usize, bool, AttentionImpl); 4] = [
    (4, 4, false, AttentionImpl::Explicit),
    (4, 4, true, AttentionImpl::Flash { block: 5 }),
    (8, 2, true, AttentionImpl::Flash { block: 5 }),
    (8, 2, false, AttentionImpl::Explicit),
];

const LAYERS: usize = 3;

#[test]
fn recomputed_blocks_give_the_gradients_of_one_backward_pass() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        for attention in AttentionKind::ALL {
            let cases = CASES
                .into_iter()
                .filter(|case| whole_grid(backend) || (case.1 == 2 && case.2));
            for (heads, kv_heads, tied, implementation) in cases {
                let what = format!(
                    "{backend}: {attention} H={heads} H_kv={kv_heads} tied={tied} {implementation:?}"
                );
                let config = ModelConfig::new(attention, 32, LAYERS, heads, 37, 16)
                    .with_kv_heads(Some(kv_heads))
                    .with_tie_embeddings(tied)
                    .with_attention_impl(implementation);
                let atol = tolerance(backend);
                compare(&what, &config, &device, None, Check::Close(atol, 1e-5));
            }
        }
    }
}

/// Each partial pass casts the weights it reads (a tied embedding's twice: the head's and the
/// embedding's pass); the masters' gradients, summed in f32, are the f32 pass's within bf16's
/// error, as one mixed backward pass's are (`tests/precision.rs`). (Not closer to one mixed
/// pass than that: bf16 rounds sums taken in another order differently, by as much.)
#[test]
fn recomputed_blocks_under_mixed_precision_give_the_gradients_of_one_mixed_pass() {
    for (backend, device) in backends() {
        if !device.supports_dtype(FloatDType::BF16) {
            continue;
        }
        let device = device.autodiff();
        for attention in AttentionKind::ALL {
            for (heads, kv_heads, tied, implementation) in [CASES[0], CASES[2]] {
                let what = format!(
                    "{backend} bf16-mixed: {attention} H={heads} H_kv={kv_heads} tied={tied} {implementation:?}"
                );
                let config = ModelConfig::new(attention, 32, LAYERS, heads, 37, 16)
                    .with_kv_heads(Some(kv_heads))
                    .with_tie_embeddings(tied)
                    .with_attention_impl(implementation);
                compare(&what, &config, &device, Some(FloatDType::BF16), Check::Bf16);
            }
        }
    }
}

/// How recomputed values are held to those of one backward pass in f32.
#[derive(Clone, Copy)]
enum Check {
    /// Element-wise, `|a − b| ≤ atol + rtol·|b|`.
    Close(f32, f32),
    /// Within bf16's error ([`common::assert_bf16_gradients`]).
    Bf16,
}

fn compare(
    what: &str,
    config: &ModelConfig,
    device: &Device,
    compute: Option<FloatDType>,
    check: Check,
) {
    device.seed(7);
    let model = config.init(device);
    let input = tokens(2, 13, 37, 1, device);
    let targets = tokens(2, 13, 37, 2, device);

    let expected_loss = loss(model.forward(input.clone()), &targets, device);
    let grads = expected_loss.backward();
    let expected = param_grads(&model, &grads);

    let mut sums: Vec<Option<Tensor<1>>> = vec![None; expected.len()];
    let mut calls = 0;
    let recomputed_loss = model.backward_recomputed(
        input,
        compute,
        |logits| {
            let expected = compute.map_or(DType::F32, DType::from);
            assert_eq!(
                logits.dtype(),
                expected,
                "{what}: the head computes in its dtype"
            );
            loss(logits, &targets, device)
        },
        |grads| {
            calls += 1;
            for (sum, (_, grad)) in sums.iter_mut().zip(param_grads(&model, &grads)) {
                if let Some(grad) = grad {
                    assert_eq!(grad.dtype(), DType::F32, "{what}: a master's gradient");
                    *sum = Some(match sum.take() {
                        Some(sum) => sum + grad,
                        None => grad,
                    });
                }
            }
        },
    );
    assert_eq!(calls, LAYERS + 2, "{what}: head, each block, embedding");
    let expected_loss = expected_loss.into_scalar::<f32>();
    let loss_error = (recomputed_loss.into_scalar::<f32>() - expected_loss).abs();
    let grads = sums
        .into_iter()
        .zip(expected)
        .map(|(sum, (name, expected))| {
            let expected = expected.unwrap_or_else(|| panic!("{what}: no gradient reaches {name}"));
            let sum = sum.unwrap_or_else(|| panic!("{what}: recomputation gives {name} none"));
            (name, sum, expected)
        });
    match check {
        Check::Close(atol, rtol) => {
            let bound = atol + rtol * expected_loss.abs();
            assert!(
                loss_error <= bound,
                "{what}: the loss differs by {loss_error}"
            );
            for (name, sum, expected) in grads {
                assert_close(&format!("{what} grad {name}"), sum, expected, atol, rtol);
            }
        }
        Check::Bf16 => {
            assert!(
                loss_error <= 1e-2,
                "{what}: the loss differs by {loss_error}"
            );
            assert_bf16_gradients(what, grads.collect());
        }
    }
}

fn loss(logits: Tensor<3>, targets: &Tensor<2, Int>, device: &Device) -> Tensor<1> {
    let logits = logits.cast(DType::F32);
    let [b, s, v] = logits.dims();
    CrossEntropyLossConfig::new()
        .init(device)
        .forward(logits.reshape([b * s, v]), targets.clone().reshape([b * s]))
}

/// A model on a device without autodiff cannot be differentiated: refused by name.
#[test]
#[should_panic(expected = "needs a model on an autodiff device")]
fn recomputation_needs_autodiff() {
    let (_, device) = backends().remove(0);
    let model: Model = ModelConfig::new(AttentionKind::Diff, 32, 1, 4, 37, 16).init(&device);
    let input = tokens(1, 4, 37, 1, &device);
    model.backward_recomputed(input, None, |logits| logits.sum(), |_| {});
}
