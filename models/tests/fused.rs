//! `fused`: RMSNorm, RoPE and SwiGLU's gate in one pass on Flex equal Burn's ops on every backend
//! (RoPE exactly on the CPU backends, RMSNorm and the gate to f32 rounding), for contiguous inputs
//! (the fused pass) and strided ones (Burn's ops); under autodiff each gives Burn's gradients
//! (through its own backward on Flex, which is taken there), and each backward by Burn's
//! operations (Flex's own for a gradient its pass does not take) equals Flex's pass.
mod common;

use burn::backend::Dispatch;
use burn::module::{Module, Param};
use burn::nn::{RmsNormConfig, RotaryEncodingConfig};
use burn::tensor::activation::silu;
use burn::tensor::{DType, Device, Distribution, Tensor};
use common::{assert_close, backends};
use diffzoo_models::fused::{self, FusedOps};
use diffzoo_models::product::{ProductOps, product};

fn random<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(shape, Distribution::Normal(0.0, 2.0), device)
}

fn exact(backend: &str) -> bool {
    !matches!(backend, "wgpu" | "cuda")
}

#[test]
fn rms_norm_equals_burns_rms_norm() {
    for (backend, device) in backends() {
        for (shape, epsilon) in [([2, 3, 37], 1e-5), ([1, 1, 576], 1e-6), ([3, 5, 16], 1e-2)] {
            let mut norm = RmsNormConfig::new(shape[2])
                .with_epsilon(epsilon)
                .init(&device);
            norm.gamma = norm.gamma.map(|g| g + random([shape[2]], &device));
            let x = random(shape, &device);
            let what = format!("{backend}: {shape:?}, ε {epsilon}");
            assert_close(
                &what,
                fused::rms_norm(&norm, x.clone()),
                norm.forward(x.clone()),
                1e-6,
                1e-6,
            );
            // A strided view takes Burn's ops.
            let strided = x.swap_dims(0, 1);
            assert_close(
                &format!("{what}, strided"),
                fused::rms_norm(&norm, strided.clone()),
                norm.forward(strided),
                1e-6,
                1e-6,
            );
        }
    }
}

#[test]
fn swiglu_equals_burns_silu_times_up() {
    for (backend, device) in backends() {
        // Lengths that leave a part of rayon's and sixteen lanes with tails; gates far into
        // both of silu's tails.
        for shape in [[2, 3, 37], [1, 1, 1536], [1, 70, 1000]] {
            let gate = random(shape, &device) * 8.0;
            let up = random(shape, &device);
            let what = format!("{backend}: {shape:?}");
            let theirs = silu(gate.clone()) * up.clone();
            assert_close(
                &what,
                fused::swiglu(gate.clone(), up.clone()),
                theirs,
                1e-5,
                1e-6,
            );
            let (gate, up) = (gate.swap_dims(0, 1), up.swap_dims(0, 1));
            assert_close(
                &format!("{what}, strided"),
                fused::swiglu(gate.clone(), up.clone()),
                silu(gate) * up,
                1e-5,
                1e-6,
            );
        }
    }
}

#[test]
fn swiglu_gradients_are_burns_under_autodiff() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        // More elements than one part of the pass, rows not a multiple of sixteen lanes.
        for shape in [[2, 3, 37], [1, 70, 1000]] {
            let gate = (random(shape, &device) * 8.0).require_grad();
            let up = random(shape, &device).require_grad();
            let weights = random(shape, &device);
            let ours = (fused::swiglu(gate.clone(), up.clone()) * weights.clone())
                .sum()
                .backward();
            let theirs = (silu(gate.clone()) * up.clone() * weights).sum().backward();
            for (name, input) in [("gate", &gate), ("up", &up)] {
                assert_close(
                    &format!("{backend}: {shape:?}, ∂{name}"),
                    input.grad(&ours).unwrap(),
                    input.grad(&theirs).unwrap(),
                    1e-5,
                    1e-5,
                );
            }
        }
        // Only the gate needs a gradient.
        let gate = random([2, 5, 24], &device).require_grad();
        let up = random([2, 5, 24], &device);
        let ours = fused::swiglu(gate.clone(), up.clone()).sum().backward();
        let theirs = (silu(gate.clone()) * up.clone()).sum().backward();
        assert_close(
            &format!("{backend}: ∂gate alone"),
            gate.grad(&ours).unwrap(),
            gate.grad(&theirs).unwrap(),
            1e-5,
            1e-5,
        );
        assert!(up.grad(&ours).is_none(), "{backend}: ∂up of a constant");
    }
}

#[test]
fn rotary_equals_burns_rotary_encoding() {
    for (backend, device) in backends() {
        let (b, s, heads, d, max) = (2, 5, 3, 8, 16);
        let rope = RotaryEncodingConfig::new(max, d)
            .with_theta(500.0)
            .init(&device);
        for start in [0, 4, max - s] {
            let x = random([b, s, heads * d], &device);
            let heads_of = |x: Tensor<3>| x.reshape([b, s, heads, d]).swap_dims(1, 2);
            let theirs = rope.apply(heads_of(x.clone()), start);
            let what = format!("{backend}: start {start}");
            let ours = fused::rotary(x.clone(), heads, &rope, start);
            assert_eq!(ours.dims(), [b, heads, s, d], "{what}");
            let plain = fused::rotary_plain(x.clone(), heads, &rope, start);
            match exact(backend) {
                true => ours.clone().into_data().assert_eq(&plain.into_data(), true),
                false => assert_close(&what, ours.clone(), plain, 1e-6, 1e-6),
            }
            assert_close(&what, ours, theirs, 1e-5, 1e-5);
        }
        // A strided input (the batch's rows reversed) takes Burn's ops.
        let x = random([b, s, heads * d], &device).flip([1]);
        assert_close(
            &format!("{backend}: strided"),
            fused::rotary(x.clone(), heads, &rope, 2),
            rope.apply(x.reshape([b, s, heads, d]).swap_dims(1, 2), 2),
            1e-5,
            1e-5,
        );
    }
}

