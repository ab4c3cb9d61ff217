//! Invariants that hold for any weights: causality, cached decoding, parameter parity, the
//! λ_init schedule, gradient flow, the analysis path's maps, and the budget arithmetic.

mod common;

use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor};
use common::{
    IMPLS, assert_close, backends, max_abs_diff, param_grads, tokens, tolerance, whole_grid,
};
use diffzoo_models::{Attention, AttentionKind, ModelConfig, lambda_init};

fn device() -> Device {
    Device::flex()
}

/// A small config with `heads`/`kv_heads` of the baseline.
fn config(attention: AttentionKind, heads: usize, kv_heads: usize) -> ModelConfig {
    ModelConfig::new(attention, 48, 3, heads, 61, 32).with_kv_heads(Some(kv_heads))
}

const SHAPES: [(usize, usize); 3] = [(4, 4), (8, 4), (8, 2)];

#[test]
fn future_tokens_never_change_past_outputs() {
    let device = device();
    for attention in AttentionKind::ALL {
        for (heads, kv_heads) in SHAPES {
            for implementation in IMPLS {
                device.seed(7);
                let model = config(attention, heads, kv_heads)
                    .with_attention_impl(implementation)
                    .init(&device);
                let seq = 16;
                let base = tokens(2, seq, 61, 1, &device);
                let logits = model.forward(base.clone());
                for (t, seed) in [(0, 2), (5, 3), (14, 4)] {
                    let after = tokens(2, seq - t - 1, 61, seed, &device);
                    let perturbed = base.clone().slice_assign([0..2, t + 1..seq], after);
                    let other = model.forward(perturbed);
                    let past = |x: &Tensor<3>| x.clone().narrow(1, 0, t + 1);
                    let future = |x: &Tensor<3>| x.clone().narrow(1, t + 1, seq - t - 1);
                    let what =
                        format!("{attention} H={heads} H_kv={kv_heads} {implementation:?} t={t}");
                    assert!(
                        max_abs_diff(past(&logits), past(&other)) <= 1e-6,
                        "{what}: past changed"
                    );
                    assert!(
                        max_abs_diff(future(&logits), future(&other)) > 1e-4,
                        "{what}: future unchanged"
                    );
                }
            }
        }
    }
}

#[test]
fn cached_decoding_gives_the_logits_of_the_whole_sequence() {
    // A prompt's prefill, single tokens, a chunk of three, then single tokens again: 18 of the
    // 32 positions the model holds.
    let steps = [7, 1, 1, 3, 1, 1, 1, 1, 1, 1];
    let seq: usize = steps.iter().sum();
    for (backend, device) in backends() {
        for attention in AttentionKind::ALL {
            let shapes = SHAPES
                .into_iter()
                .filter(|&shape| whole_grid(backend) || shape == (8, 2));
            for (heads, kv_heads) in shapes {
                // Flash (blocks of 5: the 7-token prompt ends in a partial one) prefills;
                // decoding is explicit.
                let implementations = [IMPLS[0], IMPLS[3]];
                for implementation in &implementations[..if whole_grid(backend) { 2 } else { 1 }] {
                    device.seed(7);
                    let model = config(attention, heads, kv_heads)
                        .with_attention_impl(*implementation)
                        .init(&device);
                    let input = tokens(2, seq, 61, 1, &device);
                    let whole = model.forward(input.clone());
                    let mut cache = model.cache();
                    let mut start = 0;
                    for (i, step) in steps.into_iter().enumerate() {
                        let fed = input.clone().narrow(1, start, step);
                        // Every other step asks for its last position's logits only.
                        let (got, want) = match i % 2 {
                            0 => (
                                model.forward_cached(fed, &mut cache),
                                whole.clone().narrow(1, start, step),
                            ),
                            _ => (
                                model.forward_cached_last(fed, &mut cache),
                                whole.clone().narrow(1, start + step - 1, 1),
                            ),
                        };
                        assert_close(
                            &format!(
                                "{backend}: {attention} H={heads} H_kv={kv_heads} {implementation:?} \
                                 positions {start}..{}",
                                start + step
                            ),
                            got,
                            want,
                            tolerance(backend),
                            1e-5,
                        );
                        start += step;
                        assert_eq!(cache.len(), start);
                    }
                }
            }
        }
    }
}

