//! Gradient arithmetic with PyTorch's meaning: averaging over micro-batches and clipping by the
//! **global** norm of all parameters together (`torch.nn.utils.clip_grad_norm_`). Burn 0.22.1's
//! accumulation sums and its `GradientClipping::Norm` clips each tensor on its own.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use diffzoo_models::fused;

/// Visits every float parameter's gradient.
struct EachGrad<'a, F: FnMut(Tensor<1>) -> Tensor<1>> {
    grads: &'a mut GradientsParams,
    f: F,
}

impl<F: FnMut(Tensor<1>) -> Tensor<1>> ModuleVisitor for EachGrad<'_, F> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(grad) = self.grads.remove::<D>(param.id) {
            let shape = grad.shape();
            let updated = (self.f)(grad.reshape([-1])).reshape(shape);
            self.grads.register::<D>(param.id, updated);
        }
    }
}

/// Applies `f` to every gradient (flattened).
fn map_grads<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    f: impl FnMut(Tensor<1>) -> Tensor<1>,
) {
    model.visit(&mut EachGrad { grads, f });
}

/// Multiplies every gradient by `factor` (1: leaves them as they are, without a pass over them).
pub fn scale<M: Module>(model: &M, grads: &mut GradientsParams, factor: f64) {
    if factor != 1.0 {
        map_grads(model, grads, |g| g.mul_scalar(factor));
    }
}

/// The L2 norm of all gradients together, computed in f32 (each gradient's sum of squares in one
/// pass where the backend has it, [`fused::sum_of_squares`]).
pub fn global_norm<M: Module>(model: &M, grads: &mut GradientsParams) -> f64 {
    let mut total: Option<Tensor<1>> = None;
    map_grads(model, grads, |g| {
        let squares = fused::sum_of_squares(g.clone());
        total = Some(match total.take() {
            Some(t) => t + squares,
            None => squares,
        });
        g
    });
    total.map_or(0.0, |t| t.into_scalar::<f64>().sqrt())
}

/// Scales all gradients so that their global norm is at most `max_norm`, as PyTorch does
/// (`coef = max_norm / (norm + 1e-6)`, applied when below 1). Returns the norm before clipping.
pub fn clip_global_norm<M: Module>(model: &M, grads: &mut GradientsParams, max_norm: f64) -> f64 {
    let norm = global_norm(model, grads);
    clip_to(model, grads, max_norm, norm);
    norm
}