#[test]
fn gradients_are_burns_under_autodiff() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        let norm = RmsNormConfig::new(24).init(&device);
        let rope = RotaryEncodingConfig::new(8, 8).init(&device);
        let x = random([2, 4, 24], &device).require_grad();
        let gated = |x: Tensor<3>| fused::swiglu(x.clone(), x.clone() + 1.0);
        let ours = fused::rotary(gated(fused::rms_norm(&norm, x.clone())), 3, &rope, 1);
        let normed = norm.forward(x.clone());
        let theirs = rope.apply(
            (silu(normed.clone()) * (normed + 1.0))
                .reshape([2, 4, 3, 8])
                .swap_dims(1, 2),
            1,
        );
        let weights = random([2, 3, 4, 8], &device);
        let grads_ours = (ours * weights.clone()).sum().backward();
        let grads_theirs = (theirs * weights).sum().backward();
        assert_close(
            &format!("{backend}: ∂x"),
            x.grad(&grads_ours).unwrap(),
            x.grad(&grads_theirs).unwrap(),
            1e-5,
            1e-5,
        );
    }
}

#[test]
fn rms_norm_gradients_are_burns_under_autodiff() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        // More rows than one part of the pass; a width that is not a multiple of sixteen; an ε
        // as large as the mean square.
        for (shape, scale, epsilon) in [
            ([2, 3, 37], 1.0, 1e-5),
            ([2, 70, 96], 1.0, 1e-5),
            ([2, 3, 37], 0.1, 4e-2),
        ] {
            let mut norm = RmsNormConfig::new(shape[2])
                .with_epsilon(epsilon)
                .init(&device);
            norm.gamma = Param::from_tensor(random([shape[2]], &device) + 1.0);
            let x = (random(shape, &device) * scale).require_grad();
            let weights = random(shape, &device);
            // Unscaled, and scaled as DIFF V1's `(1 − λ_init)·subln` is (the scale in γ).
            for gain in [None, Some(0.35)] {
                let ours = match gain {
                    None => fused::rms_norm(&norm, x.clone()),
                    Some(gain) => fused::rms_norm_scaled(&norm, x.clone(), gain),
                };
                let theirs = norm.forward(x.clone()).mul_scalar(gain.unwrap_or(1.0));
                let ours = (ours * weights.clone()).sum().backward();
                let theirs = (theirs * weights.clone()).sum().backward();
                let what = format!("{backend}: {shape:?}, ε {epsilon}, scale {gain:?}");
                assert_close(
                    &format!("{what}, ∂x"),
                    x.grad(&ours).unwrap(),
                    x.grad(&theirs).unwrap(),
                    1e-5,
                    1e-4,
                );
                assert_close(
                    &format!("{what}, ∂γ"),
                    norm.gamma.val().grad(&ours).unwrap(),
                    norm.gamma.val().grad(&theirs).unwrap(),
                    1e-4,
                    1e-4,
                );
            }
        }
        // γ frozen: only ∂x.
        let norm = RmsNormConfig::new(24).init(&device).no_grad();
        let x = random([3, 24], &device).require_grad();
        let ours = (fused::rms_norm(&norm, x.clone()) * x.clone())
            .sum()
            .backward();
        let theirs = (norm.forward(x.clone()) * x.clone()).sum().backward();
        assert_close(
            &format!("{backend}: ∂x, γ frozen"),
            x.grad(&ours).unwrap(),
            x.grad(&theirs).unwrap(),
            1e-5,
            1e-4,
        );
        assert!(
            norm.gamma.val().grad(&ours).is_none(),
            "{backend}: ∂γ frozen"
        );
    }
}

#[test]
fn rotary_gradients_are_burns_under_autodiff() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        let (b, s, heads, d) = (2, 40, 3, 8);
        let rope = RotaryEncodingConfig::new(64, d).init(&device);
        let x = random([b, s, heads * d], &device).require_grad();
        let weights = random([b, heads, s, d], &device);
        let ours = (fused::rotary(x.clone(), heads, &rope, 7) * weights.clone())
            .sum()
            .backward();
        let theirs = (fused::rotary_plain(x.clone(), heads, &rope, 7) * weights)
            .sum()
            .backward();
        assert_close(
            &format!("{backend}: ∂x"),
            x.grad(&ours).unwrap(),
            x.grad(&theirs).unwrap(),
            1e-6,
            1e-5,
        );
    }
}