/// Heads of 120 (the decoding kernel sums values 32 or 64 columns at a time in registers, then a
/// tail of 24 or 56): cached decoding of the baseline and DIFF V2, through the kernel on Flex,
/// gives the whole sequence's logits.
#[test]
fn cached_decoding_with_heads_wider_than_the_kernels_columns() {
    let steps = [7, 1, 1, 3, 1, 1];
    let seq: usize = steps.iter().sum();
    let device = device();
    for attention in [AttentionKind::Transformer, AttentionKind::DiffV2] {
        device.seed(3);
        let model = ModelConfig::new(attention, 240, 2, 2, 61, 32)
            .with_kv_heads(Some(1))
            .init(&device);
        let input = tokens(2, seq, 61, 2, &device);
        let whole = model.forward(input.clone());
        let mut cache = model.cache();
        let mut start = 0;
        for step in steps {
            let got = model.forward_cached(input.clone().narrow(1, start, step), &mut cache);
            let want = whole.clone().narrow(1, start, step);
            assert_close(&format!("{attention} at {start}"), got, want, 1e-5, 1e-5);
            start += step;
        }
    }
}

#[test]
fn a_truncated_cache_continues_as_if_it_held_only_the_kept_positions() {
    // 12 positions cached, cut back to 5, then 6 other tokens: the logits of the sequence whose
    // first 5 tokens are the kept ones and whose next 6 are the new ones.
    let device = device();
    for attention in AttentionKind::ALL {
        device.seed(5);
        let model = config(attention, 8, 2).init(&device);
        let first = tokens(1, 12, 61, 3, &device);
        let other = tokens(1, 6, 61, 4, &device);
        let mut cache = model.cache();
        model.forward_cached(first.clone(), &mut cache);
        cache.truncate(5);
        assert_eq!(cache.len(), 5);
        let got = model.forward_cached(other.clone(), &mut cache);
        let whole = model.forward(Tensor::cat(vec![first.narrow(1, 0, 5), other], 1));
        assert_close(
            &format!("{attention}"),
            got,
            whole.narrow(1, 5, 6),
            1e-5,
            1e-5,
        );
    }
}

/// Beyond a block of queries (`attention::blocks`, taken by Flex's explicit path) every variant
/// gives the other backends' logits (the explicit path over whole maps), and a prompt fed in two
/// parts of more than a block each, the second after the first's cache, gives the whole prompt's.
#[test]
fn attention_beyond_a_block_of_queries_gives_the_whole_maps_logits() {
    use diffzoo_models::attention::blocks::BLOCK;
    let (first, second) = (BLOCK + 2, BLOCK + 12);
    let seq = first + second;
    let device = device();
    for attention in AttentionKind::ALL {
        device.seed(5);
        let model = ModelConfig::new(attention, 48, 2, 4, 61, seq)
            .with_kv_heads(Some(2))
            .init(&device);
        let input = tokens(2, seq, 61, 3, &device);
        let whole = model.forward(input.clone());
        for (backend, other) in backends().into_iter().filter(|(name, _)| *name != "flex") {
            let theirs = model
                .clone()
                .to_device(&other)
                .forward(input.clone().to_device(&other))
                .to_device(&device);
            let what = format!("{attention}: {backend}");
            assert_close(
                &what,
                whole.clone(),
                theirs,
                tolerance(backend).max(1e-4),
                1e-4,
            );
        }
        let mut cache = model.cache();
        let parts = vec![
            model.forward_cached(input.clone().narrow(1, 0, first), &mut cache),
            model.forward_cached(input.narrow(1, first, second), &mut cache),
        ];
        let parts = Tensor::cat(parts, 1);
        assert_close(
            &format!("{attention}: in two parts"),
            parts,
            whole,
            1e-4,
            1e-4,
        );
    }
}