/// Scales gradients whose global norm is `norm` so that it is at most `max_norm`.
pub fn clip_to<M: Module>(model: &M, grads: &mut GradientsParams, max_norm: f64, norm: f64) {
    let coef = max_norm / (norm + 1e-6);
    if max_norm > 0.0 && coef < 1.0 {
        scale(model, grads, coef);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::loss::lm_loss;
    use burn::tensor::{Device, Int, TensorData};
    use diffzoo_datasets::LmBatch;
    use diffzoo_models::{AttentionKind, Model, ModelConfig};

    fn model(device: &Device) -> Model {
        device.seed(1);
        ModelConfig::new(AttentionKind::Diff, 16, 1, 2, 20, 8).init(device)
    }

    fn batch(rows: &[[i64; 5]], device: &Device) -> LmBatch {
        let ids = |range: std::ops::Range<usize>| {
            let v: Vec<i64> = rows
                .iter()
                .flat_map(|r| r[range.clone()].to_vec())
                .collect();
            Tensor::<2, Int>::from_data(TensorData::new(v, [rows.len(), 4]), device)
        };
        LmBatch {
            inputs: ids(0..4),
            targets: ids(1..5),
            scored: None,
        }
    }

    /// Every gradient, flattened, in visiting order.
    fn all(model: &Model, grads: &mut GradientsParams) -> Vec<f32> {
        let mut out = Vec::new();
        map_grads(model, grads, |g| {
            out.extend(g.clone().into_data().try_to_vec::<f32>().unwrap());
            g
        });
        out
    }

    #[test]
    fn averaged_micro_batches_equal_one_large_batch() {
        let device = Device::flex().autodiff();
        let model = model(&device);
        let (a, b) = ([[1, 2, 3, 4, 5]], [[6, 7, 8, 9, 10]]);
        let mut accumulator = burn::optim::GradientsAccumulator::new();
        for rows in [&a, &b] {
            let loss = lm_loss(&model, &batch(rows, &device));
            accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
        }
        let mut averaged = accumulator.grads();
        scale(&model, &mut averaged, 0.5);
        let loss = lm_loss(&model, &batch(&[a[0], b[0]], &device));
        let mut whole = GradientsParams::from_grads(loss.backward(), &model);
        let (x, y) = (all(&model, &mut averaged), all(&model, &mut whole));
        assert_eq!(x.len(), y.len());
        // Equal up to f32 summation order (Flex's kernels may split sums differently).
        for (p, q) in x.iter().zip(&y) {
            assert!((p - q).abs() <= 1e-5 + 1e-4 * q.abs(), "{p} vs {q}");
        }
    }

    /// A loss on scored targets only is the mean negative log-likelihood of those targets: the
    /// same as the full loss with every target scored, and blind to the unscored ones.
    #[test]
    fn a_scored_loss_is_the_mean_over_scored_targets_and_ignores_the_rest() {
        let device = Device::flex();
        let model = model(&device);
        let rows = [[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]];
        let full = lm_loss(&model, &batch(&rows, &device)).into_scalar::<f64>();
        let all_scored = batch(&rows, &device).scoring(&[None, Some(vec![true; 4])]);
        let same = lm_loss(&model, &all_scored).into_scalar::<f64>();
        assert!((full - same).abs() < 1e-6, "{full} vs {same}");
        let flags = [
            Some(vec![false, true, false, false]),
            Some(vec![false, false, false, true]),
        ];
        let scored = lm_loss(&model, &batch(&rows, &device).scoring(&flags)).into_scalar::<f64>();
        let nll = crate::eval::token_nll(
            &model,
            batch(&rows, &device).inputs,
            batch(&rows, &device).targets,
        );
        let nll = crate::eval::f64_values(nll);
        let expected = (nll[1] + nll[7]) / 2.0;
        assert!((scored - expected).abs() < 1e-5, "{scored} vs {expected}");
        // Each window weighs the same: the mean of the windows' means over their scored targets.
        let uneven = [
            Some(vec![true, true, false, false]),
            Some(vec![false, false, false, true]),
        ];
        let loss = lm_loss(&model, &batch(&rows, &device).scoring(&uneven)).into_scalar::<f64>();
        let expected = ((nll[0] + nll[1]) / 2.0 + nll[7]) / 2.0;
        assert!((loss - expected).abs() < 1e-5, "{loss} vs {expected}");
        // Another unscored target (the first row's last) changes nothing.
        let changed = lm_loss(
            &model,
            &batch(&[[1, 2, 3, 4, 9], rows[1]], &device).scoring(&flags),
        )
        .into_scalar::<f64>();
        assert_eq!(scored, changed);
    }

    /// An unscored target gets no gradient: changing it leaves every parameter's gradient as
    /// it was, while changing a scored one does not.
    #[test]
    fn unscored_targets_get_no_gradient() {
        let device = Device::flex().autodiff();
        let model = model(&device);
        let flags = [Some(vec![false, true, false, true])];
        // The inputs stay [1, 2, 3, 4]; only the targets change.
        let grads = |targets: [i64; 4]| {
            let mut micro = batch(&[[1, 2, 3, 4, 5]], &device);
            micro.targets =
                Tensor::<2, Int>::from_data(TensorData::new(targets.to_vec(), [1, 4]), &device);
            let loss = lm_loss(&model, &micro.scoring(&flags));
            all(
                &model,
                &mut GradientsParams::from_grads(loss.backward(), &model),
            )
        };
        let base = grads([2, 3, 4, 5]);
        // Targets 0 and 2 are not scored.
        assert_eq!(grads([9, 3, 11, 5]), base);
        assert_ne!(
            grads([2, 3, 4, 6]),
            base,
            "a scored target moves the gradients"
        );
    }

    /// With scored targets too, micro-batches of equal size averaged equal one large batch.
    #[test]
    fn scored_micro_batches_average_to_one_large_batch() {
        let device = Device::flex().autodiff();
        let model = model(&device);
        let (a, b) = ([[1, 2, 3, 4, 5]], [[6, 7, 8, 9, 10]]);
        let (fa, fb) = (
            Some(vec![true, false, false, true]),
            Some(vec![false, true, false, false]),
        );
        let mut accumulator = burn::optim::GradientsAccumulator::new();
        for (rows, flags) in [(&a, &fa), (&b, &fb)] {
            let micro = batch(rows, &device).scoring(std::slice::from_ref(flags));
            let loss = lm_loss(&model, &micro);
            accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
        }
        let mut averaged = accumulator.grads();
        scale(&model, &mut averaged, 0.5);
        let whole = batch(&[a[0], b[0]], &device).scoring(&[fa, fb]);
        let mut whole = GradientsParams::from_grads(lm_loss(&model, &whole).backward(), &model);
        let (x, y) = (all(&model, &mut averaged), all(&model, &mut whole));
        assert_eq!(x.len(), y.len());
        for (p, q) in x.iter().zip(&y) {
            assert!((p - q).abs() <= 1e-5 + 1e-4 * q.abs(), "{p} vs {q}");
        }
    }

    #[test]
    fn clipping_uses_the_global_norm_of_all_parameters() {
        let device = Device::flex().autodiff();
        let model = model(&device);
        let loss = lm_loss(&model, &batch(&[[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]], &device));
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let before = all(&model, &mut grads);
        let hand = before
            .iter()
            .map(|g| (*g as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!((global_norm(&model, &mut grads) - hand).abs() < 1e-5 * hand);
        let max_norm = hand / 4.0;
        let reported = clip_global_norm(&model, &mut grads, max_norm);
        assert!((reported - hand).abs() < 1e-5 * hand);
        let after = all(&model, &mut grads);
        let coef = max_norm / (hand + 1e-6);
        for (g0, g1) in before.iter().zip(&after) {
            assert!(
                (*g0 as f64 * coef - *g1 as f64).abs() < 1e-6,
                "every tensor scaled by one factor"
            );
        }
        // Below the threshold nothing changes.
        let untouched = clip_global_norm(&model, &mut grads, hand);
        assert!((untouched - max_norm).abs() < 1e-4 * max_norm);
        assert_eq!(all(&model, &mut grads), after);
    }
}