#[test]
fn burns_operations_give_flexs_backwards() {
    let flex = Device::flex();
    let to = |t: Tensor<3>, device: &Device| t.to_device(device).into_dispatch();
    let (x, grad) = (random([2, 35, 40], &flex), random([2, 35, 40], &flex));
    let gamma = random([40], &flex);
    let rms_norm = |device: &Device| {
        let (d_x, d_gamma) = <Dispatch as FusedOps>::rms_norm_backward(
            to(x.clone(), device),
            gamma.clone().to_device(device).into_dispatch(),
            to(grad.clone(), device),
            1e-5,
        );
        (
            Tensor::<3>::from_dispatch(d_x).to_device(&flex),
            Tensor::<1>::from_dispatch(d_gamma).to_device(&flex),
        )
    };
    // RoPE's table `[S, d, 2]` for d = 8 (5 heads of the 40 columns), from Burn's encoding.
    let rope = RotaryEncodingConfig::new(64, 8).init(&flex);
    let table = rope.freq_complex.clone().narrow(0, 3, 35);
    let rotary = |device: &Device| {
        Tensor::<3>::from_dispatch(<Dispatch as FusedOps>::rotary_backward(
            to(grad.clone(), device),
            table.clone().to_device(device).into_dispatch(),
            5,
        ))
        .to_device(&flex)
    };
    let (flex_x, flex_gamma) = rms_norm(&flex);
    // On Flex a strided gradient takes Burn's operations: the same values as the pass.
    let strided = grad
        .clone()
        .swap_dims(1, 2)
        .flip([0])
        .swap_dims(1, 2)
        .flip([0]);
    let (d_x, d_gamma) = <Dispatch as FusedOps>::rms_norm_backward(
        x.clone().into_dispatch(),
        gamma.clone().into_dispatch(),
        strided.clone().into_dispatch(),
        1e-5,
    );
    let (d_x, d_gamma) = (
        Tensor::<3>::from_dispatch(d_x),
        Tensor::<1>::from_dispatch(d_gamma),
    );
    assert_close("flex strided: RMSNorm ∂x", d_x, flex_x.clone(), 1e-5, 1e-4);
    assert_close(
        "flex strided: RMSNorm ∂γ",
        d_gamma,
        flex_gamma.clone(),
        1e-4,
        1e-4,
    );
    let d_x = <Dispatch as FusedOps>::rotary_backward(
        strided.into_dispatch(),
        table.clone().into_dispatch(),
        5,
    );
    assert_close(
        "flex strided: RoPE ∂x",
        Tensor::<3>::from_dispatch(d_x),
        rotary(&flex),
        1e-6,
        1e-5,
    );
    for (backend, device) in backends() {
        let (d_x, d_gamma) = rms_norm(&device);
        assert_close(
            &format!("{backend}: RMSNorm ∂x"),
            d_x,
            flex_x.clone(),
            1e-5,
            1e-4,
        );
        assert_close(
            &format!("{backend}: RMSNorm ∂γ"),
            d_gamma,
            flex_gamma.clone(),
            1e-4,
            1e-4,
        );
        assert_close(
            &format!("{backend}: RoPE ∂x"),
            rotary(&device),
            rotary(&flex),
            1e-6,
            1e-5,
        );
    }
}

#[test]
fn flex_takes_the_fused_operations_under_autodiff() {
    let device = Device::flex().autodiff();
    let x = random([2, 4, 24], &device).require_grad();
    let gamma = random([24], &device).require_grad();
    let rms_norm =
        <Dispatch as FusedOps>::rms_norm(x.clone().into_dispatch(), gamma.into_dispatch(), 1e-5);
    assert!(rms_norm.is_some(), "RMSNorm");
    let rope = RotaryEncodingConfig::new(8, 8).init(&device);
    let table = rope.freq_complex.clone().narrow(0, 0, 4);
    let rotary =
        <Dispatch as FusedOps>::rotary(x.clone().into_dispatch(), table.into_dispatch(), 3);
    assert!(rotary.is_some(), "RoPE");
    let swiglu = <Dispatch as FusedOps>::swiglu(x.clone().into_dispatch(), x.into_dispatch());
    assert!(swiglu.is_some(), "SwiGLU");
    let scores = random([2, 4, 8, 8], &device).require_grad();
    let softmax = <Dispatch as FusedOps>::causal_softmax(scores.clone().into_dispatch(), 8, 0.5);
    assert!(softmax.is_some(), "the causal softmax");
    let lambda = Tensor::<3>::full([1, 1, 1], 0.8, &device).require_grad();
    let differential = <Dispatch as FusedOps>::differential_softmax(
        scores.into_dispatch(),
        8,
        0.5,
        lambda.into_dispatch(),
    );
    assert!(differential.is_some(), "the differential map");
    let pairs = random([2, 4, 3, 5], &device).require_grad();
    let lambda = random([2, 3, 2], &device).require_grad();
    let difference =
        <Dispatch as FusedOps>::pair_difference(pairs.into_dispatch(), lambda.into_dispatch());
    assert!(difference.is_some(), "the pair difference");
}

/// Causal maps: queries as the last positions of more keys (a cache before them), GQA groups
/// stacked along the rows, rows longer than one sixteen-lane step and a scale as attention's.
const CAUSAL: [([usize; 4], usize, f64); 4] = [
    ([2, 3, 7, 7], 7, 0.35),
    ([1, 2, 5, 9], 5, 0.125),
    ([2, 1, 12, 4], 4, 0.5),
    ([1, 2, 40, 37], 20, 0.125),
];

#[test]
fn causal_softmax_equals_burns_masked_softmax() {
    for (backend, device) in backends() {
        for (shape, positions, scale) in CAUSAL {
            let scores = random(shape, &device) * 3.0;
            let ours = fused::causal_softmax(scores.clone(), positions, scale);
            let theirs = fused::causal_softmax_plain(scores, positions, scale);
            let what = format!("{backend}: {shape:?} over {positions}");
            // Row r (position r mod positions, after T − positions others) sees its own key and
            // every earlier one: the first row of each group sees T − positions + 1.
            let visible = shape[3] - positions + 1;
            let masked = ours
                .clone()
                .narrow(2, 0, 1)
                .narrow(3, visible, shape[3] - visible);
            if shape[3] > visible {
                assert_eq!(
                    masked.abs().max().into_scalar::<f32>(),
                    0.0,
                    "{what}: masked"
                );
            }
            assert_close(&what, ours, theirs, 1e-6, 1e-5);
        }
    }
}