#[test]
fn a_left_padded_batch_decodes_each_prompt_as_alone() {
    // Prompts of 7, 3 and 5 tokens, padded on the left to 7, then four tokens decoded.
    let lengths = [7, 3, 5];
    let (width, steps) = (7, 4);
    let device = device();
    for attention in AttentionKind::ALL {
        for (heads, kv_heads) in SHAPES {
            device.seed(11);
            let model = config(attention, heads, kv_heads).init(&device);
            let rows: Vec<Tensor<2, Int>> = (0..lengths.len())
                .map(|r| tokens(1, width + steps, 61, 20 + r as u64, &device))
                .collect();
            let pads: Vec<usize> = lengths.iter().map(|l| width - l).collect();
            let mut cache = model.cache().with_left_padding(&pads, &device);
            let batch = Tensor::cat(rows.clone(), 0);
            let mut batched =
                vec![model.forward_cached(batch.clone().narrow(1, 0, width), &mut cache)];
            for t in width..width + steps {
                batched.push(model.forward_cached(batch.clone().narrow(1, t, 1), &mut cache));
            }
            let batched = Tensor::cat(batched, 1);
            for (r, row) in rows.into_iter().enumerate() {
                // Alone: the row without its padding, as one sequence.
                let alone = model.forward(row.narrow(1, pads[r], lengths[r] + steps));
                let got = batched
                    .clone()
                    .narrow(0, r, 1)
                    .narrow(1, pads[r], lengths[r] + steps);
                assert_close(
                    &format!("{attention} H={heads} H_kv={kv_heads} row {r}"),
                    got,
                    alone,
                    1e-5,
                    1e-5,
                );
            }
        }
    }
}

#[test]
#[should_panic(expected = "KV cache: 33 positions exceed the model's max_seq_len of 32")]
fn a_cache_refuses_positions_beyond_max_seq_len() {
    let device = device();
    let model = config(AttentionKind::Diff, 4, 4).init(&device);
    let mut cache = model.cache();
    model.forward_cached(tokens(1, 30, 61, 1, &device), &mut cache);
    model.forward_cached(tokens(1, 3, 61, 2, &device), &mut cache);
}

#[test]
fn diff_has_the_baseline_parameters_plus_six_d_per_layer() {
    let device = device();
    for (heads, kv_heads) in SHAPES {
        let base = config(AttentionKind::Transformer, heads, kv_heads);
        let diff = config(AttentionKind::Diff, heads, kv_heads);
        let v2 = config(AttentionKind::DiffV2, heads, kv_heads);
        let (l, d_model, d) = (base.layers, base.d_model, base.head_dim());
        let n_base = base.init(&device).num_params();
        assert_eq!(diff.init(&device).num_params(), n_base + 6 * d * l);
        assert_eq!(
            v2.init(&device).num_params(),
            n_base + l * (d_model * d_model + heads * d_model)
        );
    }
}

#[test]
fn counted_parameters_equal_the_module_parameters() {
    let device = device();
    for attention in AttentionKind::ALL {
        for (heads, kv_heads) in SHAPES {
            // Tied or not; heads as wide as d_model / heads, or wider with biases on q, k, v.
            for (tie, head_dim, bias) in [
                (false, None, false),
                (true, None, false),
                (false, Some(16), true),
            ] {
                let config = config(attention, heads, kv_heads)
                    .with_tie_embeddings(tie)
                    .with_ffn_dim(Some(100))
                    .with_head_dim(head_dim)
                    .with_qkv_bias(bias);
                let count = config.param_count();
                assert_eq!(
                    count.total as usize,
                    config.init(&device).num_params(),
                    "{attention} tie={tie} head_dim={head_dim:?} bias={bias}"
                );
                let tables = if tie { 1 } else { 2 };
                assert_eq!(count.total, count.non_embedding + tables * 61 * 48);
                assert_eq!(count.paper, count.non_embedding + 61 * 48);
            }
        }
    }
}

#[test]
fn lambda_init_follows_the_paper_schedule() {
    let expected = [0.2, 0.355_509, 0.470_713, 0.556_058];
    for (depth, value) in expected.into_iter().enumerate() {
        assert!(
            (lambda_init(depth) - value).abs() < 1e-6,
            "depth {depth}: {}",
            lambda_init(depth)
        );
    }
    assert!((lambda_init(100) - 0.8).abs() < 1e-9);
    let model = config(AttentionKind::Diff, 4, 4).init(&device());
    for (depth, block) in model.blocks.iter().enumerate() {
        let Attention::Diff(a) = &block.attn else {
            panic!("diff block expected")
        };
        assert_eq!(a.lambda_init, lambda_init(depth));
    }
}

