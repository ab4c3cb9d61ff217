//! The planner behind `diffzoo recipe show --gpu …`: what a recipe costs before it runs.
//!
//! Memory per device under the recipe's `training.precision`, per parameter ([`state_bytes`]):
//! `f32` keeps f32 weights, gradients and two AdamW moments (4 + 4 + 8 bytes); `bf16-mixed` the
//! bf16 compute copy a step reads, the f32 masters, f32 gradients and f32 moments (2 + 4 + 4 + 8);
//! `bf16-pure` (and `f16-pure`) all of them in 2 bytes (2 + 2 + 4). Then the activations the
//! backward pass keeps for one micro-batch, in 2-byte elements below f32, with and without
//! per-block recomputation. Time from the training FLOPs (`diffzoo_models::budget`) at a stated
//! MFU of the GPU's dense bf16 peak.
//!
//! Activation accounting, per token and layer, in elements of the training dtype (an estimate of
//! what Burn's autodiff keeps for our layers): norms' inputs and outputs `4·d_model`; Q, K, V
//! `q + 2·kv`; their rotated copies `q + kv`; the attention output `d_model`; SwiGLU's gate, its
//! activation, the up projection and their product `4·ffn`. Attention itself keeps, with the
//! explicit path, three S×S tensors per map, `3·maps·S` (softmax's shifted logits and their
//! exponent, and the probabilities the product with V reads; for DIFF V1, `A₁ − λA₂` takes the
//! probabilities' place, measured no larger; the causal mask, one byte per entry shared by the
//! heads, is left out); with the flash path ([`diffzoo_models::attention::flash`]) no map at
//! all, only the output and its row log-sum-exp (f32), `maps·(d_v + 4/b)`. K and V repeated to
//! the query heads are copies where GQA (or, on the flash path, V1's two half-heads reading one
//! V) repeats them; V2's 2H query heads always repeat its H_kv. DIFF V1 adds subln's input and
//! output (`2·d_model`); DIFF V2 adds the paired output (`H·d`). `tests/plan_memory.rs` holds
//! these formulas to what a forward pass keeps in f32 with Burn's operations (on NdArray: Flex's
//! own RMSNorm, RoPE and SwiGLU keep less). The head keeps the final norm
//! (`2·d_model`), the logits and their f32 log-softmax (`vocab·(b + 4)` bytes). With per-block
//! recomputation (`training.recompute = "block"`, [`diffzoo_models::recompute`]) a step keeps every
//! block's input (`d_model` per token and layer) and, at its peak, the larger of the head's
//! backward pass (its activations and one f32 gradient of the logits' size, `4·vocab` bytes) and
//! one block's backward pass: its activations, the gradients its backward pass holds beside them
//! (`2·ffn`, and on the explicit path `2·maps·S`) and the two gradients flowing between blocks
//! (`2·d_model`). Nothing is kept between the passes there, so `tests/plan_memory.rs` holds this to
//! the peak of a whole recomputed backward pass. It costs one more forward pass per step, which the
//! time estimate counts (4/3 of the training FLOPs).
//!
//! A plan only offers what diffzoo can execute: one GPU, or data parallelism on one node (Burn's
//! DDP keeps a whole replica, optimizer state included, on every GPU, and all-reduces each
//! backward pass's gradients in their dtype: f32 under `bf16-mixed`). What fits only with
//! recomputation says so and gives the setting; what would need a sharded optimizer (masters and
//! moments spread over the GPUs, as ZeRO-1 does) is reported as not runnable.

use crate::recipe::{self, Precision, Recipe, Recompute};
use anyhow::{Result, bail};
use diffzoo_models::{AttentionImpl, AttentionKind, ModelConfig};
use serde::Serialize;

/// GPUs of one node, the reach of Burn's DDP.
pub const GPUS_PER_NODE: usize = 8;

/// Usable share of a device's memory (the rest: CUDA context, allocator fragmentation).
pub const USABLE: f64 = 0.9;

/// What a plan that fits only with recomputation tells `train`.
const RECOMPUTE_SET: &str = "--set training.recompute=\"block\"";

/// A GPU: memory and dense bf16 peak.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpu {
    pub name: String,
    pub memory_bytes: f64,
    /// Dense bf16 FLOP/s; unknown for a GPU given by memory alone.
    pub peak_flops: Option<f64>,
}

impl Gpu {
    /// `h100`, `h200`, `a100` (80 GB SXM parts), or a memory size in GB.
    pub fn parse(spec: &str) -> Result<Self> {
        let known = |name: &str, gb: f64, tflops: f64| Gpu {
            name: name.into(),
            memory_bytes: gb * 1e9,
            peak_flops: Some(tflops * 1e12),
        };
        Ok(match spec.to_ascii_lowercase().as_str() {
            "h100" => known("H100 SXM 80GB", 80.0, 989.4),
            "h200" => known("H200 141GB", 141.0, 989.4),
            "a100" => known("A100 SXM 80GB", 80.0, 312.0),
            other => match other.trim_end_matches("gb").parse::<f64>() {
                Ok(gb) if gb > 0.0 => Gpu {
                    name: format!("{gb} GB GPU"),
                    memory_bytes: gb * 1e9,
                    peak_flops: None,
                },
                _ => bail!("--gpu {spec}: expected h100, h200, a100 or a memory size in GB"),
            },
        })
    }
}

