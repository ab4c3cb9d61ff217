//! A pretrained baseline converted to DIFF (`diffzoo_models::convert`): V2 computes the source's
//! function exactly (or at the start of a warm-up), V1's weights are the source's rows in the
//! paired layout, and head counts V1 cannot pair are refused by name.

mod common;

use burn::module::Param;
use burn::tensor::{Distribution, Tensor};
use common::{max_abs_diff, tokens};
use diffzoo_models::convert::{self, Init, Options};
use diffzoo_models::{Attention, AttentionKind, Model, ModelConfig, target_log_probs};

/// A baseline with random weights everywhere, q/k/v biases included when it has them.
fn source(config: &ModelConfig, device: &burn::tensor::Device) -> Model {
    device.seed(7);
    let mut model = config.init(device);
    for block in &mut model.blocks {
        let Attention::Transformer(a) = &mut block.attn else {
            unreachable!()
        };
        for linear in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj] {
            if let Some(bias) = &linear.bias {
                let noise =
                    Tensor::<1>::random(bias.val().dims(), Distribution::Normal(0.0, 0.5), device);
                linear.bias = Some(Param::from_tensor(noise));
            }
        }
    }
    model
}

/// Per-token log-probabilities of the next token, `[B, S − 1]`.
fn log_probs(model: &Model, device: &burn::tensor::Device, vocab: usize) -> Tensor<2> {
    let t = tokens(2, 24, vocab, 3, device);
    let logits = model.forward(t.clone().narrow(1, 0, 23));
    target_log_probs(logits, t.narrow(1, 1, 23))
}

/// MHA and GQA, tied and untied, with and without q/k/v biases.
fn sources() -> Vec<(&'static str, ModelConfig)> {
    let base = |heads, kv| {
        ModelConfig::new(AttentionKind::Transformer, 32, 2, heads, 40, 32).with_kv_heads(Some(kv))
    };
    vec![
        ("mha", base(4, 4)),
        ("gqa tied", base(4, 2).with_tie_embeddings(true)),
        ("gqa biases", base(8, 2).with_qkv_bias(true)),
        ("odd heads", base(3, 1).with_head_dim(Some(8))),
    ]
}

#[test]
fn v2_copies_compute_the_source_exactly_and_a_warm_up_starts_from_it() {
    // Conversion selects and scales tensors on the device it is given; the CPU backend serves.
    for (backend, device) in [("flex", burn::tensor::Device::flex())] {
        for (name, config) in sources() {
            let source = source(&config, &device);
            let want = log_probs(&source, &device, config.vocab_size);
            let exact = Options {
                to: AttentionKind::DiffV2,
                init: Init::Copy,
                warmup: false,
            };
            let v2 = convert::convert(&source, &config, exact).unwrap();
            let gap = max_abs_diff(log_probs(&v2, &device, config.vocab_size), want.clone());
            assert!(gap <= 1e-4, "{backend} {name}: copy differs by {gap:e}");

            let warm = convert::convert(
                &source,
                &config,
                Options {
                    warmup: true,
                    ..exact
                },
            )
            .unwrap()
            .with_lambda_scale(0.0);
            let gap = max_abs_diff(log_probs(&warm, &device, config.vocab_size), want.clone());
            assert!(
                gap <= 1e-4,
                "{backend} {name}: warm-up start differs by {gap:e}"
            );
            // As the scale rises the subtracted half comes in: no longer the source.
            let risen = warm.with_lambda_scale(1.0);
            let gap = max_abs_diff(log_probs(&risen, &device, config.vocab_size), want.clone());
            assert!(
                gap > 1e-2,
                "{backend} {name}: scale 1 should differ, {gap:e}"
            );

            let perturbed = Options {
                init: Init::Perturbed { noise: 0.05 },
                ..exact
            };
            let v2 = convert::convert(&source, &config, perturbed).unwrap();
            let gap = max_abs_diff(log_probs(&v2, &device, config.vocab_size), want);
            assert!(
                gap > 1e-6 && gap < 0.5,
                "{backend} {name}: a 5% perturbation moves the log-probs by {gap:e}"
            );
        }
    }
}