/// Query positions the scores' shape cannot take (none, more than the keys, not dividing the
/// rows) are refused by name, by the fused operations and by Burn's (which would otherwise fail
/// on an overflow or a mask of the wrong shape).
#[test]
fn causal_maps_refuse_positions_their_scores_cannot_take() {
    let device = Device::flex();
    // Scores of 6 rows over 6 keys.
    for positions in [0, 7, 4] {
        let scores = || random([1, 2, 6, 6], &device);
        let lambda = || Tensor::<3>::ones([1, 1, 1], &device);
        let want =
            format!("{positions} query positions must be 1 to the 6 keys and divide the 6 rows");
        let refused = |what: &str, operation: &dyn Fn()| {
            let message = std::panic::catch_unwind(std::panic::AssertUnwindSafe(operation))
                .expect_err(&format!("{what}: {positions} positions taken"));
            let message = message.downcast_ref::<String>().cloned();
            let message = message.unwrap_or_default();
            assert!(message.contains(&want), "{what}: {message:?}");
        };
        refused("fused", &|| {
            drop(fused::causal_softmax(scores(), positions, 1.0))
        });
        refused("plain", &|| {
            drop(fused::causal_softmax_plain(scores(), positions, 1.0))
        });
        refused("differential", &|| {
            drop(fused::differential_softmax(
                scores(),
                positions,
                1.0,
                lambda(),
            ))
        });
        refused("differential plain", &|| {
            drop(fused::differential_softmax_plain(
                scores(),
                positions,
                1.0,
                lambda(),
            ))
        });
    }
}

#[test]
fn causal_softmax_gradients_are_burns_under_autodiff() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        for (shape, positions, scale) in CAUSAL {
            let scores = (random(shape, &device) * 3.0).require_grad();
            let weights = random(shape, &device);
            let ours = (fused::causal_softmax(scores.clone(), positions, scale) * weights.clone())
                .sum()
                .backward();
            let theirs = (fused::causal_softmax_plain(scores.clone(), positions, scale) * weights)
                .sum()
                .backward();
            assert_close(
                &format!("{backend}: {shape:?} over {positions}, ∂scores"),
                scores.grad(&ours).unwrap(),
                scores.grad(&theirs).unwrap(),
                1e-5,
                1e-4,
            );
        }
    }
}

#[test]
fn burns_operations_give_flexs_causal_softmax_backward() {
    let flex = Device::flex();
    let ([b, h, r, t], scale) = ([2, 2, 9, 9], 0.25);
    let y = fused::causal_softmax(random([b, h, r, t], &flex), r, scale);
    let grad = random([b, h, r, t], &flex);
    let backward = |y: Tensor<4>, grad: Tensor<4>| {
        Tensor::<4>::from_dispatch(<Dispatch as FusedOps>::causal_softmax_backward(
            y.into_dispatch(),
            grad.into_dispatch(),
            scale,
        ))
        .to_device(&flex)
    };
    let on_flex = backward(y.clone(), grad.clone());
    // A strided gradient takes Burn's operations on Flex.
    assert_close(
        "flex strided",
        backward(y.clone(), strided(grad.clone())),
        on_flex.clone(),
        1e-6,
        1e-5,
    );
    for (backend, device) in backends() {
        assert_close(
            &format!("{backend}: ∂scores"),
            backward(
                y.clone().to_device(&device),
                grad.clone().to_device(&device),
            ),
            on_flex.clone(),
            1e-6,
            1e-5,
        );
    }
}

/// `t`'s values as a view of the first columns of a wider tensor (not contiguous).
fn strided(t: Tensor<4>) -> Tensor<4> {
    let columns = t.dims()[3];
    Tensor::cat(vec![t.clone(), t], 3).narrow(3, 0, columns)
}

/// Differential maps `[B, 2H, R, T]` over `positions`, λ: queries after a cache, GQA-style rows
/// stacked, a decoding step's single row, λ negative and λ past 1.
const DIFFERENTIAL: [([usize; 4], usize, f64, f32); 4] = [
    ([2, 4, 7, 7], 7, 0.35, 0.8),
    ([1, 2, 5, 9], 5, 0.125, -0.3),
    ([2, 2, 40, 37], 20, 0.125, 0.2),
    ([1, 6, 1, 17], 1, 0.25, 1.4),
];

#[test]
fn differential_softmax_equals_burns_maps_subtracted() {
    for (backend, device) in backends() {
        for (shape, positions, scale, lambda) in DIFFERENTIAL {
            let scores = random(shape, &device) * 3.0;
            let lambda = Tensor::<3>::full([1, 1, 1], lambda, &device);
            let what = format!("{backend}: {shape:?} over {positions}");
            let ours =
                fused::differential_softmax(scores.clone(), positions, scale, lambda.clone());
            // A₁ − λ·A₂ from the separate maps of half-heads 2h and 2h+1.
            let maps = fused::causal_softmax_plain(scores.clone(), positions, scale);
            let [b, h2, r, t] = shape;
            let pairs = maps.reshape([b, h2 / 2, 2, r, t]);
            let [a_1, a_2] =
                [0, 1].map(|c| pairs.clone().narrow(2, c, 1).reshape([b, h2 / 2, r, t]));
            assert_close(
                &what,
                ours.clone(),
                a_1 - a_2 * lambda.clone().unsqueeze::<4>(),
                1e-6,
                1e-5,
            );
            assert_close(
                &format!("{what}, plain"),
                ours,
                fused::differential_softmax_plain(scores.clone(), positions, scale, lambda.clone()),
                1e-6,
                1e-5,
            );
            // A strided view takes Burn's ops.
            assert_close(
                &format!("{what}, strided"),
                fused::differential_softmax(
                    strided(scores.clone()),
                    positions,
                    scale,
                    lambda.clone(),
                ),
                fused::differential_softmax_plain(scores, positions, scale, lambda),
                1e-6,
                1e-5,
            );
        }
    }
}