#[test]
fn gradients_reach_every_parameter() {
    let device = device().autodiff();
    for attention in AttentionKind::ALL {
        device.seed(3);
        let model = config(attention, 8, 4).init(&device);
        let loss = model
            .forward(tokens(2, 10, 61, 5, &device))
            .powf_scalar(2.0)
            .mean();
        let grads = param_grads(&model, &loss.backward());
        assert!(!grads.is_empty());
        // The parameter paths whose gradient is missing or all zero.
        let dead: Vec<&String> = grads
            .iter()
            .filter(|(_, grad)| {
                !grad
                    .as_ref()
                    .is_some_and(|g| g.clone().abs().max().into_scalar::<f32>() > 0.0)
            })
            .map(|(name, _)| name)
            .collect();
        assert!(dead.is_empty(), "{attention}: no gradient for {dead:?}");
    }
}

#[test]
fn probe_maps_are_causal_and_rows_sum_to_one_minus_lambda() {
    let device = device();
    for attention in AttentionKind::ALL {
        device.seed(11);
        let model = config(attention, 8, 4).init(&device);
        let input = tokens(2, 9, 61, 9, &device);
        let probe = model.forward_probe(input.clone());
        // The probe forms each query head's map (keys repeated for GQA), the forward pass one
        // matmul per kv head: the same sums in other orders (measured 1.1e-6 at most).
        let gap = max_abs_diff(probe.logits.clone(), model.forward(input));
        assert!(gap <= 1e-5, "{attention}: {gap:e}");
        assert_eq!(probe.layers.len(), 3);
        for layer in &probe.layers {
            let a = &layer.attention;
            let [b, maps, s, _] = a.probs.dims();
            let probs_rows = a.probs.clone().sum_dim(3);
            assert!(max_abs_diff(probs_rows, Tensor::ones([b, maps, s, 1], &device)) < 1e-5);
            let above = a.effective.clone().triu(1).abs().max().into_scalar::<f32>();
            assert_eq!(
                above, 0.0,
                "{attention}: effective map attends to the future"
            );
            let logits_above = a
                .logits
                .clone()
                .slice([0..1, 0..1, 0..1, 1..2])
                .into_scalar::<f32>();
            assert_eq!(logits_above, f32::NEG_INFINITY);
            let [_, heads, _, _] = a.effective.dims();
            let rows = a.effective.clone().sum_dim(3);
            let expected = match (&a.lambda, attention) {
                (None, AttentionKind::Transformer) => Tensor::ones([b, heads, s, 1], &device),
                (Some(l), AttentionKind::Diff) => {
                    assert_eq!(l.dims(), [1, 1, 1]);
                    Tensor::ones([b, heads, s, 1], &device) - l.clone().unsqueeze::<4>()
                }
                (Some(l), AttentionKind::DiffV2) => {
                    assert_eq!(l.dims(), [b, s, heads]);
                    Tensor::ones([b, heads, s, 1], &device)
                        - l.clone().swap_dims(1, 2).unsqueeze_dim::<4>(3)
                }
                other => panic!("unexpected λ for {attention}: {:?}", other.0.is_some()),
            };
            assert!(
                max_abs_diff(rows, expected) < 1e-5,
                "{attention}: rows of the effective map"
            );
        }
    }
}

#[test]
fn diff_model_reports_one_lambda_per_layer() {
    let model = config(AttentionKind::Diff, 4, 4).init(&device());
    let lambdas = model.lambdas();
    assert_eq!(lambdas.len(), 3);
    for (depth, (lambda, block)) in lambdas.iter().zip(&model.blocks).enumerate() {
        let Attention::Diff(a) = &block.attn else {
            unreachable!()
        };
        let dot = |x: &Param<Tensor<1>>, y: &Param<Tensor<1>>| {
            (x.val() * y.val()).sum().into_scalar::<f32>()
        };
        let expected = dot(&a.lambda_q1, &a.lambda_k1).exp()
            - dot(&a.lambda_q2, &a.lambda_k2).exp()
            + lambda_init(depth) as f32;
        assert!((lambda - expected).abs() < 1e-6);
    }
    assert!(
        config(AttentionKind::Transformer, 4, 4)
            .init(&device())
            .lambdas()
            .is_empty()
    );
}

