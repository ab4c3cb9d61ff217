//! The planner behind `diffzoo recipe show --gpu …`: what a recipe costs before it runs.
//!
//! Memory per device under Burn 0.22.1's precision policy (no autocast: with `bf16` the weights,
//! gradients and both AdamW moments are bf16; with `f32` all are f32), plus the activations the
//! backward pass keeps for one micro-batch, with and without gradient checkpointing. Time from
//! the training FLOPs (`diffzoo_models::budget`) at a stated MFU of the GPU's dense bf16 peak.
//!
//! Activation accounting, per token and layer, in elements of the training dtype (an estimate of
//! what Burn's autodiff keeps for our layers; full S×S maps, no flash attention under autodiff):
//! norms' inputs and outputs `4·d_model`; Q, K, V `q + 2·kv`; their rotated copies `q + kv`;
//! attention logits and probabilities `2·maps·S`; the attention output `d_model`; SwiGLU's gate,
//! its activation, the up projection and their product `4·ffn`. DIFF V1 adds `A₁ − λA₂` (`H'·S`)
//! and subln's input and output (`2·d_model`); DIFF V2 adds the paired output (`H·d`). The head
//! keeps the final norm (`2·d_model`), the logits and their f32 log-softmax (`vocab·(b + 4)` bytes).
//! With gradient checkpointing each block keeps only its input (`d_model`) and one block's
//! activations are live again during its recomputation.

use crate::recipe::Recipe;
use anyhow::{Result, bail};
use diffzoo_models::{AttentionKind, ModelConfig};
use serde::Serialize;

/// GPUs of one node, the reach of Burn's DDP.
pub const GPUS_PER_NODE: usize = 8;

/// Usable share of a device's memory (the rest: CUDA context, allocator fragmentation).
pub const USABLE: f64 = 0.9;

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

/// Bytes per device of each kind of state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Memory {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer: f64,
    /// Activations kept for one micro-batch without gradient checkpointing.
    pub activations: f64,
    /// The same with per-block gradient checkpointing.
    pub activations_checkpointed: f64,
}

/// A recipe's plan on a GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub gpu: Gpu,
    pub mfu: f64,
    pub bytes_per_element: usize,
    pub memory: Memory,
    /// Whole state replicated on each device (data parallel, as Burn's DDP), with per-block
    /// recomputation when that is what makes it fit: does one device hold it?
    pub fits_replicated: bool,
    pub needs_checkpointing: bool,
    /// Smallest device count that holds it with the optimizer state sharded across devices
    /// (Burn's `MultiDeviceOptim::OptimSharded`); `None` when even that cannot.
    pub min_gpus_sharded: Option<usize>,
    /// Devices the time is computed for.
    pub gpus: usize,
    /// Micro-batches of one optimizer step (data parallelism splits them across the GPUs).
    pub micro_batches: usize,
    /// How `diffzoo train --devices` runs it on `gpus` GPUs, or why it cannot (none for one).
    pub data_parallel: Option<String>,
    pub training_flops: f64,
    pub days: Option<f64>,
    pub gpu_hours: Option<f64>,
}

/// Activation elements per token of one block (see the module documentation).
fn block_elements(config: &ModelConfig, seq_len: usize) -> f64 {
    let (dm, h, h_kv, d) = (
        config.d_model as f64,
        config.heads as f64,
        config.kv_heads() as f64,
        config.head_dim() as f64,
    );
    let (ffn, s) = (config.ffn_hidden() as f64, seq_len as f64);
    let (q, kv, maps, extra) = match config.attention {
        AttentionKind::Transformer => (h * d, h_kv * d, h, 0.0),
        AttentionKind::Diff => (h * d, h_kv * d, h, (h / 2.0) * s + 2.0 * dm),
        AttentionKind::DiffV2 => (2.0 * h * d, h_kv * d, 2.0 * h, h * d),
    };
    4.0 * dm + (q + 2.0 * kv) + (q + kv) + 2.0 * maps * s + dm + 4.0 * ffn + extra
}

