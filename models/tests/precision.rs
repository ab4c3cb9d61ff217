//! Mixed precision's compute copy (`diffzoo_models::precision`): a forward pass in bf16 whose
//! gradients reach the f32 masters, in f32, close to those of the f32 pass; on every backend
//! with bf16.

mod common;

use burn::tensor::{DType, FloatDType};
use common::{assert_bf16_gradients, backends, param_grads, tokens};
use diffzoo_models::{AttentionKind, Model, ModelConfig, compute_copy};

/// The bf16 pass's gradients within bf16's error of the f32 pass's
/// ([`common::assert_bf16_gradients`]).
#[test]
fn a_bf16_compute_copy_gives_every_f32_master_its_gradient() {
    for (backend, device) in backends() {
        if !device.supports_dtype(FloatDType::BF16) {
            continue;
        }
        let device = device.autodiff();
        for attention in AttentionKind::ALL {
            for tied in [false, true] {
                let what = format!("{backend}: {attention} tied={tied}");
                device.seed(11);
                let model: Model = ModelConfig::new(attention, 32, 2, 4, 37, 16)
                    .with_tie_embeddings(tied)
                    .init(&device);
                let input = tokens(2, 12, 37, 3, &device);
                let pass = |model: &Model| {
                    let logits = model.forward(input.clone());
                    let dtype = logits.dtype();
                    (logits.cast(DType::F32).square().mean().backward(), dtype)
                };
                let (full, full_dtype) = pass(&model);
                let (mixed, mixed_dtype) = pass(&compute_copy(&model, Some(FloatDType::BF16)));
                assert_eq!(full_dtype, DType::F32, "{what}");
                assert_eq!(
                    mixed_dtype,
                    DType::BF16,
                    "{what}: the pass computes in bf16"
                );
                let grads = param_grads(&model, &full)
                    .into_iter()
                    .zip(param_grads(&model, &mixed))
                    .map(|((name, full), (_, mixed))| {
                        let full = full.unwrap_or_else(|| panic!("{what}: {name} has no gradient"));
                        let mixed = mixed.unwrap_or_else(|| {
                            panic!("{what}: {name} has no gradient through the copy")
                        });
                        (name, mixed, full)
                    })
                    .collect();
                assert_bf16_gradients(&what, grads);
                assert!(
                    model
                        .blocks
                        .iter()
                        .all(|b| b.ffn_norm.gamma.val().dtype() == DType::F32),
                    "{what}: the masters stay f32"
                );
            }
        }
    }
}

#[test]
fn full_precision_is_the_model_itself() {
    let (_, device) = backends().remove(0);
    let model: Model = ModelConfig::new(AttentionKind::Diff, 32, 1, 4, 37, 16).init(&device);
    let copy = compute_copy(&model, None);
    let input = tokens(1, 6, 37, 1, &device);
    let (a, b) = (model.forward(input.clone()), copy.forward(input));
    assert_eq!(a.into_data(), b.into_data());
}
