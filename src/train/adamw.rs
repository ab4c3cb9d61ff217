//! AdamW whose update is one pass over each parameter on Flex ([`diffzoo_models::fused::adamw`]).
//!
//! Burn 0.22.1's `AdamW` updates a parameter in fifteen tensor operations, each a pass over
//! parameter-sized tensors: at a 135M model's shape on a 2-core CPU that was 0.67 s of a 4.8 s
//! training step. This optimizer computes the same numbers — the same operations in the same order,
//! so each result is rounded as Burn rounds it — in one pass, and keeps Burn's state
//! (`AdamWState`), so checkpoints of either optimizer resume with the other. A parameter's first
//! step (no moments yet) is Burn's own.

use burn::optim::{AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, LearningRate, Optimizer};
use burn::tensor::{Device, Tensor};
use diffzoo_models::fused::{self, AdamWStep};

/// AdamW (decoupled weight decay; Loshchilov & Hutter, 2019) without AMSGrad or cautious decay
/// (a state's AMSGrad maximum, which Burn's `AdamW` without AMSGrad never makes, is kept as it is).
#[derive(Clone)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// Burn's, for a parameter's first step.
    first: AdamW,
}

impl FusedAdamW {
    pub fn new(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f32) -> Self {
        let first = AdamWConfig::new()
            .with_beta_1(beta_1)
            .with_beta_2(beta_2)
            .with_epsilon(epsilon)
            .with_weight_decay(weight_decay)
            .build();
        Self {
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
            first,
        }
    }
}

impl Optimizer for FusedAdamW {
    type State<const D: usize> = AdamWState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let Some(AdamWState { momentum }) = state else {
            return self.first.step(lr, tensor, grad, None);
        };
        let AdaptiveMomentumState {
            time,
            moment_1,
            moment_2,
            max_moment_2,
        } = momentum;
        let time = time + 1;
        // As Burn computes them: the corrections in f32, the decay rate in f64.
        let decay_rate = lr * self.weight_decay as f64;
        let step = AdamWStep {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            correction_1: 1f32 - self.beta_1.powi(time as i32),
            correction_2: 1f32 - self.beta_2.powi(time as i32),
            keep: (1.0 - decay_rate) as f32,
            lr: lr as f32,
        };
        let shape = tensor.shape();
        let flat = |t: Tensor<D>| t.reshape([-1]);
        let (p, m, v) = fused::adamw(
            flat(tensor),
            flat(grad),
            flat(moment_1),
            flat(moment_2),
            step,
        );
        let momentum = AdaptiveMomentumState {
            time,
            moment_1: m.reshape(shape.clone()),
            moment_2: v.reshape(shape.clone()),
            max_moment_2,
        };
        (p.reshape(shape), Some(AdamWState { momentum }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdamW::to_device(state, device)
    }
}

#[cfg(test)]
mod tests {
    use super::FusedAdamW;
    use burn::optim::{AdamWConfig, AdamWState, Optimizer};
    use burn::tensor::{Device, Distribution, Tensor};

    /// Five steps of both optimizers from the same parameter and gradients: the same bits, on
    /// Flex (one pass) and NdArray (Burn's operations), with and without decay, for a tensor
    /// longer than one part of the pass and a short one, with every other gradient transposed
    /// (strided).
    #[test]
    fn equals_burns_adamw_bit_for_bit() {
        let mut devices = vec![Device::flex()];
        // NdArray is deprecated upstream in favour of Flex; here it stands for every backend that
        // takes Burn's operations.
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)]
        devices.push(Device::ndarray());
        for device in devices {
            for (weight_decay, lr) in [(0.1f32, 3e-3), (0.0, 1e-2)] {
                for shape in [[300, 200], [7, 5]] {
                    let ours = FusedAdamW::new(0.9, 0.95, 1e-8, weight_decay);
                    let theirs = AdamWConfig::new()
                        .with_beta_1(0.9)
                        .with_beta_2(0.95)
                        .with_epsilon(1e-8)
                        .with_weight_decay(weight_decay)
                        .build();
                    let p = Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), &device);
                    let (mut a, mut b) = (p.clone(), p);
                    let (mut state_a, mut state_b): (Option<AdamWState<2>>, _) = (None, None);
                    for t in 0..5 {
                        let normal = Distribution::Normal(0.0, 1.0);
                        let g = match t % 2 {
                            0 => Tensor::<2>::random(shape, normal, &device),
                            _ => Tensor::random([shape[1], shape[0]], normal, &device)
                                .swap_dims(0, 1),
                        };
                        (a, state_a) = ours.step(lr, a, g.clone(), state_a);
                        (b, state_b) = theirs.step(lr, b, g, state_b);
                        let what = format!("{device:?}, decay {weight_decay}, {shape:?}, step {t}");
                        a.clone()
                            .into_data()
                            .assert_eq(&b.clone().into_data(), true);
                        let (ma, mb) = (
                            &state_a.as_ref().unwrap().momentum,
                            &state_b.as_ref().unwrap().momentum,
                        );
                        assert_eq!(ma.time, mb.time, "{what}");
                        ma.moment_1
                            .clone()
                            .into_data()
                            .assert_eq(&mb.moment_1.clone().into_data(), true);
                        ma.moment_2
                            .clone()
                            .into_data()
                            .assert_eq(&mb.moment_2.clone().into_data(), true);
                    }
                }
            }
        }
    }
}