#[test]
fn flops_and_kv_cache_match_hand_arithmetic() {
    // d_model 64, 2 layers, H 4, H_kv 2, d 16, FFN 170, vocab 100, context 32.
    let cfg = |a| ModelConfig::new(a, 64, 2, 4, 100, 32).with_kv_heads(Some(2));
    let linear_base =
        2.0 * (64.0 * 64.0 + 2.0 * 64.0 * 32.0 + 64.0 * 64.0 + 3.0 * 64.0 * 170.0) + 64.0 * 100.0;
    let attn_base = 2.0 * 2.0 * 32.0 * (64.0 + 64.0);
    let base = cfg(AttentionKind::Transformer).flops_per_token(32);
    assert_eq!(base.forward, 2.0 * linear_base + attn_base);
    assert_eq!(base.training, 3.0 * base.forward);
    // DIFF V1: same projections, same score and value work.
    assert_eq!(cfg(AttentionKind::Diff).flops_per_token(32), base);
    // DIFF V2: another 64·64 of W_q and 64·4 of W_λ per layer, twice the attention work.
    let v2 = cfg(AttentionKind::DiffV2).flops_per_token(32);
    assert_eq!(
        v2.forward,
        2.0 * (linear_base + 2.0 * (64.0 * 64.0 + 64.0 * 4.0)) + 2.0 * attn_base
    );
    for a in AttentionKind::ALL {
        // 2 layers × (K and V of 2 heads × 16) × 2 bytes.
        assert_eq!(cfg(a).kv_cache_bytes_per_token(2), 2 * 2 * 32 * 2);
    }
}

#[test]
fn invalid_configurations_name_the_field() {
    let bad = [
        (
            ModelConfig::new(AttentionKind::Transformer, 50, 2, 4, 10, 8),
            "`heads` = 4 does not divide `d_model` = 50",
        ),
        (
            config(AttentionKind::Transformer, 8, 3),
            "`kv_heads` = 3 does not divide `heads` = 8",
        ),
        (
            config(AttentionKind::Diff, 6, 3),
            "needs even `heads` and `kv_heads`",
        ),
        (
            ModelConfig::new(AttentionKind::Transformer, 48, 2, 16, 10, 8),
            "must be even for RoPE",
        ),
        (
            config(AttentionKind::Transformer, 4, 4).with_ffn_dim(Some(0)),
            "`ffn_dim` must be positive",
        ),
        (
            config(AttentionKind::Transformer, 4, 4).with_rope_theta(-1.0),
            "`rope_theta` must be positive",
        ),
    ];
    for (config, message) in bad {
        let err = config.validate().expect_err(message);
        assert!(err.contains(message), "{err:?} should contain {message:?}");
    }
    assert!(config(AttentionKind::DiffV2, 6, 3).validate().is_ok());
    assert_eq!(
        "diff-v2".parse::<AttentionKind>(),
        Ok(AttentionKind::DiffV2)
    );
    assert!(
        "diff2"
            .parse::<AttentionKind>()
            .unwrap_err()
            .contains("diff2")
    );
}

#[test]
fn statistics_count_causal_logits_and_report_lambda() {
    let stats =
        diffzoo_models::AbsStats::of_values(vec![-3.0, 1.0, f32::NEG_INFINITY, 2.0, -0.5], 2);
    assert_eq!(stats.count, 4);
    assert_eq!(stats.top, vec![3.0, 2.0]);
    assert_eq!(stats.median, 2.0);
    let device = device();
    for attention in AttentionKind::ALL {
        device.seed(5);
        let model = config(attention, 8, 4).init(&device);
        let probe = model.forward_probe(tokens(2, 7, 61, 3, &device));
        let stats = probe.stats(10);
        assert_eq!(stats.len(), 3);
        for (layer, s) in stats.iter().enumerate() {
            let maps = probe.layers[layer].attention.logits.dims()[1];
            assert_eq!(
                s.logits.count,
                2 * maps * 7 * 8 / 2,
                "{attention}: only causal entries"
            );
            assert_eq!(s.hidden.count, 2 * 7 * 48);
            assert_eq!(s.logits.top.len(), 10);
            assert!(s.logits.top.windows(2).all(|w| w[0] >= w[1]));
            match attention {
                AttentionKind::Transformer => assert_eq!(s.lambda_mean, None),
                AttentionKind::Diff => {
                    assert!((s.lambda_mean.unwrap() - model.lambdas()[layer]).abs() < 1e-6)
                }
                AttentionKind::DiffV2 => assert!((0.0..1.0).contains(&s.lambda_mean.unwrap())),
            }
        }
    }
}