#[test]
fn differential_softmax_gradients_are_burns_under_autodiff() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        for (shape, positions, scale, lambda) in DIFFERENTIAL {
            let scores = (random(shape, &device) * 3.0).require_grad();
            let lambda = Tensor::<3>::full([1, 1, 1], lambda, &device).require_grad();
            let [b, h2, r, t] = shape;
            let weights = random([b, h2 / 2, r, t], &device);
            let grads = |map: Tensor<4>| (map * weights.clone()).sum().backward();
            let ours = grads(fused::differential_softmax(
                scores.clone(),
                positions,
                scale,
                lambda.clone(),
            ));
            let theirs = grads(fused::differential_softmax_plain(
                scores.clone(),
                positions,
                scale,
                lambda.clone(),
            ));
            let what = format!("{backend}: {shape:?} over {positions}");
            assert_close(
                &format!("{what}, ∂scores"),
                scores.grad(&ours).unwrap(),
                scores.grad(&theirs).unwrap(),
                1e-5,
                1e-4,
            );
            assert_close(
                &format!("{what}, ∂λ"),
                lambda.grad(&ours).unwrap(),
                lambda.grad(&theirs).unwrap(),
                1e-5,
                1e-4,
            );
        }
    }
}

#[test]
fn burns_operations_give_flexs_differential_softmax_backward() {
    let flex = Device::flex();
    let ([b, h2, r, t], scale) = ([2, 4, 9, 11], 0.25);
    let y = fused::causal_softmax(random([b, h2, r, t], &flex), r, scale);
    let grad = random([b, h2 / 2, r, t], &flex);
    let lambda = Tensor::<3>::full([1, 1, 1], 0.7, &flex);
    let backward = |y: Tensor<4>, grad: Tensor<4>, lambda: Tensor<3>| {
        let (d_scores, d_lambda) = <Dispatch as FusedOps>::differential_softmax_backward(
            y.into_dispatch(),
            lambda.into_dispatch(),
            grad.into_dispatch(),
            scale,
        );
        (
            Tensor::<4>::from_dispatch(d_scores).to_device(&flex),
            Tensor::<3>::from_dispatch(d_lambda).to_device(&flex),
        )
    };
    let (d_scores, d_lambda) = backward(y.clone(), grad.clone(), lambda.clone());
    // A strided gradient takes Burn's operations on Flex.
    let (strided_scores, strided_lambda) =
        backward(y.clone(), strided(grad.clone()), lambda.clone());
    assert_close(
        "flex strided: ∂scores",
        strided_scores,
        d_scores.clone(),
        1e-6,
        1e-5,
    );
    assert_close(
        "flex strided: ∂λ",
        strided_lambda,
        d_lambda.clone(),
        1e-5,
        1e-5,
    );
    for (backend, device) in backends() {
        let on = |t: &Tensor<4>| t.clone().to_device(&device);
        let (theirs_scores, theirs_lambda) =
            backward(on(&y), on(&grad), lambda.clone().to_device(&device));
        assert_close(
            &format!("{backend}: ∂scores"),
            theirs_scores,
            d_scores.clone(),
            1e-6,
            1e-5,
        );
        assert_close(
            &format!("{backend}: ∂λ"),
            theirs_lambda,
            d_lambda.clone(),
            1e-5,
            1e-5,
        );
    }
}

/// Pairs `[B, 2H, S, n]` and the shapes of λ: V2's per token and head, one λ (DIFF), one per
/// position, one per sequence and head; rows shorter and longer than sixteen lanes.
const PAIRS: [([usize; 4], [usize; 3]); 4] = [
    ([2, 6, 5, 7], [2, 5, 3]),
    ([1, 4, 9, 40], [1, 1, 1]),
    ([3, 2, 4, 16], [1, 4, 1]),
    ([2, 4, 1, 33], [2, 1, 2]),
];

#[test]
fn pair_difference_equals_burns_first_minus_lambda_times_second() {
    for (backend, device) in backends() {
        for (shape, lambda_shape) in PAIRS {
            let pairs = random(shape, &device);
            let lambda = random(lambda_shape, &device);
            let what = format!("{backend}: {shape:?} with λ {lambda_shape:?}");
            let ours = fused::pair_difference(pairs.clone(), lambda.clone());
            // Element by element: x_{2h} − λ_{b,s,h}·x_{2h+1}.
            let [b, h2, s, n] = shape;
            let [first, second] = [0, 1].map(|c| {
                pairs
                    .clone()
                    .reshape([b, h2 / 2, 2, s, n])
                    .narrow(2, c, 1)
                    .reshape([b, h2 / 2, s, n])
            });
            let lambda_4 = lambda.clone().swap_dims(1, 2).unsqueeze_dim::<4>(3);
            assert_close(&what, ours.clone(), first - second * lambda_4, 1e-6, 1e-6);
            assert_close(
                &format!("{what}, strided"),
                fused::pair_difference(strided(pairs.clone()), lambda.clone()),
                fused::pair_difference_plain(pairs, lambda),
                1e-6,
                1e-6,
            );
        }
    }
}

#[test]
fn pair_difference_gradients_are_burns_under_autodiff() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        for (shape, lambda_shape) in PAIRS {
            let pairs = random(shape, &device).require_grad();
            let lambda = random(lambda_shape, &device).require_grad();
            let [b, h2, s, n] = shape;
            let weights = random([b, h2 / 2, s, n], &device);
            let grads = |out: Tensor<4>| (out * weights.clone()).sum().backward();
            let ours = grads(fused::pair_difference(pairs.clone(), lambda.clone()));
            let theirs = grads(fused::pair_difference_plain(pairs.clone(), lambda.clone()));
            let what = format!("{backend}: {shape:?} with λ {lambda_shape:?}");
            assert_close(
                &format!("{what}, ∂pairs"),
                pairs.grad(&ours).unwrap(),
                pairs.grad(&theirs).unwrap(),
                1e-5,
                1e-5,
            );
            assert_close(
                &format!("{what}, ∂λ"),
                lambda.grad(&ours).unwrap(),
                lambda.grad(&theirs).unwrap(),
                1e-4,
                1e-5,
            );
        }
    }
}