/// Bytes per parameter of the state a step holds under `precision`: the weights it computes
/// with, f32 masters (mixed precision's), gradients and AdamW's two moments.
pub fn state_bytes(precision: Precision) -> [f64; 4] {
    match precision {
        Precision::F32 => [4.0, 0.0, 4.0, 8.0],
        Precision::Bf16Mixed => [2.0, 4.0, 4.0, 8.0],
        Precision::Bf16Pure | Precision::F16Pure => [2.0, 0.0, 2.0, 4.0],
    }
}

/// Bytes per device of each kind of state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Memory {
    /// The weights the passes compute with: the model's own, or mixed precision's bf16 copy.
    pub weights: f64,
    /// Mixed precision's f32 master weights (none otherwise).
    pub masters: f64,
    /// The step's gradients, summed over its micro-batches.
    pub gradients: f64,
    pub optimizer: f64,
    /// A micro-batch's own gradients while they are added to the sum, on a device that
    /// accumulates more than one micro-batch per step: the whole model's, or with per-block
    /// recomputation its largest part's (the embedding, the head or a block), as the recipe trains.
    pub accumulating: f64,
    /// The same with per-block recomputation.
    pub accumulating_recomputed: f64,
    /// Activations kept for one micro-batch as the recipe trains (its attention implementation
    /// and `training.recompute`).
    pub activations: f64,
    /// The same with per-block recomputation.
    pub activations_recomputed: f64,
}

impl Memory {
    /// Weights (and masters), gradients and optimizer state.
    pub fn state(&self) -> f64 {
        self.weights + self.masters + self.gradients + self.optimizer
    }

    /// A step's peak as the recipe trains: the state, a micro-batch's gradients being
    /// accumulated and one micro-batch's activations.
    pub fn peak(&self) -> f64 {
        self.state() + self.accumulating + self.activations
    }

    /// The peak with per-block recomputation.
    pub fn peak_recomputed(&self) -> f64 {
        self.state() + self.accumulating_recomputed + self.activations_recomputed
    }

    /// What a sharded optimizer would spread over the GPUs: the moments and the masters.
    fn shardable(&self) -> f64 {
        self.masters + self.optimizer
    }
}

/// How a plan can run, or what it would need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fit {
    /// The whole state and one micro-batch's activations fit one device.
    Fits,
    /// It fits with per-block activation recomputation, which the recipe does not turn on.
    NeedsRecomputation,
    /// It would fit only with recomputation and the optimizer state sharded over this many
    /// devices; diffzoo has no sharded optimizer.
    NeedsSharding(usize),
    /// Weights, gradients and activations, even recomputed, exceed one device.
    Never,
}

/// A recipe's plan on a GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub gpu: Gpu,
    pub mfu: f64,
    /// `training.precision`.
    pub precision: Precision,
    /// Bytes per activation element.
    pub bytes_per_element: usize,
    /// The attention implementation the recipe trains with (`explicit` or `flash`).
    pub attention: String,
    /// Whether the recipe recomputes blocks (`training.recompute = "block"`).
    pub recompute: bool,
    pub memory: Memory,
    pub fit: Fit,
    /// Devices the time is computed for (when it can run).
    pub gpus: usize,
    /// Micro-batches of one optimizer step (data parallelism splits them across the GPUs).
    pub micro_batches: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Whether a micro-batch of one sequence would fit one device (when this one does not).
    pub one_sequence_fits: bool,
    /// How `diffzoo train --devices` runs it on `gpus` GPUs, or why it cannot (none for one).
    pub data_parallel: Option<String>,
    pub training_flops: f64,
    /// `None` when it cannot run (on `gpus` GPUs) or the GPU's peak is unknown.
    pub days: Option<f64>,
    pub gpu_hours: Option<f64>,
}

/// Activation elements per token of one block (see the module documentation), `b` bytes each.
fn block_elements(config: &ModelConfig, seq_len: usize, b: f64) -> f64 {
    let (dm, h, h_kv, d) = (
        config.d_model as f64,
        config.heads as f64,
        config.kv_heads() as f64,
        config.head_dim() as f64,
    );
    let (ffn, s) = (config.ffn_hidden() as f64, seq_len as f64);
    let explicit = !matches!(config.attention_impl, AttentionImpl::Flash { .. });
    let gqa = h > h_kv;
    // Query-side width, the values' width, the copies of K and V that repeating them to the
    // query heads makes (`repeat_kv` with n_rep = 1 returns its input), and what the variant adds.
    let maps = attention_maps(config);
    let (q, kv, d_v, copies, extra) = match config.attention {
        AttentionKind::Transformer => {
            let copies = if gqa { h * d + h * d } else { 0.0 };
            (h * d, h_kv * d, d, copies, 0.0)
        }
        AttentionKind::Diff => {
            // K: 2H' half-heads of d under GQA. V: H' heads of 2d under GQA on the explicit
            // path; on the flash path both half-heads of a head read it, 2H' of 2d.
            let k = if gqa { h * d } else { 0.0 };
            let v = match (explicit, gqa) {
                (false, _) => h * 2.0 * d,
                (true, true) => (h / 2.0) * 2.0 * d,
                (true, false) => 0.0,
            };
            (h * d, h_kv * d, 2.0 * d, k + v, 2.0 * dm)
        }
        // 2H query heads always repeat the H_kv keys and values.
        AttentionKind::DiffV2 => (2.0 * h * d, h_kv * d, d, 4.0 * h * d, h * d),
    };
    let attention = if explicit {
        3.0 * maps * s
    } else {
        // The output and its row log-sum-exp (f32, 4 bytes).
        maps * (d_v + 4.0 / b)
    };
    4.0 * dm + (q + 2.0 * kv) + (q + kv) + copies + attention + dm + 4.0 * ffn + extra
}