#[test]
fn the_accumulator_matches_exact_statistics_over_many_tensors() {
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        // Magnitudes across six decades, both signs, a few masked entries.
        let u = (rng >> 11) as f64 / (1u64 << 53) as f64;
        match rng % 97 {
            0 => f32::NEG_INFINITY,
            r => ((if r % 2 == 0 { -1.0 } else { 1.0 }) * 10f64.powf(6.0 * u - 3.0)) as f32,
        }
    };
    let chunks: Vec<Vec<f32>> = (0..7)
        .map(|i| (0..1000 + 37 * i).map(|_| next()).collect())
        .collect();
    let mut acc = diffzoo_models::AbsAccumulator::new(100);
    for c in &chunks {
        acc.add_values(c);
    }
    let got = acc.finish();
    let exact = diffzoo_models::AbsStats::of_values(chunks.concat(), 100);
    assert_eq!(got.count, exact.count);
    assert_eq!(got.top, exact.top);
    let rel = (got.median - exact.median).abs() / exact.median;
    assert!(
        rel < 1.2e-3,
        "median {} vs exact {}",
        got.median,
        exact.median
    );
    let zeros = diffzoo_models::AbsAccumulator::new(3);
    assert!(zeros.finish().median.is_nan());
}

#[test]
fn allocation_splits_a_hand_built_row_into_answer_and_noise() {
    let device = device();
    // Two heads over 6 keys; query row 5. Context is keys 0..4 (4 and 5 are the question),
    // the answer span keys 1..3.
    let rows = [
        [0.1, 0.3, 0.2, 0.1, 0.2, 0.1],
        [0.0, 0.5, -0.1, 0.2, 0.3, 0.1],
    ];
    let mut data = vec![0.0f32; 2 * 6 * 6];
    for (h, row) in rows.iter().enumerate() {
        data[h * 36 + 5 * 6..h * 36 + 6 * 6].copy_from_slice(&row.map(|v: f64| v as f32));
    }
    let maps = Tensor::<4>::from_data(burn::tensor::TensorData::new(data, [1, 2, 6, 6]), &device);
    let a = diffzoo_models::allocation(maps, 5, 1..3, 0..4);
    // answer: (0.3 + 0.2 + 0.5 − 0.1) / 2 = 0.45; context: (0.7 + 0.6) / 2 = 0.65.
    assert!((a.answer - 0.45).abs() < 1e-6, "{a:?}");
    assert!((a.noise - 0.20).abs() < 1e-6, "{a:?}");
}

#[test]
fn logit_quantization_is_exact_at_high_bits_and_coarse_at_low_bits() {
    let device = device();
    for attention in AttentionKind::ALL {
        device.seed(11);
        let model = config(attention, 8, 4).init(&device);
        let input = tokens(2, 9, 61, 4, &device);
        let full = model.forward(input.clone());
        let fused = model.clone().with_logit_bits(0).forward(input.clone());
        assert!(max_abs_diff(full.clone(), fused) == 0.0);
        let diff = |bits| {
            max_abs_diff(
                full.clone(),
                model.clone().with_logit_bits(bits).forward(input.clone()),
            )
        };
        let (d16, d8, d4) = (diff(16), diff(8), diff(4));
        assert!(d16 < 1e-4, "{attention}: 16 bits changed logits by {d16}");
        assert!(
            d4 > d8 && d4 > 10.0 * d16,
            "{attention}: 4 bits {d4}, 8 bits {d8}, 16 bits {d16}"
        );
        // The grid: each map's causal logits take at most 2·(2^(b−1) − 1) + 1 values.
        let probe = model
            .clone()
            .with_logit_bits(3)
            .forward_probe(input.clone());
        let logits = probe.layers[0]
            .attention
            .logits
            .clone()
            .narrow(0, 0, 1)
            .narrow(1, 0, 1);
        let mut values: Vec<f32> = logits
            .into_data()
            .try_into_vec::<f32>()
            .unwrap()
            .into_iter()
            .filter(|v| v.is_finite())
            .collect();
        values.sort_by(f32::total_cmp);
        values.dedup();
        assert!(values.len() <= 7, "{attention}: {values:?}");
    }
}