#[test]
fn burns_operations_give_flexs_pair_difference_backward() {
    let flex = Device::flex();
    for (shape, lambda_shape) in PAIRS {
        let pairs = random(shape, &flex);
        let lambda = random(lambda_shape, &flex);
        let [b, h2, s, n] = shape;
        let grad = random([b, h2 / 2, s, n], &flex);
        let backward = |pairs: Tensor<4>, lambda: Tensor<3>, grad: Tensor<4>| {
            let (d_pairs, d_lambda) = <Dispatch as FusedOps>::pair_difference_backward(
                pairs.into_dispatch(),
                lambda.into_dispatch(),
                grad.into_dispatch(),
            );
            (
                Tensor::<4>::from_dispatch(d_pairs).to_device(&flex),
                Tensor::<3>::from_dispatch(d_lambda).to_device(&flex),
            )
        };
        let (d_pairs, d_lambda) = backward(pairs.clone(), lambda.clone(), grad.clone());
        let what = format!("{shape:?} with λ {lambda_shape:?}");
        // Strided gradients: rows further apart than n, and the heads' gradient as autodiff
        // hands it back from merging them, a transposed view of [B, S, H, n].
        let heads_last = Tensor::<4>::from_data(grad.clone().swap_dims(1, 2).to_data(), &flex);
        let layouts = [
            ("rows apart", strided(grad.clone())),
            ("heads transposed", heads_last.swap_dims(1, 2)),
        ];
        for (layout, grad) in layouts {
            let (strided_pairs, strided_lambda) = backward(pairs.clone(), lambda.clone(), grad);
            assert_close(
                &format!("flex, {layout}, {what}: ∂pairs"),
                strided_pairs,
                d_pairs.clone(),
                1e-6,
                1e-6,
            );
            assert_close(
                &format!("flex, {layout}, {what}: ∂λ"),
                strided_lambda,
                d_lambda.clone(),
                1e-4,
                1e-5,
            );
        }
        for (backend, device) in backends() {
            let (theirs_pairs, theirs_lambda) = backward(
                pairs.clone().to_device(&device),
                lambda.clone().to_device(&device),
                grad.clone().to_device(&device),
            );
            assert_close(
                &format!("{backend} {what}: ∂pairs"),
                theirs_pairs,
                d_pairs.clone(),
                1e-6,
                1e-6,
            );
            assert_close(
                &format!("{backend} {what}: ∂λ"),
                theirs_lambda,
                d_lambda.clone(),
                1e-4,
                1e-5,
            );
        }
    }
}

/// Attention in blocks of queries (`attention::blocks`, Flex) gives the explicit path's output
/// and gradients, computed here by Burn's operations over the whole maps: more positions than
/// three blocks (the last one short), queries after earlier keys, GQA groups of two and one, and
/// DIFF's `A₁ − λ·A₂` with ∂λ. Fewer positions than a block, and other backends, are left to the
/// explicit path (`None`).
#[test]
fn attention_in_blocks_gives_the_explicit_paths_values_and_gradients() {
    use diffzoo_models::attention::blocks::{self, BLOCK};
    let device = Device::flex().autodiff();
    let (s, d) = (2 * BLOCK + 44, 16);
    let scale = 1.0 / (d as f64).sqrt();
    let heads_of = |x: Tensor<4>, n_rep: usize| {
        let [b, h, t, d] = x.dims();
        x.unsqueeze_dim::<5>(2)
            .expand([b, h, n_rep, t, d])
            .reshape([b, h * n_rep, t, d])
    };
    for (heads, kv_heads, past) in [(4, 2, 0), (2, 2, 9), (3, 1, 0), (4, 2, 9)] {
        let what = format!("H {heads}, H_kv {kv_heads}, {past} keys before");
        let t = past + s;
        let q = random([2, heads, s, d], &device).require_grad();
        let k = random([2, kv_heads, t, d], &device).require_grad();
        let v = random([2, kv_heads, t, d + 3], &device).require_grad();
        let weights = random([2, heads, s, d + 3], &device);
        let ours = blocks::causal(q.clone(), k.clone(), v.clone()).expect("Flex takes it");
        let scores = q
            .clone()
            .matmul(heads_of(k.clone(), heads / kv_heads).swap_dims(2, 3));
        let theirs = fused::causal_softmax_plain(scores, s, scale)
            .matmul(heads_of(v.clone(), heads / kv_heads));
        assert_close(&what, ours.clone(), theirs.clone(), 1e-5, 1e-4);
        let ours = (ours * weights.clone()).sum().backward();
        let theirs = (theirs * weights).sum().backward();
        for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
            let [a, b] = [&ours, &theirs].map(|g| x.grad(g).expect("a gradient"));
            // Sums over the blocks in another order: f32 rounding.
            assert_close(&format!("{what}: ∂{name}"), a, b, 1e-4, 1e-4);
        }
    }
    // DIFF: half-heads 2h and 2h+1, values of head h twice as wide, after 9 keys.
    let (q, k) = (
        random([2, 4, s, d], &device).require_grad(),
        random([2, 4, s + 9, d], &device).require_grad(),
    );
    let v = random([2, 2, s + 9, 2 * d], &device).require_grad();
    let lambda = Tensor::<3>::full([1, 1, 1], 0.7, &device).require_grad();
    let weights = random([2, 2, s, 2 * d], &device);
    let ours = blocks::differential(q.clone(), k.clone(), v.clone(), lambda.clone())
        .expect("Flex takes it");
    let scores = q.clone().matmul(k.clone().swap_dims(2, 3));
    let theirs =
        fused::differential_softmax_plain(scores, s, scale, lambda.clone()).matmul(v.clone());
    assert_close("DIFF", ours.clone(), theirs.clone(), 1e-5, 1e-4);
    let ours = (ours * weights.clone()).sum().backward();
    let theirs = (theirs * weights).sum().backward();
    for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
        let [a, b] = [&ours, &theirs].map(|g| x.grad(g).expect("a gradient"));
        assert_close(&format!("DIFF: ∂{name}"), a, b, 1e-4, 1e-4);
    }
    let [a, b] = [&ours, &theirs].map(|g| lambda.grad(g).expect("a gradient"));
    assert_close("DIFF: ∂λ", a, b, 1e-4, 1e-4);
    // Without autodiff (a prompt), the same numbers.
    let flex = Device::flex();
    let [q, k, v] = [[1, 4, s, d], [1, 2, s, d], [1, 2, s, d]].map(|shape| random(shape, &flex));
    let scores = q.clone().matmul(heads_of(k.clone(), 2).swap_dims(2, 3));
    assert_close(
        "without autodiff",
        blocks::causal(q, k, v.clone()).expect("Flex takes it"),
        fused::causal_softmax_plain(scores, s, scale).matmul(heads_of(v, 2)),
        1e-5,
        1e-4,
    );
    // What the op leaves to the explicit path: a block's positions, bf16, other backends.
    let short = random([1, 2, BLOCK, d], &device);
    assert!(
        blocks::causal(short.clone(), short.clone(), short).is_none(),
        "a block's positions"
    );
    let half = random([1, 2, s, d], &flex).cast(burn::tensor::DType::BF16);
    assert!(
        blocks::causal(half.clone(), half.clone(), half).is_none(),
        "bf16"
    );
    for (backend, device) in backends().into_iter().filter(|(name, _)| *name != "flex") {
        let x = random([1, 2, s, d], &device);
        assert!(
            blocks::causal(x.clone(), x.clone(), x).is_none(),
            "{backend}"
        );
    }
}