/// Attention maps per position of one block: H for the baseline and DIFF V1 (its 2H' = H
/// half-head maps), 2H for DIFF V2.
fn attention_maps(config: &ModelConfig) -> f64 {
    match config.attention {
        AttentionKind::DiffV2 => 2.0 * config.heads as f64,
        AttentionKind::Transformer | AttentionKind::Diff => config.heads as f64,
    }
}

/// What one block's backward pass holds beside its activations, per token, in elements: the
/// gradients of SwiGLU's gate and up projection (`2·ffn`) and, on the explicit path, those of
/// every map's probabilities and logits (dP and dS, `2·maps·S`). Only the recomputed plan counts
/// it: there one block's backward pass is the peak.
fn block_backward_elements(config: &ModelConfig, seq_len: usize) -> f64 {
    let maps = attention_maps(config);
    let explicit = !matches!(config.attention_impl, AttentionImpl::Flash { .. });
    let attention = if explicit {
        2.0 * maps * seq_len as f64
    } else {
        0.0
    };
    2.0 * config.ffn_hidden() as f64 + attention
}

/// Training FLOPs with per-block recomputation over those without: one more forward pass (a
/// third of a training step's FLOPs).
pub const RECOMPUTE_FLOPS: f64 = 4.0 / 3.0;

/// Whether a plan of this fit runs on `gpus` GPUs of one node, its micro-batches shared out.
fn runnable(fit: Fit, gpus: usize, micro_batches: usize) -> bool {
    matches!(fit, Fit::Fits | Fit::NeedsRecomputation)
        && (gpus == 1
            || (gpus <= GPUS_PER_NODE && crate::train::loader::shares(micro_batches, gpus).is_ok()))
}

impl Plan {
    /// Plans `recipe` on `gpu`; `gpus` fixes the device count for the time estimate (default
    /// one).
    pub fn new(recipe: &Recipe, gpu: Gpu, gpus: Option<usize>, mfu: f64) -> Result<Self> {
        if !(mfu > 0.0 && mfu <= 1.0) {
            bail!("--mfu {mfu}: expected a fraction in (0, 1]");
        }
        if gpus == Some(0) {
            bail!("--gpus 0: expected at least one GPU");
        }
        let precision = recipe.training.precision;
        let b = precision.activation_bytes();
        let [weights, masters, gradients, optimizer] = state_bytes(precision);
        let config = recipe.model_config();
        let n = config.param_count().total as f64;
        let tokens = (recipe.training.micro_batch * recipe.data.seq_len) as f64;
        let (dm, vocab, layers) = (
            config.d_model as f64,
            config.vocab_size as f64,
            config.layers as f64,
        );
        let head = tokens * (2.0 * dm * b as f64 + vocab * (b as f64 + 4.0));
        let block = tokens * block_elements(&config, recipe.data.seq_len, b as f64) * b as f64;
        let inputs = tokens * dm * b as f64;
        let backward = tokens * block_backward_elements(&config, recipe.data.seq_len) * b as f64;
        // The head's backward pass holds one f32 gradient of the logits' size at a time.
        let head_backward = tokens * vocab * 4.0;
        let recomputed =
            layers * inputs + (head + head_backward).max(block + backward + 2.0 * inputs);
        let recompute = recipe.training.recompute == Recompute::Block;
        let micro_batches = recipe.accumulation();
        // A device of `gpus` takes its share of the micro-batches (all of them where they do not
        // share out: such a plan cannot run anyway).
        let per_device =
            crate::train::loader::shares(micro_batches, gpus.unwrap_or(1)).unwrap_or(micro_batches);
        let (whole, part) = if per_device > 1 {
            // The recomputed backward passes hand over the head's, each block's and the
            // embedding's gradients one part at a time.
            let embedding = vocab * dm;
            let block_params = (config.param_count().non_embedding as f64 - dm) / layers;
            (n * gradients, embedding.max(block_params) * gradients)
        } else {
            (0.0, 0.0)
        };
        let memory = Memory {
            weights: n * weights,
            masters: n * masters,
            gradients: n * gradients,
            optimizer: n * optimizer,
            accumulating: if recompute { part } else { whole },
            accumulating_recomputed: part,
            activations: if recompute {
                recomputed
            } else {
                layers * block + head
            },
            activations_recomputed: recomputed,
        };
        let usable = gpu.memory_bytes * USABLE;
        let replicated = memory.weights
            + memory.gradients
            + memory.accumulating_recomputed
            + memory.activations_recomputed;
        let fit = if memory.peak() <= usable {
            Fit::Fits
        } else if memory.peak_recomputed() <= usable {
            Fit::NeedsRecomputation
        } else if replicated < usable {
            Fit::NeedsSharding((memory.shardable() / (usable - replicated)).ceil().max(1.0) as usize)
        } else {
            Fit::Never
        };
        let gpus = gpus.unwrap_or(1);
        let runnable = runnable(fit, gpus, micro_batches);
        let training_flops = recipe.derived().training_flops;
        let executed = if recompute || fit == Fit::NeedsRecomputation {
            training_flops * RECOMPUTE_FLOPS
        } else {
            training_flops
        };
        let seconds = gpu
            .peak_flops
            .filter(|_| runnable)
            .map(|peak| executed / (gpus as f64 * peak * mfu));
        let mut plan = Self {
            gpu,
            mfu,
            precision,
            bytes_per_element: b,
            attention: match config.attention_impl {
                AttentionImpl::Flash { .. } => "flash",
                _ => "explicit",
            }
            .into(),
            recompute,
            memory,
            fit,
            gpus,
            micro_batches,
            micro_batch: recipe.training.micro_batch,
            one_sequence_fits: memory.peak() - memory.activations
                + memory.activations / recipe.training.micro_batch as f64
                <= usable,
            training_flops,
            days: seconds.map(|s| s / 86_400.0),
            gpu_hours: seconds.map(|s| s * gpus as f64 / 3_600.0),
            data_parallel: None,
        };
        plan.data_parallel = plan.data_parallel_advice();
        Ok(plan)
    }