impl Plan {
    /// Plans `recipe` on `gpu`; `gpus` fixes the device count for the time estimate (default:
    /// one if it fits replicated, else the sharded minimum).
    pub fn new(recipe: &Recipe, gpu: Gpu, gpus: Option<usize>, mfu: f64) -> Result<Self> {
        if !(mfu > 0.0 && mfu <= 1.0) {
            bail!("--mfu {mfu}: expected a fraction in (0, 1]");
        }
        if gpus == Some(0) {
            bail!("--gpus 0: expected at least one GPU");
        }
        let b = match recipe.training.dtype.as_str() {
            "f32" => 4,
            _ => 2,
        };
        let config = recipe.model_config();
        let n = config.param_count().total as f64;
        let tokens = (recipe.training.micro_batch * recipe.data.seq_len) as f64;
        let (dm, vocab, layers) = (
            config.d_model as f64,
            config.vocab_size as f64,
            config.layers as f64,
        );
        let head = tokens * (2.0 * dm * b as f64 + vocab * (b as f64 + 4.0));
        let block = tokens * block_elements(&config, recipe.data.seq_len) * b as f64;
        let memory = Memory {
            weights: n * b as f64,
            gradients: n * b as f64,
            optimizer: 2.0 * n * b as f64,
            activations: layers * block + head,
            activations_checkpointed: layers * tokens * dm * b as f64 + block + head,
        };
        let usable = gpu.memory_bytes * USABLE;
        let state = memory.weights + memory.gradients + memory.optimizer;
        let fits_plain = state + memory.activations <= usable;
        let fits_checkpointed = state + memory.activations_checkpointed <= usable;
        let replicated = memory.weights + memory.gradients + memory.activations_checkpointed;
        let min_gpus_sharded = (replicated < usable)
            .then(|| (memory.optimizer / (usable - replicated)).ceil().max(1.0) as usize);
        let gpus = gpus.unwrap_or(if fits_plain || fits_checkpointed {
            1
        } else {
            min_gpus_sharded.unwrap_or(1)
        });
        let training_flops = recipe.derived().training_flops;
        let seconds = gpu
            .peak_flops
            .map(|peak| training_flops / (gpus as f64 * peak * mfu));
        let mut plan = Self {
            gpu,
            mfu,
            bytes_per_element: b,
            memory,
            fits_replicated: fits_plain || fits_checkpointed,
            needs_checkpointing: !fits_plain && fits_checkpointed,
            min_gpus_sharded,
            gpus,
            micro_batches: recipe.accumulation(),
            training_flops,
            days: seconds.map(|s| s / 86_400.0),
            gpu_hours: seconds.map(|s| s * gpus as f64 / 3_600.0),
            data_parallel: None,
        };
        plan.data_parallel = plan.data_parallel_advice();
        Ok(plan)
    }

    /// How `diffzoo train` runs the plan on several GPUs (nothing for one).
    fn data_parallel_advice(&self) -> Option<String> {
        let n = self.gpus;
        if n == 1 {
            return None;
        }
        Some(if !self.fits_replicated {
            format!(
                "diffzoo trains on several GPUs with Burn's DDP, which keeps the whole optimizer state on every GPU: it cannot train this on {} GPUs",
                self.gpu.name
            )
        } else if self.needs_checkpointing {
            "diffzoo's data parallelism (Burn's DDP) keeps a whole replica on every GPU, which fits only with the recomputation above".into()
        } else if n > GPUS_PER_NODE {
            format!(
                "{n} GPUs are more than one node of {GPUS_PER_NODE}: diffzoo's data parallelism (Burn's DDP) runs on one node"
            )
        } else {
            match crate::train::loader::shares(self.micro_batches, n) {
                Ok(each) => format!(
                    "data parallel: train with --devices {} ({each} micro-batches per GPU and step)",
                    (0..n)
                        .map(|i| format!("cuda:{i}"))
                        .collect::<Vec<_>>()
                        .join(",")
                ),
                Err(e) => format!("{e}: change `training.micro_batch`"),
            }
        })
    }

