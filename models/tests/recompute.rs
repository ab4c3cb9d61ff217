//! Per-block recomputation (`Model::backward_recomputed`) against one ordinary backward pass:
//! the loss and the gradient of every parameter, summed over the partial backward passes, for
//! the three variants, MHA and GQA, tied and untied embeddings, explicit and flash attention, on
//! every backend compiled in.

mod common;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Int, Tensor};
use common::{assert_close, backends, param_grads, tokens, tolerance, whole_grid};
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
                compare(&what, &config, &device);
            }
        }
    }
}

fn compare(what: &str, config: &ModelConfig, device: &Device) {
    let atol = tolerance(what.split(':').next().unwrap_or_default());
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
        |logits| loss(logits, &targets, device),
        |grads| {
            calls += 1;
            for (sum, (_, grad)) in sums.iter_mut().zip(param_grads(&model, &grads)) {
                if let Some(grad) = grad {
                    *sum = Some(match sum.take() {
                        Some(sum) => sum + grad,
                        None => grad,
                    });
                }
            }
        },
    );
    assert_eq!(calls, LAYERS + 2, "{what}: head, each block, embedding");
    assert_close(
        &format!("{what} loss"),
        recomputed_loss.inner(),
        expected_loss.inner(),
        atol,
        1e-5,
    );
    for (sum, (name, expected)) in sums.into_iter().zip(expected) {
        let expected = expected.unwrap_or_else(|| panic!("{what}: no gradient reaches {name}"));
        let sum = sum.unwrap_or_else(|| panic!("{what}: recomputation gives {name} none"));
        assert_close(&format!("{what} grad {name}"), sum, expected, atol, 1e-5);
    }
}

fn loss(logits: Tensor<3>, targets: &Tensor<2, Int>, device: &Device) -> Tensor<1> {
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
    model.backward_recomputed(input, |logits| logits.sum(), |_| {});
}