#[test]
fn v1_takes_every_source_row_once_in_the_paired_layout() {
    let device = burn::tensor::Device::flex();
    for (name, config) in sources().into_iter().filter(|(n, _)| *n != "odd heads") {
        let source = source(&config, &device);
        let options = Options {
            to: AttentionKind::Diff,
            init: Init::Paired,
            warmup: false,
        };
        let v1 = convert::convert(&source, &config, options).unwrap();
        let (h, kv, d) = (config.heads, config.kv_heads(), config.head_dim());
        let order = convert::v1_query_heads(h, kv);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..h).collect::<Vec<_>>(),
            "{name}: every query head once"
        );
        let n = h / kv;
        for (half, &j) in order.iter().enumerate() {
            // Half-head (head, c) reads kv half c of group head / n, which is source kv head
            // 2·group + c: the kv head source head j read.
            let (head, c) = (half / 2, half % 2);
            assert_eq!(
                2 * (head / n) + c,
                j / n,
                "{name}: half {half} reads its kv head"
            );
        }
        let columns = |t: Tensor<2>, k: usize| t.narrow(1, k * d, d);
        let rows = |t: Tensor<2>, k: usize| t.narrow(0, k * d, d);
        for (to, from) in v1.blocks.iter().zip(&source.blocks) {
            let (Attention::Diff(b), Attention::Transformer(a)) = (&to.attn, &from.attn) else {
                unreachable!()
            };
            for (half, &j) in order.iter().enumerate() {
                let q = columns(b.q_proj.weight.val(), half);
                assert_eq!(max_abs_diff(q, columns(a.q_proj.weight.val(), j)), 0.0);
                let o = rows(b.o_proj.weight.val(), half);
                assert_eq!(max_abs_diff(o, rows(a.o_proj.weight.val(), j)), 0.0);
                if let (Some(bb), Some(ab)) = (&b.q_proj.bias, &a.q_proj.bias) {
                    let (bb, ab) = (
                        bb.val().narrow(0, half * d, d),
                        ab.val().narrow(0, j * d, d),
                    );
                    assert_eq!(max_abs_diff(bb, ab), 0.0);
                }
            }
            assert_eq!(
                max_abs_diff(b.k_proj.weight.val(), a.k_proj.weight.val()),
                0.0
            );
            assert_eq!(
                max_abs_diff(b.v_proj.weight.val(), a.v_proj.weight.val()),
                0.0
            );
            for (x, y) in [
                (&to.attn_norm.gamma, &from.attn_norm.gamma),
                (&to.ffn_norm.gamma, &from.ffn_norm.gamma),
            ] {
                assert_eq!(max_abs_diff(x.val(), y.val()), 0.0);
            }
            assert_eq!(
                max_abs_diff(to.ffn.w2.weight.val(), from.ffn.w2.weight.val()),
                0.0
            );
        }
        assert_eq!(
            max_abs_diff(v1.embed.weight.val(), source.embed.weight.val()),
            0.0
        );
        assert_eq!(v1.lm_head.is_some(), source.lm_head.is_some());
    }
}

#[test]
fn heads_that_v1_cannot_pair_are_refused_by_name() {
    let config = ModelConfig::new(AttentionKind::Transformer, 576, 1, 9, 40, 16)
        .with_kv_heads(Some(3))
        .with_head_dim(Some(64));
    let err = convert::converted_config(&config, AttentionKind::Diff).unwrap_err();
    assert!(
        err.contains("`model.heads` = 9") && err.contains("`model.kv_heads` = 3"),
        "{err}"
    );
    assert!(err.contains("6 and 2") && err.contains("12 and 4"), "{err}");
    assert!(convert::converted_config(&config, AttentionKind::DiffV2).is_ok());
    let mut diff = config.clone().with_kv_heads(Some(9));
    diff.attention = AttentionKind::Diff;
    let err = convert::converted_config(&diff, AttentionKind::DiffV2).unwrap_err();
    assert!(err.contains("baseline Transformer"), "{err}");
}
