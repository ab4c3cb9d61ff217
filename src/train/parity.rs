//! One optimizer step — loss, averaged and clipped gradients, the AdamW update — gives the same
//! numbers on every backend compiled in as on Flex, the reference, for every variant.

use super::{grads, loss::lm_loss, optimizer};
use crate::{device, recipe};
use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use diffzoo_datasets::LmBatch;
use diffzoo_models::{Attention, AttentionKind, Model};

/// What a step produced, as plain numbers.
struct Step {
    loss: f32,
    grad_norm: f64,
    /// Gradients of the first block's query projection and (DIFF) λ_q1.
    grads: Vec<f32>,
    /// The first block's query projection and (DIFF) λ_q1 after the update.
    updated: Vec<f32>,
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

fn watched(model: &Model) -> Vec<&Param<Tensor<1>>> {
    match &model.blocks[0].attn {
        Attention::Diff(a) => vec![&a.lambda_q1],
        _ => Vec::new(),
    }
}

fn q_proj(model: &Model) -> &Param<Tensor<2>> {
    match &model.blocks[0].attn {
        Attention::Transformer(a) => &a.q_proj.weight,
        Attention::Diff(a) => &a.q_proj.weight,
        Attention::DiffV2(a) => &a.q_proj.weight,
    }
}

fn one_step(reference: &Model, device: &Device, attention: AttentionKind) -> Step {
    let micro = recipe::resolve(
        "micro",
        &[
            format!("model.attention=\"{attention}\""),
            "optimizer.grad_clip=0.5".into(),
            // Adam's first update is lr·g/(|g| + ε): a larger ε keeps it a smooth function of
            // gradients near zero, whose sign is float noise.
            "optimizer.eps=1e-3".into(),
        ],
    )
    .unwrap()
    .recipe;
    let device = device.clone().autodiff();
    let model = reference.clone().fork(&device);
    let tokens: Vec<i64> = (0..2 * 17).map(|i| (i * 37 % 500) as i64).collect();
    let ids = |from: usize| {
        let v: Vec<i64> = (0..2)
            .flat_map(|r| tokens[r * 17 + from..r * 17 + from + 16].to_vec())
            .collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [2, 16]), &device)
    };
    let batch = LmBatch {
        inputs: ids(0),
        targets: ids(1),
        scored: None,
    };
    let loss = lm_loss(&model, &batch);
    let mut g = GradientsParams::from_grads(loss.backward(), &model);
    let grad_norm = grads::clip_global_norm(&model, &mut g, micro.optimizer.grad_clip);
    let mut grads = values(g.get::<2>(q_proj(&model).id).expect("q_proj gradient"));
    for p in watched(&model) {
        grads.extend(values(g.get::<1>(p.id).expect("λ gradient")));
    }
    let model = optimizer(&micro.optimizer).unwrap().step(1e-3, model, g);
    let mut updated = values(q_proj(&model).val());
    for p in watched(&model) {
        updated.extend(values(p.val()));
    }
    Step {
        loss: values(loss)[0],
        grad_norm,
        grads,
        updated,
    }
}

#[test]
fn one_training_step_matches_flex_on_every_backend() {
    for attention in AttentionKind::ALL {
        let flex = Device::flex().autodiff();
        flex.seed(3);
        let reference = recipe::resolve("micro", &[format!("model.attention=\"{attention}\"")])
            .unwrap()
            .recipe
            .model_config()
            .init(&flex);
        let want = one_step(&reference, &Device::flex(), attention);
        assert!(want.grad_norm > 0.5, "the clip must act");
        for spec in device::compiled() {
            let got = one_step(&reference, &device::parse(spec).unwrap(), attention);
            // GPU kernels and software Vulkan sum in other orders than the CPU backends.
            let tol = if spec == "wgpu" || spec.starts_with("cuda") {
                1e-4
            } else {
                1e-5
            };
            let what = format!("{spec} vs flex, {attention}");
            assert!(
                (got.loss - want.loss).abs() <= tol,
                "{what}: loss {} vs {}",
                got.loss,
                want.loss
            );
            assert!(
                (got.grad_norm - want.grad_norm).abs() <= tol as f64 * want.grad_norm,
                "{what}: gradient norm"
            );
            for (name, a, b) in [
                ("gradients", &got.grads, &want.grads),
                ("updated weights", &got.updated, &want.updated),
            ] {
                assert_eq!(a.len(), b.len());
                let worst = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0f32, f32::max);
                assert!(worst <= tol, "{what}: {name} differ by {worst}");
            }
        }
    }
}
