//! `fused`: RMSNorm, RoPE and SwiGLU's gate in one pass on Flex equal Burn's ops on every backend
//! (RoPE exactly on the CPU backends, RMSNorm and the gate to f32 rounding), for contiguous inputs
//! (the fused pass) and strided ones (Burn's ops), and under autodiff give Burn's gradients (the
//! gate through its own backward on Flex).

mod common;

use burn::nn::{RmsNormConfig, RotaryEncodingConfig};
use burn::tensor::activation::silu;
use burn::tensor::{Device, Distribution, Tensor};
use common::{assert_close, backends};
use diffzoo_models::fused;

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