    /// Whether `diffzoo train` can run it on `gpus` GPUs.
    pub fn runnable(&self) -> bool {
        runnable(self.fit, self.gpus, self.micro_batches)
    }

    /// How `diffzoo train` runs the plan on several GPUs (nothing for one, or when it cannot run).
    fn data_parallel_advice(&self) -> Option<String> {
        let n = self.gpus;
        if n == 1 || !matches!(self.fit, Fit::Fits | Fit::NeedsRecomputation) {
            return None;
        }
        Some(if n > GPUS_PER_NODE {
            format!(
                "{n} GPUs are more than one node of {GPUS_PER_NODE}: diffzoo's data parallelism (Burn's DDP) runs on one node"
            )
        } else {
            match crate::train::loader::shares(self.micro_batches, n) {
                Ok(each) => format!(
                    "data parallel: train with --devices {}{} ({each} micro-batches per GPU and step, each all-reducing {:.1} GB of {} gradients)",
                    (0..n)
                        .map(|i| format!("cuda:{i}"))
                        .collect::<Vec<_>>()
                        .join(","),
                    if self.fit == Fit::NeedsRecomputation {
                        format!(" {RECOMPUTE_SET}")
                    } else {
                        String::new()
                    },
                    self.memory.gradients / 1e9,
                    self.gradient_dtype(),
                ),
                Err(e) => format!("{e}; choose a --gpus that divides {}", self.micro_batches),
            }
        })
    }

    /// The dtype gradients are kept and all-reduced in.
    fn gradient_dtype(&self) -> &'static str {
        match self.precision {
            Precision::F32 | Precision::Bf16Mixed => "f32",
            Precision::Bf16Pure => "bf16",
            Precision::F16Pure => "f16",
        }
    }

    /// The plan as text lines for `recipe show`.
    pub fn lines(&self) -> Vec<String> {
        let gb = |x: f64| x / 1e9;
        let m = &self.memory;
        let name = &self.gpu.name;
        let grads = self.gradient_dtype();
        let mut lines = vec![match self.precision {
            Precision::Bf16Mixed => format!(
                "memory per device (bf16-mixed): bf16 weights {:.1} GB, f32 masters {:.1} GB, f32 gradients {:.1} GB, f32 AdamW state {:.1} GB",
                gb(m.weights),
                gb(m.masters),
                gb(m.gradients),
                gb(m.optimizer)
            ),
            precision => format!(
                "memory per device ({}): weights, gradients and AdamW state in {grads}: {:.1} GB, {:.1} GB, {:.1} GB{}",
                precision.name(),
                gb(m.weights),
                gb(m.gradients),
                gb(m.optimizer),
                match precision {
                    Precision::Bf16Pure => {
                        " (no f32 masters: an update under 2⁻⁹ of its weight rounds away; training.precision = \"bf16-mixed\" keeps them)"
                    }
                    Precision::F16Pure => {
                        " (no f32 masters and no loss scaling: an update under 2⁻¹² of its weight rounds away and small gradients underflow)"
                    }
                    Precision::F32 | Precision::Bf16Mixed => "",
                }
            ),
        }];
        if m.accumulating > 0.0 {
            lines[0].push_str(&format!(
                "; {:.1} GB more while a micro-batch's gradients are added to the step's ({} micro-batches per device{})",
                gb(m.accumulating),
                self.micro_batches / self.gpus.max(1),
                if self.recompute {
                    ", one part at a time with blocks recomputed"
                } else {
                    ""
                }
            ));
        }
        lines.push(format!(
            "activations per micro-batch ({}-byte elements, {} attention{}): {:.1} GB{}",
            self.bytes_per_element,
            self.attention,
            if self.recompute {
                ", blocks recomputed"
            } else {
                ""
            },
            gb(m.activations),
            if self.recompute {
                String::new()
            } else {
                format!(
                    " ({:.1} GB with blocks recomputed)",
                    gb(m.activations_recomputed)
                )
            }
        ));
        let usable = gb(self.gpu.memory_bytes * USABLE);
        let needed = gb(m.peak());
        lines.push(match self.fit {
            Fit::Fits => format!("fits one {name} ({needed:.1} of {usable:.0} GB usable)"),
            Fit::NeedsRecomputation => format!(
                "fits one {name} only with per-block recomputation: {:.1} of {usable:.0} GB usable with training.recompute = \"block\" ({needed:.1} GB without; train with {RECOMPUTE_SET}){}",
                gb(m.peak_recomputed()),
                if self.micro_batch > 1 && self.one_sequence_fits {
                    "; or training.micro_batch = 1, which fits without it"
                } else {
                    ""
                }
            ),
            Fit::NeedsSharding(n) => format!(
                "diffzoo cannot train this: it needs {needed:.1} GB on one {name} ({usable:.0} GB usable), and would fit only with blocks recomputed and the {} sharded over {n} of them; diffzoo has no sharded optimizer (Burn's DDP keeps a whole replica on every GPU)",
                if m.masters > 0.0 {
                    "f32 masters and AdamW state"
                } else {
                    "AdamW state"
                }
            ),
            Fit::Never => format!(
                "diffzoo cannot train this: on one {name} ({usable:.0} GB usable) weights, gradients and activations alone do not fit even with per-block recomputation"
            ),
        });
        lines.extend(self.data_parallel.clone());
        lines.push(match (self.days, self.gpu_hours) {
            (Some(days), Some(hours)) => format!(
                "{:.3e} training FLOPs: {days:.1} days on {} × {} at {:.0}% MFU ({hours:.0} GPU-hours){}",
                self.training_flops,
                self.gpus,
                self.gpu.name,
                self.mfu * 100.0,
                if self.recompute || self.fit == Fit::NeedsRecomputation {
                    ", counting the forward pass recomputation repeats"
                } else {
                    ""
                }
            ),
            _ if !matches!(self.fit, Fit::Fits | Fit::NeedsRecomputation) => format!(
                "{:.3e} training FLOPs (no time estimate: no way to run it above)",
                self.training_flops
            ),
            _ if self.gpu.peak_flops.is_some() => format!(
                "{:.3e} training FLOPs (no time estimate for {} GPUs: see above)",
                self.training_flops, self.gpus
            ),
            _ => format!(
                "{:.3e} training FLOPs (give a known --gpu for a time estimate)",
                self.training_flops
            ),
        });
        lines
    }
}