/// `product`'s operands: 2-D and batched, one product on rayon's threads (200³ multiply-adds), a
/// batch spread over them (8 × 64³) and one of 2 large products each on them; k = 0 and m = 0.
const PRODUCTS: [([usize; 4], usize); 7] = [
    ([1, 1, 5, 7], 3),
    ([1, 1, 200, 200], 200),
    ([2, 3, 9, 16], 11),
    ([2, 4, 64, 64], 64),
    ([1, 2, 200, 200], 200),
    ([1, 1, 3, 0], 4),
    ([1, 2, 0, 5], 4),
];

/// Whether `backend` takes a [`PRODUCTS`] case: Flex all (the others' product is their own:
/// NdArray's divides by the zero size of empty matrices, WGPU's software Vulkan takes a minute
/// for the large ones), the others the small ones.
fn takes(backend: &str, ([batch, heads, m, k], n): ([usize; 4], usize)) -> bool {
    backend == "flex" || (1..100_000).contains(&(batch * heads * m * k * n))
}

/// `a` `[B, H, m, k]` and `b` `[B, H, k, n]` of a [`PRODUCTS`] case.
fn operands(([batch, heads, m, k], n): ([usize; 4], usize), device: &Device) -> [Tensor<4>; 2] {
    [
        random([batch, heads, m, k], device),
        random([batch, heads, k, n], device),
    ]
}

/// The ways a product's operands arrive: as they are, stored column after column (the
/// backward's transposed operands), the rows of a block of queries (narrowed), b's columns
/// narrowed (an offset into its storage), b repeated along the batch (stride 0, GQA's repeated
/// keys) and a's heads permuted out of a `[B, m, H, k]` layout (attention's queries).
fn views(a: Tensor<4>, b: Tensor<4>) -> Vec<(&'static str, Tensor<4>, Tensor<4>)> {
    let [batch, heads, m, k] = a.dims();
    let n = b.dims()[3];
    let device = a.device();
    let transposed = |t: &Tensor<4>| {
        let [batch, heads, rows, columns] = t.dims();
        random([batch, heads, columns, rows], &device).swap_dims(2, 3)
    };
    let mut views = vec![
        ("contiguous", a.clone(), b.clone()),
        ("transposed", transposed(&a), transposed(&b)),
        (
            "a's heads permuted",
            random([batch, m, heads, k], &device).swap_dims(1, 2),
            b.clone(),
        ),
    ];
    if k * n > 0 {
        // (`expand` takes no empty dimension.)
        let repeated = random([1, 1, k, n], &device).expand([batch, heads, k, n]);
        views.push(("b repeated along the batch", a.clone(), repeated));
    }
    if m > 1 && k > 0 {
        views.push(("narrowed rows", a.clone().narrow(2, 1, m - 1), b.clone()));
    }
    if n > 1 {
        views.push(("narrowed columns", a.clone(), b.clone().narrow(3, 1, n - 1)));
    }
    views
}

/// [`assert_close`], and for empty tensors (k or m 0) their shapes.
fn close<const D: usize>(what: &str, a: Tensor<D>, b: Tensor<D>, atol: f32, rtol: f32) {
    match b.shape().num_elements() {
        0 => assert_eq!(a.dims(), b.dims(), "{what}"),
        _ => assert_close(what, a, b, atol, rtol),
    }
}

/// `product(a, b)` against Burn's `a.matmul(b)`: on Flex taken (not its fallback) and equal bit
/// for bit (the same gemm calls), elsewhere the backend's own product.
fn check_product<const D: usize>(what: &str, backend: &str, a: Tensor<D>, b: Tensor<D>) {
    if backend == "flex" {
        let taken =
            <Dispatch as ProductOps>::product(a.clone().into_dispatch(), b.clone().into_dispatch());
        assert!(taken.is_some(), "{what}: Flex takes it");
    }
    let theirs = a.clone().matmul(b.clone());
    close(what, product(a, b), theirs, 0.0, 0.0);
}

