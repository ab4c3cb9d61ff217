//! Mixed precision's compute copy (`diffzoo_models::precision`): a forward pass in bf16 whose
//! gradients reach the f32 masters, in f32, close to those of the f32 pass; and inference
//! weights kept in bf16 (`Model::with_weight_dtype`), computing as the f32 model whose matrices
//! were rounded to bf16; on every backend with bf16.

mod common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{DType, FloatDType, Tensor};
use common::{assert_bf16_gradients, assert_close, backends, param_grads, tokens};
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

/// A model whose weight matrices are kept in bf16 holds them (every 2-D parameter) in bf16 and
/// the rest (norms, λ) in f32, and computes in f32 the logits of the f32 model whose matrices
/// were rounded to bf16: over a whole sequence (the plain product, the flash path), in cached
/// decoding (the few-row kernel, the decoding attention) and in the analysis pass.
#[test]
fn bf16_weight_matrices_compute_as_their_f32_widening() {
    for (backend, device) in backends() {
        if !device.supports_dtype(FloatDType::BF16) {
            continue;
        }
        for attention in AttentionKind::ALL {
            for tied in [false, true] {
                let what = format!("{backend}: {attention} tied={tied}");
                device.seed(5);
                let model: Model = ModelConfig::new(attention, 32, 2, 4, 37, 32)
                    .with_tie_embeddings(tied)
                    .init(&device);
                let bf16 = model.with_weight_dtype(FloatDType::BF16);
                let rounded = bf16.clone().with_weight_dtype(FloatDType::F32);
                let mut dtypes = Dtypes(Vec::new());
                bf16.visit(&mut dtypes);
                for (rank, dtype) in dtypes.0 {
                    let want = if rank == 2 { DType::BF16 } else { DType::F32 };
                    assert_eq!(dtype, want, "{what}: a {rank}-D parameter");
                }
                let input = tokens(2, 12, 37, 3, &device);
                let want = rounded.forward(input.clone());
                let got = bf16.forward(input.clone());
                assert_eq!(got.dtype(), DType::F32, "{what}");
                assert_close(&what, got, want.clone(), 1e-5, 1e-5);
                let probe = bf16.forward_probe(input.clone()).logits;
                assert_close(&format!("{what}: probe"), probe, want.clone(), 1e-5, 1e-5);
                let mut cache = bf16.cache();
                let mut start = 0;
                for step in [9, 1, 1, 1] {
                    let got = bf16.forward_cached(input.clone().narrow(1, start, step), &mut cache);
                    let want = want.clone().narrow(1, start, step);
                    assert_close(&format!("{what}: cached {start}"), got, want, 1e-5, 1e-5);
                    start += step;
                }
            }
        }
    }
}

/// Every float parameter's rank and dtype.
struct Dtypes(Vec<(usize, DType)>);

impl ModuleVisitor for Dtypes {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.push((D, param.val().dtype()));
    }
}
