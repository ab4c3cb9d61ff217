//! From a pretrained baseline Transformer to DIFF: every attention layer replaced, every other
//! weight carried over exactly (embedding, the blocks' norms, SwiGLU, the final norm, the head).
//!
//! The source has H query heads q_j, H_kv key/value heads k_g, v_g of width d, GQA groups of
//! n = H/H_kv query heads, and an output projection W_o whose input columns `[j·d, (j+1)·d)` read
//! head j (q_j is the j-th block of d rows of W_q, its bias rows with it).
//!
//! **DIFF V2** (2H query heads paired as (2h, 2h+1), the source's K and V): [`Init::Copy`]
//!
//! ```text
//! q_{2h} = q_{2h+1} = q_h      both maps of pair h are the source head's: o_{2h} = o_{2h+1} = o_h
//! W_λ = 0                      λ_{t,h} = sigmoid(0) = ½
//! W_o' = 2·W_o                 out_h = o_h − ½·o_h = ½·o_h, doubled: the source's output exactly
//! ```
//!
//! With a warm-up of the negative map (`lambda_scale` rising from 0, [`Options::warmup`]) W_o is
//! kept instead: at scale 0, `out_h = o_h`, the source exactly, and the subtracted half comes in
//! as the scale rises. [`Init::Perturbed`] adds `ε ~ N(0, (noise·rms(W_q))²)` to every q_{2h+1}
//! row, so that the two maps of a pair start apart (the model is then the source only
//! approximately).
//!
//! **DIFF V1** (H/2 heads in GQA groups of n; H_kv/2 kv heads, each with two key halves and one
//! value of width 2d): [`Init::Paired`], head h of kv group g = h div n, i = h mod n:
//!
//! ```text
//! Q₁ = q_{2g·n+i},   Q₂ = q_{(2g+1)·n+i}      each half reads the kv head its source head read:
//! K₁ = k_{2g},       K₂ = k_{2g+1}             a pair is two heads of two neighbouring GQA groups
//! V  = [v_{2g}; v_{2g+1}]                      (2d wide)
//! W_o' columns of head h = [W_o columns of Q₁'s source head; those of Q₂'s]
//! λ_q1, λ_k1, λ_q2, λ_k2 ~ N(0, 0.1²), λ_init, subln = 1     (the paper's initialisation)
//! ```
//!
//! Every source row is used once (MHA: head h pairs source heads 2h and 2h+1). Exactness is not
//! possible in V1's parameter-matched layout: head h computes
//! `(1 − λ_init)·subln((A₁ − λA₂)·[v_{2g}; v_{2g+1}])` where the source computed
//! `[A₁·v_{2g}; A₂·v_{2g+1}]` (one value of width 2d is read by both maps, and subln rescales).
//! Fine-tuning recovers what this loses; a warm-up of λ from 0 starts from `A₁` alone.

use crate::attention::{Attention, DiffAttention, DiffV2Attention, TransformerAttention};
use crate::config::{AttentionKind, ModelConfig};
use crate::model::Model;
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{Distribution, Int, Tensor, TensorData};

/// How the new attention's weights are made from the source's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// DIFF V2: the second query head of each pair a copy of the first (exact).
    Copy,
    /// DIFF V2: [`Init::Copy`] with the second query head perturbed by `noise` times the
    /// RMS of the layer's query weights.
    Perturbed { noise: f64 },
    /// DIFF V1: the source's heads paired within neighbouring GQA groups.
    Paired,
}

impl Init {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Copy => "copy",
            Self::Perturbed { .. } => "perturbed",
            Self::Paired => "paired",
        }
    }

    /// The initialisations a conversion to `kind` offers, the first its default.
    pub fn offered(kind: AttentionKind) -> &'static [&'static str] {
        match kind {
            AttentionKind::DiffV2 => &["copy", "perturbed"],
            AttentionKind::Diff => &["paired"],
            AttentionKind::Transformer => &[],
        }
    }
}

/// A conversion.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    pub to: AttentionKind,
    pub init: Init,
    /// The converted model will train with a warm-up of its negative map from scale 0
    /// (`lambda_scale`): DIFF V2 keeps W_o, so that it is the source at the warm-up's start.
    pub warmup: bool,
}

/// The source's configuration with its attention replaced, or why the source's heads cannot be
/// converted (naming the recipe keys).
pub fn converted_config(source: &ModelConfig, to: AttentionKind) -> Result<ModelConfig, String> {
    if source.attention != AttentionKind::Transformer {
        return Err(format!(
            "the source's `model.attention` is \"{}\": convert takes a baseline Transformer",
            source.attention
        ));
    }
    if to == AttentionKind::Transformer {
        return Err("converting to \"transformer\" changes nothing: choose diff or diff-v2".into());
    }
    let (heads, kv_heads) = (source.heads, source.kv_heads());
    if to == AttentionKind::Diff && !(heads.is_multiple_of(2) && kv_heads.is_multiple_of(2)) {
        // The even kv counts on either side of the source's, with its groups of n.
        let n = heads / kv_heads;
        let below = (kv_heads / 2 * 2).max(2);
        let above = below + 2;
        return Err(format!(
            "`model.heads` = {heads} and `model.kv_heads` = {kv_heads}: DIFF V1 pairs the heads of \
             neighbouring GQA groups, so both must be even (in groups of {n}: {} and {below}, or \
             {} and {above}); DIFF V2 pairs any count (--to diff-v2)",
            below * n,
            above * n,
        ));
    }
    let mut config = source.clone();
    config.attention = to;
    config.validate()?;
    Ok(config)
}