    /// The plan as text lines for `recipe show`.
    pub fn lines(&self) -> Vec<String> {
        let gb = |x: f64| x / 1e9;
        let m = &self.memory;
        let mut lines = vec![
            format!(
                "memory per device ({}-byte elements): weights {:.1} GB, gradients {:.1} GB, AdamW state {:.1} GB",
                self.bytes_per_element,
                gb(m.weights),
                gb(m.gradients),
                gb(m.optimizer)
            ),
            format!(
                "activations per micro-batch: {:.1} GB, {:.1} GB with per-block recomputation",
                gb(m.activations),
                gb(m.activations_checkpointed)
            ),
        ];
        let usable = gb(self.gpu.memory_bytes * USABLE);
        lines.push(match (self.fits_replicated, self.needs_checkpointing, self.min_gpus_sharded) {
            (true, false, _) => format!("fits one {} ({usable:.0} GB usable)", self.gpu.name),
            (true, true, _) => format!(
                "fits one {} ({usable:.0} GB usable) only with per-block activation recomputation, which diffzoo does not offer yet: lower training.micro_batch",
                self.gpu.name
            ),
            (false, _, Some(n)) => format!(
                "does not fit one {} ({usable:.0} GB usable); with the optimizer state sharded it needs {n} GPUs",
                self.gpu.name
            ),
            (false, _, None) => format!(
                "does not fit a {} even with the optimizer state sharded: weights, gradients and activations alone exceed {usable:.0} GB",
                self.gpu.name
            ),
        });
        lines.extend(self.data_parallel.clone());
        lines.push(match (self.days, self.gpu_hours) {
            (Some(days), Some(hours)) => format!(
                "{:.3e} training FLOPs: {days:.1} days on {} × {} at {:.0}% MFU ({hours:.0} GPU-hours)",
                self.training_flops,
                self.gpus,
                self.gpu.name,
                self.mfu * 100.0
            ),
            _ => format!("{:.3e} training FLOPs (give a known --gpu for a time estimate)", self.training_flops),
        });
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::resolve;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn plan_830m_matches_hand_arithmetic() {
        let recipe = resolve("paper/size-scaling/830m-transformer", &[])
            .unwrap()
            .recipe;
        let plan = Plan::new(&recipe, Gpu::parse("h100").unwrap(), None, 0.4).unwrap();
        // N = 24·(4·1536² + 3·1536·4096 + 2·1536) + 1536 + 2·100288·1536.
        let n = 24.0 * (4.0 * 1536.0f64.powi(2) + 3.0 * 1536.0 * 4096.0 + 2.0 * 1536.0)
            + 1536.0
            + 2.0 * 100_288.0 * 1536.0;
        assert!(close(plan.memory.weights, 2.0 * n));
        assert!(close(plan.memory.optimizer, 4.0 * n));
        // Per token and layer: norms 4·1536, Q K V 3·1536, rotated Q K 2·1536, maps 2·16·2048,
        // attention output 1536, SwiGLU 4·4096 elements.
        let block = 4.0 * 1536.0
            + 3.0 * 1536.0
            + 2.0 * 1536.0
            + 2.0 * 16.0 * 2048.0
            + 1536.0
            + 4.0 * 4096.0;
        let tokens = 4.0 * 2048.0; // micro-batches of 4 sequences
        let head = tokens * (2.0 * 1536.0 * 2.0 + 100_288.0 * 6.0);
        assert!(close(
            plan.memory.activations,
            24.0 * tokens * block * 2.0 + head
        ));
        assert!(close(
            plan.memory.activations_checkpointed,
            24.0 * tokens * 1536.0 * 2.0 + tokens * block * 2.0 + head
        ));
        assert!(plan.fits_replicated, "{:?}", plan.lines());
        // 6·N_matmul + attention, over 40,000 × 262,144 tokens, on one H100 at 40% of 989.4 TFLOP/s.
        let linear = 24.0 * (4.0 * 1536.0f64.powi(2) + 3.0 * 1536.0 * 4096.0) + 1536.0 * 100_288.0;
        let per_token = 3.0 * (2.0 * linear + 24.0 * 2.0 * 2048.0 * (2.0 * 1536.0));
        let flops = per_token * 40_000.0 * 262_144.0;
        assert!(close(plan.training_flops, flops));
        assert!(close(
            plan.days.unwrap(),
            flops / (989.4e12 * 0.4) / 86_400.0
        ));
    }

    #[test]
    fn a_plan_on_several_gpus_gives_the_data_parallel_command_when_it_can_run() {
        let recipe = resolve("paper/size-scaling/830m-transformer", &[])
            .unwrap()
            .recipe;
        let line = |gpus| {
            let plan = Plan::new(&recipe, Gpu::parse("h100").unwrap(), Some(gpus), 0.4).unwrap();
            assert_eq!(
                plan.micro_batches, 32,
                "128 sequences in micro-batches of 4"
            );
            plan.data_parallel
        };
        assert_eq!(line(1), None);
        assert_eq!(
            line(4).unwrap(),
            "data parallel: train with --devices cuda:0,cuda:1,cuda:2,cuda:3 (8 micro-batches per GPU and step)"
        );
        assert!(
            line(3).unwrap().contains("32 micro-batches"),
            "{:?}",
            line(3)
        );
        assert!(line(16).unwrap().contains("more than one node"));
        assert!(Plan::new(&recipe, Gpu::parse("h100").unwrap(), Some(0), 0.4).is_err());
        let three_b = resolve("paper/3b/diff-360b", &[]).unwrap().recipe;
        let plan = Plan::new(&three_b, Gpu::parse("h100").unwrap(), Some(8), 0.4).unwrap();
        assert!(plan.needs_checkpointing);
        assert!(
            plan.data_parallel
                .unwrap()
                .contains("only with the recomputation")
        );
    }

    #[test]
    fn plan_3b_and_13b_size_their_clusters() {
        let recipe = resolve("paper/3b/diff-360b", &[]).unwrap().recipe;
        let plan = Plan::new(&recipe, Gpu::parse("h100").unwrap(), Some(64), 0.4).unwrap();
        // N = 28·(4·3072² + 3·3072·8192 + 2·3072 + 6·128) + 3072 + 2·100288·3072, in bf16.
        let n = 28.0
            * (4.0 * 3072.0f64.powi(2) + 3.0 * 3072.0 * 8192.0 + 2.0 * 3072.0 + 6.0 * 128.0)
            + 3072.0
            + 2.0 * 100_288.0 * 3072.0;
        assert!(close(
            plan.memory.weights + plan.memory.gradients + plan.memory.optimizer,
            8.0 * n
        ));
        // Per token and layer: norms 4·3072, Q K V 3·3072, rotated 2·3072, maps 2·24·4096,
        // output 3072, SwiGLU 4·8192, and DIFF's A₁ − λA₂ 12·4096 and subln 2·3072.
        let block = 4.0 * 3072.0
            + 3.0 * 3072.0
            + 2.0 * 3072.0
            + 2.0 * 24.0 * 4096.0
            + 3072.0
            + 4.0 * 8192.0
            + 12.0 * 4096.0
            + 2.0 * 3072.0;
        let head = 4096.0 * (2.0 * 3072.0 * 2.0 + 100_288.0 * 6.0);
        assert!(close(
            plan.memory.activations,
            28.0 * 4096.0 * block * 2.0 + head
        ));
        assert!(
            plan.fits_replicated && plan.needs_checkpointing,
            "the 3B at 4,096 keeps S×S maps: one H100 only with recomputation"
        );
        let h200 = Plan::new(&recipe, Gpu::parse("h200").unwrap(), None, 0.4).unwrap();
        assert!(h200.fits_replicated && !h200.needs_checkpointing);
        let per_token = recipe.model_config().flops_per_token(4096).training;
        let flops = per_token * 85_831.0 * 4_194_304.0;
        assert!(close(plan.training_flops, flops));
        assert!(close(
            plan.gpu_hours.unwrap(),
            flops / (989.4e12 * 0.4) / 3600.0
        ));
        assert!(close(
            plan.days.unwrap() * 64.0 * 24.0,
            plan.gpu_hours.unwrap()
        ));

        let big = resolve("paper/size-scaling/13.1b-transformer", &[])
            .unwrap()
            .recipe;
        let plan = Plan::new(&big, Gpu::parse("h100").unwrap(), None, 0.4).unwrap();
        assert!(
            !plan.fits_replicated,
            "13.1B in bf16 with AdamW needs 16 bytes per parameter"
        );
        let n = plan
            .min_gpus_sharded
            .expect("fits with a sharded optimizer");
        assert!(n > 1);
        assert_eq!(plan.gpus, n);
        let usable = 80e9 * USABLE;
        let replicated =
            plan.memory.weights + plan.memory.gradients + plan.memory.activations_checkpointed;
        assert!(replicated + plan.memory.optimizer / n as f64 <= usable);
        assert!(replicated + plan.memory.optimizer / (n - 1) as f64 > usable);
        assert!(plan.lines().iter().any(|l| l.contains("cannot train this")));
        assert!(Gpu::parse("big").is_err());
        assert_eq!(Gpu::parse("48").unwrap().peak_flops, None);
    }
}