#[test]
fn product_equals_burns_matmul() {
    for (backend, device) in backends() {
        for case in PRODUCTS.into_iter().filter(|&case| takes(backend, case)) {
            let [a, b] = operands(case, &device);
            for (view, a, b) in views(a, b) {
                check_product(&format!("{backend}: {case:?}, {view}"), backend, a, b);
            }
            let ([batch, heads, m, k], n) = case;
            if m * k * n > 0 {
                // One batch dimension, and 2-D with b a transposed view: a tied head's weight.
                let what = format!("{backend}: {case:?}");
                let a3 = random([batch * heads, m, k], &device);
                let b3 = random([batch * heads, k, n], &device);
                check_product(&format!("{what}, 3-D"), backend, a3, b3);
                let a2 = random([m, k], &device);
                let embedding = random([n, k], &device);
                check_product(
                    &format!("{what}, 2-D, b transposed"),
                    backend,
                    a2,
                    embedding.transpose(),
                );
            }
        }
        // Batch dimensions Burn's product broadcasts are its own.
        let a = random([1, 3, 4, 5], &device);
        let b = random([2, 3, 5, 6], &device);
        let what = format!("{backend}: broadcast batch");
        assert_close(&what, product(a.clone(), b.clone()), a.matmul(b), 0.0, 0.0);
    }
}

#[test]
fn product_gradients_are_burns_under_autodiff() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        for case in PRODUCTS.into_iter().filter(|&case| takes(backend, case)) {
            let [a, b] = operands(case, &device);
            for (view, a, b) in views(a, b) {
                let what = format!("{backend}: {case:?}, {view}");
                let [a, b] = [a, b].map(|t| t.detach().require_grad());
                let weights = random(a.clone().matmul(b.clone()).dims(), &device);
                // Both operands tracked, then each alone (the other's gradient neither kept nor
                // computed).
                for (tracked, a, b) in [
                    ("a and b", a.clone(), b.clone()),
                    ("a", a.clone(), b.clone().detach()),
                    ("b", a.clone().detach(), b.clone()),
                ] {
                    let ours = (product(a.clone(), b.clone()) * weights.clone())
                        .sum()
                        .backward();
                    let theirs = (a.clone().matmul(b.clone()) * weights.clone())
                        .sum()
                        .backward();
                    for (name, x) in [("∂a", &a), ("∂b", &b)] {
                        match (x.grad(&ours), x.grad(&theirs)) {
                            (Some(ours), Some(theirs)) => close(
                                &format!("{what}, {tracked} tracked: {name}"),
                                ours,
                                theirs,
                                1e-4,
                                1e-5,
                            ),
                            (None, None) => {}
                            (ours, theirs) => panic!(
                                "{what}, {tracked} tracked: {name} ours {:?}, Burn's {:?}",
                                ours.map(|g| g.dims()),
                                theirs.map(|g| g.dims())
                            ),
                        }
                    }
                }
            }
            let ([_, _, m, k], n) = case;
            if m * k * n > 0 {
                // A tied head: rows times an embedding's transpose, 2-D.
                let h = random([m, k], &device).require_grad();
                let embedding = random([n, k], &device).require_grad();
                let weights = random([m, n], &device);
                let ours = (product(h.clone(), embedding.clone().transpose()) * weights.clone())
                    .sum()
                    .backward();
                let theirs = (h.clone().matmul(embedding.clone().transpose()) * weights.clone())
                    .sum()
                    .backward();
                for (name, x) in [("∂h", &h), ("∂E", &embedding)] {
                    close(
                        &format!("{backend}: {case:?}, tied head: {name}"),
                        x.grad(&ours).unwrap(),
                        x.grad(&theirs).unwrap(),
                        1e-4,
                        1e-5,
                    );
                }
            }
        }
    }
}

#[test]
fn flex_takes_the_product_in_f32_under_autodiff() {
    let device = Device::flex().autodiff();
    let take = |a: Tensor<4>, b: Tensor<4>| {
        <Dispatch as ProductOps>::product(a.into_dispatch(), b.into_dispatch()).is_some()
    };
    let [a, b] = operands(([2, 3, 9, 16], 11), &device).map(|t| t.require_grad());
    assert!(take(a.clone(), b.clone()), "f32");
    assert!(
        !take(a.clone().cast(DType::BF16), b.clone().cast(DType::BF16)),
        "bf16 is Flex's own product"
    );
    assert!(
        !take(a.narrow(0, 0, 1), b),
        "broadcast batch dimensions are Flex's own product"
    );
}

#[test]
fn sum_of_squares_equals_burns_squares_summed() {
    for (backend, device) in backends() {
        // One element, a tail of sixteen lanes, more than one part of the pass.
        for len in [1, 37, 70_000, 200_003] {
            let x = random([len], &device);
            let what = format!("{backend}: {len}");
            if backend == "flex" {
                let taken = <Dispatch as FusedOps>::sum_of_squares(x.clone().into_dispatch());
                assert!(taken.is_some(), "{what}: Flex takes it");
            }
            let theirs = x.clone().powf_scalar(2.0).sum();
            assert_close(&what, fused::sum_of_squares(x), theirs, 0.0, 1e-5);
        }
    }
    // bf16 is Burn's operations, in f32.
    let x = random([70_000], &Device::flex()).cast(DType::BF16);
    let taken = <Dispatch as FusedOps>::sum_of_squares(x.clone().into_dispatch());
    assert!(taken.is_none(), "bf16 is not Flex's pass");
    let theirs = x.clone().cast(DType::F32).powf_scalar(2.0).sum();
    assert_close("bf16", fused::sum_of_squares(x), theirs, 0.0, 0.0);
}