/// The source model with every attention layer converted as `options` say (see the module
/// documentation); the new attention's other parameters (V1's λ vectors) come from
/// `converted_config(..).init(device)`, i.e. from the device's seed.
pub fn convert(
    source: &Model,
    source_config: &ModelConfig,
    options: Options,
) -> Result<Model, String> {
    let config = converted_config(source_config, options.to)?;
    let valid = Init::offered(options.to).contains(&options.init.name());
    if !valid {
        return Err(format!(
            "--init {} does not convert to {}: choose {}",
            options.init.name(),
            options.to,
            Init::offered(options.to).join(" or ")
        ));
    }
    let device = source.embed.weight.val().device();
    let mut target = config.init(&device);
    target.embed = source.embed.clone();
    target.norm = source.norm.clone();
    target.lm_head = source.lm_head.clone();
    let d = config.head_dim();
    for (to, from) in target.blocks.iter_mut().zip(&source.blocks) {
        to.attn_norm = from.attn_norm.clone();
        to.ffn_norm = from.ffn_norm.clone();
        to.ffn = from.ffn.clone();
        let Attention::Transformer(a) = &from.attn else {
            return Err("the source's attention is not a baseline Transformer's".into());
        };
        match &mut to.attn {
            Attention::DiffV2(b) => to_v2(a, b, d, options),
            Attention::Diff(b) => to_v1(a, b, d),
            Attention::Transformer(_) => unreachable!("converted_config refuses the baseline"),
        }
    }
    Ok(target)
}

fn to_v2(a: &TransformerAttention, b: &mut DiffV2Attention, d: usize, options: Options) {
    // Query heads 2h and 2h+1 are source head h.
    let pairs: Vec<usize> = (0..2 * a.heads).map(|i| i / 2).collect();
    b.q_proj = outputs(&a.q_proj, &heads_rows(&pairs, d));
    if let Init::Perturbed { noise } = options.init {
        let w = b.q_proj.weight.val();
        let rms = w.clone().square().mean().sqrt().into_scalar::<f64>();
        // Noise on the second head of every pair: columns [(2h+1)·d, (2h+2)·d) of W_q.
        let mask: Vec<f32> = (0..2 * a.heads * d).map(|c| ((c / d) % 2) as f32).collect();
        let mask = Tensor::<1>::from_data(TensorData::new(mask, [2 * a.heads * d]), &w.device())
            .unsqueeze::<2>();
        let eps = Tensor::<2>::random(
            w.dims(),
            Distribution::Normal(0.0, noise * rms),
            &w.device(),
        );
        b.q_proj.weight = Param::from_tensor(w + eps * mask);
    }
    b.k_proj = a.k_proj.clone();
    b.v_proj = a.v_proj.clone();
    let scale = if options.warmup { 1.0 } else { 2.0 };
    b.o_proj = a.o_proj.clone();
    b.o_proj.weight = Param::from_tensor(a.o_proj.weight.val().mul_scalar(scale));
    b.lambda_proj.weight = Param::from_tensor(b.lambda_proj.weight.val().zeros_like());
}

fn to_v1(a: &TransformerAttention, b: &mut DiffAttention, d: usize) {
    let order = v1_query_heads(a.heads, a.kv_heads);
    b.q_proj = outputs(&a.q_proj, &heads_rows(&order, d));
    // Key half-head 2g + c and value half g·2 + c are source kv head 2g + c: the order is kept.
    b.k_proj = a.k_proj.clone();
    b.v_proj = a.v_proj.clone();
    b.o_proj = a.o_proj.clone();
    b.o_proj.weight = Param::from_tensor(select(a.o_proj.weight.val(), 0, &heads_rows(&order, d)));
}

/// DIFF V1's query half-heads (2h + c for head h, c = 0, 1) as source query heads: head h of
/// group g = h div n, i = h mod n, takes source heads 2g·n + i and (2g+1)·n + i.
pub fn v1_query_heads(heads: usize, kv_heads: usize) -> Vec<usize> {
    let n = heads / kv_heads;
    (0..heads / 2)
        .flat_map(|h| {
            let (g, i) = (h / n, h % n);
            [2 * g * n + i, (2 * g + 1) * n + i]
        })
        .collect()
}

/// The rows (features) of heads of width `d`, in the order of `heads`.
fn heads_rows(heads: &[usize], d: usize) -> Vec<usize> {
    heads.iter().flat_map(|&h| h * d..(h + 1) * d).collect()
}

/// A copy of `linear` whose output feature k is its feature `rows[k]` (bias too).
fn outputs(linear: &Linear, rows: &[usize]) -> Linear {
    let mut out = linear.clone();
    out.weight = Param::from_tensor(select(linear.weight.val(), 1, rows));
    out.bias = linear
        .bias
        .as_ref()
        .map(|b| Param::from_tensor(select(b.val(), 0, rows)));
    out
}

/// `x` with its entries along `dim` taken at `index`.
fn select<const D: usize>(x: Tensor<D>, dim: usize, index: &[usize]) -> Tensor<D> {
    let index: Vec<i64> = index.iter().map(|&i| i as i64).collect();
    let len = index.len();
    let index = Tensor::<1, Int>::from_data(TensorData::new(index, [len]), &x.device());
    x.select(dim, index)
}