/// `diffzoo recipe show`, with a plan when given (GPU, device count, MFU).
pub fn show(
    name: &str,
    overrides: &[String],
    plan: Option<(String, Option<usize>, f64)>,
    json: bool,
) -> Result<()> {
    let resolved = recipe::resolve(name, overrides)?;
    let derived = resolved.recipe.derived();
    let plan = plan
        .map(|(gpu, gpus, mfu)| Plan::new(&resolved.recipe, Gpu::parse(&gpu)?, gpus, mfu))
        .transpose()?;
    if json {
        let out = serde_json::json!({
            "name": resolved.name,
            "source": resolved.source.to_string(),
            "recipe": resolved.recipe,
            "derived": derived,
            "plan": plan,
            "notes": resolved.notes,
            "warnings": resolved.recipe.missing_paths(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("# {} ({})", resolved.name, resolved.source);
    for note in &resolved.notes {
        println!("# {note}");
    }
    for missing in resolved.recipe.missing_paths() {
        println!("# warning: {missing}");
    }
    println!("{}", resolved.recipe.to_toml());
    println!("# derived");
    println!(
        "# parameters: {} total, {} non-embedding, {} in the paper's convention",
        derived.params_total, derived.params_non_embedding, derived.params_paper
    );
    println!(
        "# {} steps × {} tokens = {} tokens; {} sequences per step in {} micro-batches",
        derived.steps,
        resolved.recipe.training.batch_tokens,
        derived.tokens,
        derived.batch_sequences,
        derived.accumulation
    );
    println!(
        "# training FLOPs: {:.3e} per token, {:.3e} for the run",
        derived.training_flops_per_token, derived.training_flops
    );
    let seeds = &resolved.recipe.training.seeds;
    if !seeds.is_empty() {
        println!(
            "# trained once per seed (`training.seeds`): {} runs, each with the numbers above{}",
            seeds.len(),
            if plan.is_some() { " and below" } else { "" }
        );
    }
    for line in plan.iter().flat_map(|p| p.lines()) {
        println!("# {line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::resolve;

    /// A recipe fuzzer: every key of three valid recipes set to values of the wrong type, out
    /// of range or absurdly large, removed, and joined by an unknown sibling. Nothing may panic
    /// (resolving, deriving the numbers `recipe show` prints, planning on a GPU); each refusal
    /// names the key that was changed (in full, `section.key`, unless it was removed), and a
    /// number made negative, NaN or −∞ is always refused.
    #[test]
    fn mutated_recipes_never_panic_and_each_refusal_names_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let bad = [
            "\"x\"",
            "-1",
            "0",
            "1e300",
            "nan",
            "-inf",
            "true",
            "[1]",
            "18446744073709551615",
            "4294967296",
            "1000000000000000000",
        ];
        let (mut tried, mut refused) = (0, 0);
        let mut check = |name: &str, overrides: &[String], key: &str, must_fail: bool| {
            // A removed key may be named as serde names a missing field: by its last part.
            let removed = overrides.is_empty();
            tried += 1;
            let outcome = std::panic::catch_unwind(|| {
                let resolved = resolve(name, overrides)?;
                resolved.recipe.derived();
                Plan::new(&resolved.recipe, Gpu::parse("h100")?, None, 0.4)?;
                Ok::<_, anyhow::Error>(())
            });
            let what = format!("{name} {overrides:?} (`{key}`)");
            match outcome {
                Err(_) => panic!("{what}: panicked"),
                Ok(Ok(())) => assert!(!must_fail, "{what}: accepted"),
                Ok(Err(e)) => {
                    refused += 1;
                    let message = format!("{e:#}");
                    let last = format!("`{}`", key.rsplit('.').next().unwrap());
                    let named = message.contains(&format!("`{key}`"))
                        || (removed && message.contains(&last));
                    assert!(named, "{what}: {message}");
                }
            }
        };
        for name in ["micro", "tiny", "paper/size-scaling/830m-diff"] {
            let recipe = resolve(name, &[]).unwrap().recipe;
            let table: toml::Table = recipe.to_toml().parse().unwrap();
            for (section, entries) in &table {
                let Some(entries) = entries.as_table() else {
                    continue;
                };
                for (key, original) in entries {
                    let path = format!("{section}.{key}");
                    let numeric = original.is_integer() || original.is_float();
                    for value in bad {
                        let must_fail = numeric && matches!(value, "-1" | "nan" | "-inf");
                        check(name, &[format!("{path}={value}")], &path, must_fail);
                    }
                    let unknown = format!("{section}.{key}_typo");
                    check(name, &[format!("{unknown}=1")], &unknown, true);
                    let mut without = table.clone();
                    without[section].as_table_mut().unwrap().remove(key);
                    let file = dir
                        .path()
                        .join(format!("{}-{section}-{key}.toml", name.replace('/', "_")));
                    std::fs::write(&file, toml::to_string(&without).unwrap()).unwrap();
                    check(file.to_str().unwrap(), &[], &path, false);
                }
            }
        }
        assert!(
            tried >= 1000 && refused >= 800,
            "{tried} tried, {refused} refused"
        );
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    fn plan(name: &str, overrides: &[&str], gpu: &str, gpus: Option<usize>) -> Plan {
        let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
        let recipe = resolve(name, &overrides).unwrap().recipe;
        Plan::new(&recipe, Gpu::parse(gpu).unwrap(), gpus, 0.4).unwrap()
    }

    #[test]
    fn plan_830m_matches_hand_arithmetic() {
        let flash = plan("paper/size-scaling/830m-transformer", &[], "h100", None);
        // N = 24·(4·1536² + 3·1536·4096 + 2·1536) + 1536 + 2·100288·1536.
        let n = 24.0 * (4.0 * 1536.0f64.powi(2) + 3.0 * 1536.0 * 4096.0 + 2.0 * 1536.0)
            + 1536.0
            + 2.0 * 100_288.0 * 1536.0;
        // bf16-mixed: the bf16 compute copy, f32 masters, f32 gradients, two f32 moments.
        let m = &flash.memory;
        assert_eq!(flash.precision, Precision::Bf16Mixed);
        assert!(close(m.weights, 2.0 * n) && close(m.masters, 4.0 * n));
        assert!(close(m.gradients, 4.0 * n) && close(m.optimizer, 8.0 * n));
        assert!(close(m.state(), 18.0 * n));
        // 32 micro-batches a step: a micro-batch's f32 gradients beside the step's sum, or with
        // blocks recomputed those of its largest part, the 100,288 × 1,536 embedding; none on
        // 32 GPUs of one micro-batch each.
        assert!(close(m.accumulating, 4.0 * n));
        assert!(close(m.accumulating_recomputed, 4.0 * 100_288.0 * 1536.0));
        let one_each = plan("paper/size-scaling/830m-transformer", &[], "h100", Some(32));
        assert_eq!(one_each.memory.accumulating, 0.0);
        // Per token and layer: norms 4·1536, Q K V 3·1536, rotated Q K 2·1536, attention output
        // 1536, SwiGLU 4·4096 elements; attention at 2,048 positions (flash by default): the
        // output and L (f32: two bf16 elements) of 16 heads of 96 (MHA: K and V are not copied),
        // or the explicit path's 3·16·2048 map entries.
        let shared = 4.0 * 1536.0 + 3.0 * 1536.0 + 2.0 * 1536.0 + 1536.0 + 4.0 * 4096.0;
        let tokens = 4.0 * 2048.0; // micro-batches of 4 sequences
        let head = tokens * (2.0 * 1536.0 * 2.0 + 100_288.0 * 6.0);
        assert_eq!(flash.attention, "flash");
        let block = shared + 16.0 * (96.0 + 2.0);
        assert!(close(
            flash.memory.activations,
            24.0 * tokens * block * 2.0 + head
        ));
        // Recomputed: the 24 block inputs and the larger of the head's backward pass (with an
        // f32 gradient of its 100,288-wide logits) and one block's (its activations, SwiGLU's
        // two gradients, the two gradients between blocks); here the head's.
        let inputs = tokens * 1536.0 * 2.0;
        let head_backward = head + tokens * 100_288.0 * 4.0;
        assert!(head_backward > tokens * (block + 2.0 * 4096.0) * 2.0 + 2.0 * inputs);
        assert!(close(
            flash.memory.activations_recomputed,
            24.0 * inputs + head_backward
        ));
        let explicit = plan(
            "paper/size-scaling/830m-transformer",
            &["model.attention_impl=\"explicit\""],
            "h100",
            None,
        );
        assert_eq!(explicit.attention, "explicit");
        let block = shared + 3.0 * 16.0 * 2048.0;
        assert!(close(
            explicit.memory.activations,
            24.0 * tokens * block * 2.0 + head
        ));
        // With its 18 bytes per parameter the explicit path's maps outgrow one H100 by 2 GB.
        assert_eq!(flash.fit, Fit::Fits, "{:?}", flash.lines());
        assert_eq!(explicit.fit, Fit::NeedsRecomputation);
        assert!(explicit.lines()[2].contains("or training.micro_batch = 1"));
        // 6·N_matmul + attention, over 40,000 × 262,144 tokens, on one H100 at 40% of 989.4 TFLOP/s.
        let linear = 24.0 * (4.0 * 1536.0f64.powi(2) + 3.0 * 1536.0 * 4096.0) + 1536.0 * 100_288.0;
        let per_token = 3.0 * (2.0 * linear + 24.0 * 2.0 * 2048.0 * (2.0 * 1536.0));
        let flops = per_token * 40_000.0 * 262_144.0;
        assert!(close(flash.training_flops, flops));
        assert!(close(
            flash.days.unwrap(),
            flops / (989.4e12 * 0.4) / 86_400.0
        ));
    }

    #[test]
    fn a_plan_on_several_gpus_gives_the_data_parallel_command_when_it_can_run() {
        let line = |gpus| {
            let plan = plan(
                "paper/size-scaling/830m-transformer",
                &[],
                "h100",
                Some(gpus),
            );
            assert_eq!(
                plan.micro_batches, 32,
                "128 sequences in micro-batches of 4"
            );
            plan.data_parallel
        };
        assert_eq!(line(1), None);
        let gradients = plan("paper/size-scaling/830m-transformer", &[], "h100", None)
            .memory
            .gradients;
        assert_eq!(
            line(4).unwrap(),
            format!(
                "data parallel: train with --devices cuda:0,cuda:1,cuda:2,cuda:3 (8 micro-batches per GPU and step, each all-reducing {:.1} GB of f32 gradients)",
                gradients / 1e9
            )
        );
        assert!(
            line(3).unwrap().contains("32 micro-batches"),
            "{:?}",
            line(3)
        );
        assert!(line(16).unwrap().contains("more than one node"));
        let recipe = resolve("paper/size-scaling/830m-transformer", &[])
            .unwrap()
            .recipe;
        assert!(Plan::new(&recipe, Gpu::parse("h100").unwrap(), Some(0), 0.4).is_err());
        let three_b = plan("paper/3b/diff-360b", &[], "h200", Some(8));
        assert!(
            three_b.data_parallel.unwrap().contains("--devices cuda:0"),
            "flash attention makes the 3B fit an H200, so DDP runs it"
        );
    }

    #[test]
    fn the_3b_fits_one_h200_in_mixed_precision_and_an_h100_only_in_pure_bf16() {
        let flash = plan("paper/3b/diff-360b", &[], "h200", Some(8));
        // N = 28·(4·3072² + 3·3072·8192 + 2·3072 + 6·128) + 3072 + 2·100288·3072.
        let n = 28.0
            * (4.0 * 3072.0f64.powi(2) + 3.0 * 3072.0 * 8192.0 + 2.0 * 3072.0 + 6.0 * 128.0)
            + 3072.0
            + 2.0 * 100_288.0 * 3072.0;
        let m = &flash.memory;
        // bf16-mixed: 2 + 4 + 4 + 8 bytes per parameter.
        assert!(close(m.state(), 18.0 * n));
        // Per token and layer: norms 4·3072, Q K V 3·3072, rotated 2·3072, output 3072, SwiGLU
        // 4·8192, subln 2·3072, and flash's copy of V for both half-heads (24 × 256), output and L
        // (f32) of 24 half-heads (24 × (256 + 2)).
        let block = 4.0 * 3072.0
            + 3.0 * 3072.0
            + 2.0 * 3072.0
            + 3072.0
            + 4.0 * 8192.0
            + 2.0 * 3072.0
            + 24.0 * 256.0
            + 24.0 * (256.0 + 2.0);
        let head = 4096.0 * (2.0 * 3072.0 * 2.0 + 100_288.0 * 6.0);
        assert!(close(m.activations, 28.0 * 4096.0 * block * 2.0 + head));
        assert_eq!(flash.fit, Fit::Fits, "{:?}", flash.lines());
        let per_token = flash_recipe_flops();
        let flops = per_token * 85_831.0 * 4_194_304.0;
        assert!(close(flash.training_flops, flops));
        assert!(close(
            flash.gpu_hours.unwrap(),
            flops / (989.4e12 * 0.4) / 3600.0
        ));
        assert!(close(
            flash.days.unwrap() * 8.0 * 24.0,
            flash.gpu_hours.unwrap()
        ));
        // No time for device counts diffzoo cannot run: beyond one node, or not dividing the
        // step's micro-batches.
        for gpus in [64, 3] {
            let plan = plan("paper/3b/diff-360b", &[], "h200", Some(gpus));
            assert!(plan.days.is_none(), "{gpus}: {:?}", plan.lines());
            assert!(!plan.lines().iter().any(|l| l.contains("days on")));
        }

        // On an H100 (72 GB usable) 18·N = 68.2 GB leaves no room even for recomputed
        // activations; a sharded optimizer over two would (the masters and moments halved).
        let h100 = plan("paper/3b/diff-360b", &[], "h100", Some(8));
        assert_eq!(h100.fit, Fit::NeedsSharding(2), "{:?}", h100.lines());
        assert!(h100.lines()[2].contains("f32 masters and AdamW state sharded over 2"));
        assert_no_time_for_what_cannot_run(&h100);
        // Pure bf16 (8·N) fits it: the configuration whose updates round away at the schedule's
        // end, which the plan says.
        let pure = plan(
            "paper/3b/diff-360b",
            &["training.precision=\"bf16-pure\""],
            "h100",
            Some(8),
        );
        assert!(close(pure.memory.state(), 8.0 * n));
        assert_eq!(pure.fit, Fit::Fits);
        assert!(
            pure.lines()[0].contains("no f32 masters"),
            "{:?}",
            pure.lines()
        );

        // The explicit path keeps 2·24 maps of 4,096² per layer: it needs recomputation, which
        // the plan names, and it times the forward pass recomputation repeats.
        let explicit = plan(
            "paper/3b/diff-360b",
            &["model.attention_impl=\"explicit\""],
            "h200",
            Some(8),
        );
        assert_eq!(explicit.fit, Fit::NeedsRecomputation);
        assert!(explicit.runnable());
        let lines = explicit.lines();
        assert!(
            lines[2].contains("only with per-block recomputation")
                && lines[2].contains("--set training.recompute=\"block\""),
            "{lines:?}"
        );
        assert!(
            explicit
                .data_parallel
                .as_deref()
                .is_some_and(|l| l.contains("--devices cuda:0") && l.contains(RECOMPUTE_SET)),
            "{lines:?}"
        );
        assert!(close(
            explicit.gpu_hours.unwrap(),
            RECOMPUTE_FLOPS * flops / (989.4e12 * 0.4) / 3600.0
        ));
    }

    /// Bytes per parameter by hand for each precision, and `training.dtype`, the old name,
    /// planned as what it maps to.
    #[test]
    fn each_precision_counts_its_own_state() {
        let n = plan("paper/size-scaling/830m-transformer", &[], "h100", None)
            .memory
            .weights
            / 2.0;
        for (precision, bytes, element) in [
            ("f32", [4.0, 0.0, 4.0, 8.0], 4),
            ("bf16-mixed", [2.0, 4.0, 4.0, 8.0], 2),
            ("bf16-pure", [2.0, 0.0, 2.0, 4.0], 2),
            ("f16-pure", [2.0, 0.0, 2.0, 4.0], 2),
        ] {
            let set = format!("training.precision=\"{precision}\"");
            let p = plan("paper/size-scaling/830m-transformer", &[&set], "h100", None);
            let m = &p.memory;
            assert_eq!(p.precision.name(), precision);
            assert_eq!(
                [m.weights, m.masters, m.gradients, m.optimizer].map(|x| x / n),
                bytes,
                "{precision}"
            );
            assert_eq!(p.bytes_per_element, element, "{precision}");
        }
        let legacy = plan(
            "paper/size-scaling/830m-transformer",
            &["training.dtype=\"bf16\""],
            "h100",
            None,
        );
        assert_eq!(legacy.precision, Precision::Bf16Pure);
    }

    fn flash_recipe_flops() -> f64 {
        let recipe = resolve("paper/3b/diff-360b", &[]).unwrap().recipe;
        recipe.model_config().flops_per_token(4096).training
    }

    /// A plan that cannot run says so and gives no time or command for it.
    fn assert_no_time_for_what_cannot_run(plan: &Plan) {
        let lines = plan.lines();
        assert!(
            plan.days.is_none() && plan.data_parallel.is_none(),
            "{lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.contains("diffzoo cannot train this")),
            "{lines:?}"
        );
        assert!(!lines.iter().any(|l| l.contains("days on")), "{lines:?}");
    }

    #[test]
    fn plans_say_what_they_need_and_time_only_what_can_run() {
        // 64K context: flash keeps no maps, but 28 layers of 65,536 tokens outgrow an H200
        // unless blocks are recomputed, which the recipe does; in bf16-mixed its 18 bytes per
        // parameter beside them need the optimizer sharded over two.
        let long = plan("paper/3b/diff-64k", &[], "h200", None);
        assert_eq!(long.attention, "flash");
        assert!(long.recompute);
        assert_eq!(long.fit, Fit::NeedsSharding(2), "{:?}", long.lines());
        assert_no_time_for_what_cannot_run(&long);
        // In pure bf16 it fits, as it did before mixed precision.
        let long = plan(
            "paper/3b/diff-64k",
            &["training.precision=\"bf16-pure\""],
            "h200",
            None,
        );
        assert_eq!(long.fit, Fit::Fits, "{:?}", long.lines());
        // By hand: 28 block inputs of 65,536 × 3,072 bf16 values, and the head's backward pass
        // (final norm, logits and f32 log-softmax, and an f32 gradient of the logits), which
        // outweighs one block's.
        let t = 65_536.0;
        let inputs = 28.0 * t * 3072.0 * 2.0;
        let head = t * (2.0 * 3072.0 * 2.0 + 100_288.0 * 6.0) + t * 100_288.0 * 4.0;
        assert!(close(long.memory.activations, inputs + head));
        assert!(long.lines()[1].contains("blocks recomputed"));
        assert!(long.days.is_some());
        let kept = plan(
            "paper/3b/diff-64k",
            &[
                "training.recompute=\"none\"",
                "training.precision=\"bf16-pure\"",
            ],
            "h200",
            None,
        );
        assert_eq!(kept.fit, Fit::NeedsRecomputation, "{:?}", kept.lines());
        assert!(kept.memory.activations > 4.0 * kept.memory.activations_recomputed);
        assert!(close(kept.days.unwrap(), long.days.unwrap()));

        // 13.1B in bf16-mixed needs 18 bytes per parameter: on an H200 a sharded optimizer
        // (masters and moments spread), which Burn's DDP does not do; on an H100 its bf16
        // weights and f32 gradients alone outgrow one. No "days on 4 × …" after "cannot train".
        for gpus in [None, Some(4)] {
            let big = plan("paper/size-scaling/13.1b-transformer", &[], "h200", gpus);
            let Fit::NeedsSharding(n) = big.fit else {
                panic!("{:?}", big.lines())
            };
            let usable = 141e9 * USABLE;
            let m = &big.memory;
            let replicated =
                m.weights + m.gradients + m.accumulating_recomputed + m.activations_recomputed;
            let sharded = m.masters + m.optimizer;
            assert!(n > 1);
            assert!(replicated + sharded / n as f64 <= usable);
            assert!(replicated + sharded / (n - 1) as f64 > usable);
            assert_no_time_for_what_cannot_run(&big);
            let h100 = plan("paper/size-scaling/13.1b-transformer", &[], "h100", gpus);
            assert_eq!(h100.fit, Fit::Never, "{:?}", h100.lines());
            assert_no_time_for_what_cannot_run(&h100);
        }
        assert!(Gpu::parse("big").is_err());
        assert_eq!(Gpu::parse("48").unwrap().peak_flops, None);
    }
}
