//! The language-modelling loss of a batch: what a training step minimises, validation reports and
//! the gradient tests check.

use burn::tensor::{DType, Tensor};
use diffzoo_datasets::LmBatch;
use diffzoo_models::cross_entropy::cross_entropy;
use diffzoo_models::{Model, target_log_probs};

/// Mean next-token cross-entropy of a batch, in f32 whatever the model's dtype. With scored
/// targets (`LmBatch::scored`, e.g. recall answers only) each window's loss is the mean over its
/// scored targets and the batch's the mean over windows: every window weighs the same, whatever
/// the micro-batch size, and with every target scored this is the plain mean (windows have one
/// length).
pub fn lm_loss(model: &Model, batch: &LmBatch) -> Tensor<1> {
    batch_loss(model.forward(batch.inputs.clone()), batch)
}

/// [`lm_loss`] of the model's `logits` for `batch`.
pub(super) fn batch_loss(logits: Tensor<3>, batch: &LmBatch) -> Tensor<1> {
    let logits = logits.cast(DType::F32);
    if let Some(scored) = &batch.scored {
        let scored = scored.clone().cast(DType::F32);
        let nll = target_log_probs(logits, batch.targets.clone()).neg();
        let per_window = (nll * scored.clone()).sum_dim(1) / scored.sum_dim(1);
        return per_window.mean();
    }
    let [b, s, v] = logits.dims();
    cross_entropy(
        logits.reshape([b * s, v]),
        batch.targets.clone().reshape([b * s]),
    )
}
