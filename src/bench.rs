//! `diffzoo bench`: what a forward pass and a training step cost, per backend and attention
//! variant, and against PyTorch eager on the same machine.
//!
//! Each (device, variant) is measured in a fresh child process, so that its peak memory is its
//! own: the model is built from one seed, then `--reps` training steps and `--reps` forward
//! passes are timed after `--warmup` untimed ones each, and the medians reported. A step is the
//! trainer's: forward, mean cross-entropy (f32), backward, gradients clipped to global norm 1,
//! AdamW with the default optimizer settings, the loss read back, the device synchronised. A
//! forward pass runs without autodiff and reads back one number. Each step is also timed in three
//! phases, the device synchronised between them (forward and backward with the loss read back,
//! clipping, the optimizer), and their medians printed under the table, PyTorch's beside ours.
//!
//! Peak memory during the steps: the largest reservation of the device allocator seen after each
//! step where the backend reports one (CubeCL backends), otherwise on CPU devices the growth of
//! the process's peak resident set (Linux `VmHWM`, reset through `/proc/self/clear_refs`) over its
//! size before the model was built, and no figure for LibTorch on CUDA. Children run with
//! `RAYON_NUM_THREADS` and `OMP_NUM_THREADS` (LibTorch's) set to the thread count PyTorch gets.
//! `bench/torch_reference.py` measures PyTorch the same way; `--torch` runs it with the same
//! shapes and thread count and prints diffzoo / PyTorch ratios, the reference's forward pass
//! checked against transformers' own class on the same shape ([`reference`]).
//!
//! Each figure comes with the spread of its repetitions and the CPU time other processes took
//! while it was measured; the report names the CPU and warns where a figure should not be
//! believed ([`trust`]).

mod profile;
mod reference;
mod roofline;

use crate::device;
use crate::plan::Gpu;
use crate::recipe::{self, OptimizerSection, Recompute};
use crate::train::{self, grads, step};
use crate::trust::{self, Cpu, Figure, LoadProbe, Spread, median};
use anyhow::{Context, Result, anyhow, bail};
use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, FloatDType};
use clap::Args;
use diffzoo_datasets::{LmBatch, LmBatcher, Rng};
use diffzoo_models::profile as clock;
use diffzoo_models::{AttentionImpl, AttentionKind, DEFAULT_ATTENTION_BLOCK, Model, ModelConfig};
use profile::StepProfile;
use roofline::Roofline;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Devices to measure, comma-separated (the strings `train --device` takes).
    #[arg(long = "device", value_delimiter = ',', default_value = "cpu")]
    pub devices: Vec<String>,
    /// Attention variants, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "transformer,diff,diff-v2"
    )]
    pub attention: Vec<AttentionKind>,
    /// The model: `D_MODELxLAYERSxHEADS` (the baseline's heads, e.g. 256x4x4), a recipe name or
    /// a run directory (an imported Hugging Face model's, say), whose model's sizes are used
    /// (vocabulary, kv heads, FFN size, head_dim, q/k/v biases and tied embeddings included; the
    /// attention variant comes from --attention).
    #[arg(long, default_value = "256x4x4")]
    pub size: String,
    /// Sequence length.
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Vocabulary size (with a `D_MODELxLAYERSxHEADS` size).
    #[arg(long, default_value_t = 4096)]
    pub vocab: usize,
    /// The baseline's key/value heads (GQA; default: as many as heads).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Float dtype: f32, bf16 or f16 (where the device supports it).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Untimed repetitions before timing.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Timed repetitions; the median is reported.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// How attention is computed: `explicit` (matmul + softmax maps), `fused` (Burn's attention
    /// op; training steps fall back to the explicit maps under autodiff) or `flash` (blocks of
    /// --attention-block with their own backward: memory grows with S, not S²).
    #[arg(long, default_value = "explicit", value_parser = ["explicit", "fused", "flash"])]
    pub attention_impl: String,
    /// Positions per query and key block of `--attention-impl flash`.
    #[arg(long, default_value_t = DEFAULT_ATTENTION_BLOCK)]
    pub attention_block: usize,
    /// `block`: training steps recompute each block in the backward pass (`training.recompute`).
    #[arg(long, default_value = "none", value_parser = ["none", "block"])]
    pub recompute: String,
    /// A GPU (h100, h200, a100) whose dense bf16 peak turns training FLOP/s into MFU.
    #[arg(long)]
    pub gpu: Option<String>,
    /// Also measure PyTorch eager (bench/torch_reference.py) and print diffzoo / PyTorch ratios;
    /// the reference's forward pass is checked against transformers' own class on the same shape.
    #[arg(long)]
    pub torch: bool,
    /// Also measure the machine's limits on the first device — matmul peak in f32 and bf16
    /// (PyTorch's too with --torch) and read bandwidth — and give each step's share of the peak.
    #[arg(long)]
    pub roofline: bool,
    /// PyTorch's attention: `sdpa` (scaled_dot_product_attention, what users run) or
    /// `explicit` (matmul + softmax maps, the algorithm Burn's autodiff runs).
    #[arg(long, default_value = "sdpa", value_parser = ["sdpa", "explicit"])]
    pub torch_attention: String,
    /// Python with torch installed (default: $DIFFZOO_PYTHON, else target/torch-venv/bin/python
    /// as `bash bench/setup` makes it, else python3).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Also break a training step's forward and backward passes, and a decoding step, into
    /// classes of operation (matmul, attention, norm, rotary, activation, embedding, loss, other),
    /// PyTorch's beside ours with --torch; CPU devices only (see `src/bench/profile.rs`). In f32
    /// on a device that reads bf16 weights the decoding step is also profiled with bf16 weight
    /// matrices, as `generate --dtype bf16` decodes.
    #[arg(long)]
    pub profile: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Measure one device and variant and print its JSON (how the parent runs each).
    #[arg(long, hide = true)]
    pub child: bool,
}

impl BenchArgs {
    /// `--attention-impl` with its block size.
    fn implementation(&self) -> AttentionImpl {
        match self.attention_impl.as_str() {
            "fused" => AttentionImpl::Fused,
            "flash" => AttentionImpl::Flash {
                block: self.attention_block,
            },
            _ => AttentionImpl::Explicit,
        }
    }

    /// `--recompute`.
    fn recompute(&self) -> Recompute {
        match self.recompute.as_str() {
            "block" => Recompute::Block,
            _ => Recompute::None,
        }
    }
}

/// The model shape a bench measures, for every variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Shape {
    pub d_model: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: Option<usize>,
    pub vocab: usize,
    /// SwiGLU hidden size (`None`: the default, 8·d_model/3).
    pub ffn_dim: Option<usize>,
    pub tie_embeddings: bool,
    /// Width of a head (`None`: d_model / heads).
    pub head_dim: Option<usize>,
    pub qkv_bias: bool,
}

impl Shape {
    /// `D_MODELxLAYERSxHEADS` with `vocab` and `kv_heads`, or the model of the recipe or run
    /// directory named.
    pub fn parse(spec: &str, vocab: usize, kv_heads: Option<usize>) -> Result<Self> {
        let numbers: Vec<Option<usize>> = spec.split('x').map(|n| n.parse().ok()).collect();
        if let [Some(d_model), Some(layers), Some(heads)] = numbers[..] {
            return Ok(Self {
                d_model,
                layers,
                heads,
                kv_heads,
                vocab,
                ffn_dim: None,
                tie_embeddings: false,
                head_dim: None,
                qkv_bias: false,
            });
        }
        let model = if Path::new(spec).join(crate::layout::RECIPE).is_file() {
            crate::run::run_recipe(Path::new(spec))
                .with_context(|| format!("--size `{spec}`"))?
                .model
        } else {
            recipe::resolve(spec, &[])
                .with_context(|| {
                    format!(
                        "--size `{spec}`: expected D_MODELxLAYERSxHEADS (e.g. 256x4x4), a recipe or a run directory"
                    )
                })?
                .recipe
                .model
        };
        Ok(Self {
            d_model: model.d_model,
            layers: model.layers,
            heads: model.heads,
            kv_heads: model.kv_heads,
            vocab: model.vocab_size,
            ffn_dim: model.ffn_dim,
            tie_embeddings: model.tie_embeddings,
            head_dim: model.head_dim,
            qkv_bias: model.qkv_bias,
        })
    }

    /// The configuration of `attention` at this shape, for sequences of `seq` tokens.
    pub fn config(
        &self,
        attention: AttentionKind,
        seq: usize,
        implementation: AttentionImpl,
    ) -> Result<ModelConfig> {
        let config = ModelConfig::new(
            attention,
            self.d_model,
            self.layers,
            self.heads,
            self.vocab,
            seq,
        )
        .with_kv_heads(self.kv_heads)
        .with_ffn_dim(self.ffn_dim)
        .with_tie_embeddings(self.tie_embeddings)
        .with_head_dim(self.head_dim)
        .with_qkv_bias(self.qkv_bias)
        .with_attention_impl(implementation);
        config
            .validate()
            .map_err(|e| anyhow!("the {attention} model of this size is invalid: {e}"))?;
        Ok(config)
    }
}

/// What one process measured of one variant on one device (diffzoo or PyTorch).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    pub attention: String,
    pub params: u64,
    pub forward_tokens_per_sec: f64,
    pub step_tokens_per_sec: f64,
    /// Tokens/s over the repetitions (their median is `forward_tokens_per_sec`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_spread: Option<Spread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_spread: Option<Spread>,
    /// `None` where the platform gives no figure.
    pub peak_bytes: Option<u64>,
    /// Cores' worth of CPU time other processes took while this was measured (set by the
    /// process that started the measurement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub competing_cores: Option<f64>,
    /// Where a training step's time goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_phases: Option<StepPhases>,
    /// Where its passes' time goes by class of operation (`--profile`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<StepProfile>,
    /// transformers' own baseline timed beside PyTorch's (the reference's baseline only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformers: Option<reference::Transformers>,
}

/// A training step's phases, each the median over the timed repetitions, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
pub struct StepPhases {
    /// The forward and backward passes, the loss read back and the gradients collected.
    pub forward_backward: f64,
    /// Clipping the gradients to a global norm of 1.
    pub clipping: f64,
    /// AdamW's update, the device synchronised.
    pub optimizer: f64,
}

impl StepPhases {
    /// The medians of the last `reps` of `phases` (the timed repetitions after the warm-up).
    fn of(phases: &[[f64; 3]], reps: usize) -> Option<Self> {
        let timed = &phases[phases.len().saturating_sub(reps)..];
        let median_of = |i: usize| {
            let mut values: Vec<f64> = timed.iter().map(|p| p[i]).collect();
            (!values.is_empty()).then(|| median(&mut values))
        };
        Some(Self {
            forward_backward: median_of(0)?,
            clipping: median_of(1)?,
            optimizer: median_of(2)?,
        })
    }

    /// `forward+backward 2.95 s (92%), clipping 131.2 ms (4%), optimizer …`.
    fn describe(&self) -> String {
        let total = self.forward_backward + self.clipping + self.optimizer;
        let phase = |name: &str, s: f64| match s >= 1.0 {
            true => format!("{name} {s:.2} s ({:.0}%)", 100.0 * s / total),
            false => format!("{name} {:.1} ms ({:.0}%)", 1e3 * s, 100.0 * s / total),
        };
        [
            phase("forward+backward", self.forward_backward),
            phase("clipping", self.clipping),
            phase("optimizer", self.optimizer),
        ]
        .join(", ")
    }
}

/// What PyTorch's harness printed.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct TorchRun {
    pub torch: String,
    pub threads: usize,
    pub device: String,
    pub attention_impl: String,
    pub results: Vec<Measurement>,
    /// Cores other processes took while PyTorch was measured.
    #[serde(default)]
    pub competing_cores: Option<f64>,
}

/// diffzoo / PyTorch, for the same device kind and variant.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct VsTorch {
    pub forward: f64,
    pub step: f64,
    /// Peak memory ratio, where both have a figure.
    pub memory: Option<f64>,
}

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub device: String,
    #[serde(flatten)]
    pub ours: Measurement,
    /// Model FLOP/s of the training step (`budget::flops_per_token`'s training FLOPs).
    pub train_flops_per_sec: f64,
    /// `train_flops_per_sec` over the `--gpu`'s dense bf16 peak.
    pub mfu: Option<f64>,
    /// `train_flops_per_sec` over the matmul peak measured on this device (`--roofline`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share_of_matmul_peak: Option<f64>,
    /// This variant's step time over the baseline Transformer's on the same device.
    pub step_time_vs_transformer: Option<f64>,
    pub torch: Option<Measurement>,
    pub vs_torch: Option<VsTorch>,
}

/// The tokens/s of `reps` calls of `f` processing `tokens` each, after `warmup` untimed ones.
fn timed(
    tokens: usize,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Spread> {
    for _ in 0..warmup {
        f()?;
    }
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(Spread::of_rates(tokens as f64, &times))
}

/// The CPU's model and its widest vector and matrix extensions (from `/proc/cpuinfo`): Flex's
/// speed relative to PyTorch depends on them.
pub fn cpu() -> String {
    Cpu::here().summary()
}

/// A field of `/proc/self/status` in bytes (`None` off Linux).
fn proc_status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Report rows: each measurement with its FLOP/s, MFU, ratio to the baseline on its device and,
/// when PyTorch ran on the same kind of device, the ratios to it.
pub fn rows(
    measured: &[(String, Measurement)],
    torch: &[(String, TorchRun)],
    train_flops_per_token: impl Fn(&str) -> f64,
    peak_flops: Option<f64>,
) -> Vec<Row> {
    measured
        .iter()
        .map(|(device, ours)| {
            let baseline = measured
                .iter()
                .find(|(d, m)| d == device && m.attention == AttentionKind::Transformer.as_str());
            let train_flops_per_sec =
                ours.step_tokens_per_sec * train_flops_per_token(&ours.attention);
            let theirs = torch
                .iter()
                .find(|(d, _)| Some(d) == torch_device(device).as_ref())
                .and_then(|(_, run)| run.results.iter().find(|m| m.attention == ours.attention))
                .cloned();
            let vs_torch = theirs.as_ref().map(|t| VsTorch {
                forward: ours.forward_tokens_per_sec / t.forward_tokens_per_sec,
                step: ours.step_tokens_per_sec / t.step_tokens_per_sec,
                memory: ours
                    .peak_bytes
                    .zip(t.peak_bytes)
                    .map(|(a, b)| a as f64 / b as f64),
            });
            Row {
                device: device.clone(),
                ours: ours.clone(),
                train_flops_per_sec,
                mfu: peak_flops.map(|peak| train_flops_per_sec / peak),
                share_of_matmul_peak: None,
                step_time_vs_transformer: baseline
                    .map(|(_, b)| b.step_tokens_per_sec / ours.step_tokens_per_sec),
                torch: theirs,
                vs_torch,
            }
        })
        .collect()
}

/// The PyTorch device a diffzoo device is compared with: the same CUDA card, the CPU for the CPU
/// backends, none for WGPU (whose adapter PyTorch cannot drive).
pub fn torch_device(spec: &str) -> Option<String> {
    match spec.split_once(':') {
        Some(("cuda" | "tch-cuda", index)) => Some(format!("cuda:{index}")),
        None if matches!(spec, "cpu" | "flex" | "ndarray" | "tch") => Some("cpu".into()),
        _ => None,
    }
}

/// Threads the CPU backends use: `RAYON_NUM_THREADS` when set, else every core.
fn threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

pub fn run(args: &BenchArgs) -> Result<()> {
    let shape = checked_shape(args)?;
    if args.child {
        return child(args, &shape);
    }
    let peak_flops = match &args.gpu {
        Some(gpu) => Some(Gpu::parse(gpu)?.peak_flops.ok_or_else(|| {
            anyhow!("--gpu {gpu}: its bf16 peak is unknown; name h100, h200 or a100")
        })?),
        None => None,
    };
    for spec in &args.devices {
        device::parse_as(spec, |d| {
            train::configure_dtype(d, &args.dtype, spec, "--dtype")
        })?;
    }
    // PyTorch first: a missing or broken Python fails before minutes of measuring.
    let load_before = trust::load_average();
    let roofline = match args.roofline {
        true => Some(measure_roofline(args)?),
        false => None,
    };
    let torch = match args.torch {
        true => measure_torch(args, &shape)?,
        false => Vec::new(),
    };
    let mut measured = Vec::new();
    for spec in &args.devices {
        for &attention in &args.attention {
            eprintln!("bench: {attention} on {spec}");
            let probe = LoadProbe::start();
            let mut measurement = spawn_child(args, spec, attention)?;
            measurement.competing_cores = probe.and_then(|p| p.competing_cores());
            measured.push((spec.clone(), measurement));
        }
    }
    let flops = |attention: &str| {
        let kind: AttentionKind = attention.parse().expect("a measured variant");
        let config = shape
            .config(kind, args.seq, AttentionImpl::Explicit)
            .expect("validated");
        config.flops_per_token(args.seq).training
    };
    let mut rows = rows(&measured, &torch, flops, peak_flops);
    if let Some(roofline) = &roofline {
        for row in rows.iter_mut().filter(|r| r.device == args.devices[0]) {
            row.share_of_matmul_peak = Some(row.train_flops_per_sec / roofline.peak(&args.dtype));
        }
    }
    let warnings = report_warnings(load_before, &rows, &torch);
    let report = serde_json::json!({
            "shape": shape,
            "cpu": cpu(),
            "cpu_info": Cpu::here(),
            "load_before": load_before,
            "roofline": roofline,
            "warnings": warnings,
            "attention_impl": args.attention_impl,
            "attention_block": args.attention_block,
            "recompute": args.recompute,
            "seq": args.seq,
            "batch": args.batch,
            "dtype": args.dtype,
            "threads": threads(),
            "allocator_tuned": crate::allocator::tuned(),
            "warmup": args.warmup,
            "reps": args.reps,
            "torch": torch.iter().map(|(_, run)| serde_json::json!({
                "version": run.torch,
                "device": run.device,
                "threads": run.threads,
                "attention_impl": run.attention_impl,
                "competing_cores": run.competing_cores,
            })).collect::<Vec<_>>(),
            "rows": rows,
    });
    let report = serde_json::to_string_pretty(&report)?;
    if let Some(out) = &args.out {
        std::fs::write(out, &report).with_context(|| format!("writing {}", out.display()))?;
    }
    if args.json {
        println!("{report}");
    } else {
        print_table(args, &shape, &torch, &rows);
        print_phases(&rows);
        profile::print(&rows);
        if let Some(roofline) = &roofline {
            print_roofline(args, roofline, &rows);
        }
        for warning in &warnings {
            println!("warning: {warning}");
        }
    }
    Ok(())
}

/// The shape to measure, once what can be refused before measuring is not there: counts of
/// zero, a variant the shape cannot build, `--profile` with recomputation or on a device that
/// queues its operations.
fn checked_shape(args: &BenchArgs) -> Result<Shape> {
    if args.reps == 0 || args.seq == 0 || args.batch == 0 {
        bail!("--reps, --seq and --batch must be at least 1");
    }
    let shape = Shape::parse(&args.size, args.vocab, args.kv_heads)?;
    for &attention in &args.attention {
        shape.config(attention, args.seq, args.implementation())?;
    }
    if args.profile {
        if args.recompute() == Recompute::Block {
            bail!("--profile times the step without recomputation: drop --recompute block");
        }
        if let Some(spec) = args
            .devices
            .iter()
            .find(|d| torch_device(d).as_deref() != Some("cpu"))
        {
            bail!(
                "--profile times each operation where it is called, which only CPU devices do: `{spec}` queues them"
            );
        }
    }
    Ok(shape)
}

/// PyTorch's runs on each device kind of `--device` once, each with what competed for the cores
/// during it; an error where its model's parameters are not ours.
fn measure_torch(args: &BenchArgs, shape: &Shape) -> Result<Vec<(String, TorchRun)>> {
    let mut devices: Vec<String> = args
        .devices
        .iter()
        .filter_map(|d| torch_device(d))
        .collect();
    devices.sort();
    devices.dedup();
    let mut torch = Vec::new();
    for device in devices {
        eprintln!("bench: PyTorch on {device}");
        let probe = LoadProbe::start();
        let mut run = run_torch(args, shape, &device)?;
        run.competing_cores = probe.and_then(|p| p.competing_cores());
        for theirs in &run.results {
            let kind: AttentionKind = theirs.attention.parse().map_err(|e| anyhow!("{e}"))?;
            let ours = shape
                .config(kind, args.seq, AttentionImpl::Explicit)?
                .param_count()
                .total;
            if theirs.params != ours {
                bail!(
                    "PyTorch's {kind} model has {} parameters, ours {ours}: not the same model",
                    theirs.params
                );
            }
        }
        torch.push((device, run));
    }
    Ok(torch)
}

/// The machine's limits on the first device ([`roofline`]), PyTorch's products with `--torch`.
fn measure_roofline(args: &BenchArgs) -> Result<Roofline> {
    let spec = &args.devices[0];
    eprintln!("bench: the roofline on {spec}");
    let device = device::parse_as(spec, |d| {
        train::configure_dtype(d, &args.dtype, spec, "--dtype")
    })?;
    let mut roofline = Roofline::measure(&device, args.reps)?;
    if args.torch {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/torch_reference.py");
        let python = python(args);
        let out = Command::new(&python)
            .arg(&script)
            .args(["--roofline", "--reps", &args.reps.to_string()])
            .args(["--threads", &threads().to_string()])
            .output()
            .with_context(|| format!("running {} with {}", script.display(), python.display()))?;
        if !out.status.success() {
            bail!(
                "{} --roofline failed ({}):\n{}",
                script.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let peaks: serde_json::Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("reading the output of {} --roofline", script.display()))?;
        roofline.torch_matmul_f32 = peaks["matmul_f32"].as_f64();
        roofline.torch_matmul_bf16 = peaks["matmul_bf16"].as_f64();
    }
    Ok(roofline)
}

/// Under the table: where each step's time went, ours and PyTorch's.
fn print_phases(rows: &[Row]) {
    let phased: Vec<_> = rows
        .iter()
        .filter_map(|row| Some((row, row.ours.step_phases?)))
        .collect();
    if phased.is_empty() {
        return;
    }
    println!("\nstep phases (median):");
    for (row, phases) in phased {
        println!(
            "  {} {}: {}",
            row.device,
            row.ours.attention,
            phases.describe()
        );
        if let Some(theirs) = row.torch.as_ref().and_then(|t| t.step_phases) {
            println!("    PyTorch: {}", theirs.describe());
        }
    }
}

/// The roofline under the table: the limits, and each step's share of the matmul peak.
fn print_roofline(args: &BenchArgs, roofline: &Roofline, rows: &[Row]) {
    let gflops = |f: Option<f64>| f.map_or("-".into(), |f| format!("{:.0}", f / 1e9));
    println!(
        "\nroofline on {}: matmul {MATMUL_N}² f32 {} GFLOP/s, bf16 {} (PyTorch: f32 {}, bf16 {}); read bandwidth {:.1} GB/s",
        args.devices[0],
        gflops(Some(roofline.matmul_f32)),
        gflops(roofline.matmul_bf16),
        gflops(roofline.torch_matmul_f32),
        gflops(roofline.torch_matmul_bf16),
        roofline.read_bytes_per_sec / 1e9,
        MATMUL_N = roofline::MATMUL_N,
    );
    for row in rows {
        if let Some(share) = row.share_of_matmul_peak {
            println!(
                "  {} {} step: {:.1} GFLOP/s, {:.0}% of the {} matmul peak{}",
                row.device,
                row.ours.attention,
                row.train_flops_per_sec / 1e9,
                100.0 * share,
                args.dtype,
                row.torch
                    .as_ref()
                    .zip(roofline.torch_matmul_f32)
                    .map(|(t, peak)| {
                        let theirs = row.train_flops_per_sec / row.ours.step_tokens_per_sec
                            * t.step_tokens_per_sec;
                        let peak = match args.dtype.as_str() {
                            "bf16" => roofline.torch_matmul_bf16.unwrap_or(peak),
                            _ => peak,
                        };
                        format!(
                            " (PyTorch's step: {:.0}% of its own)",
                            100.0 * theirs / peak
                        )
                    })
                    .unwrap_or_default()
            );
        }
    }
}

/// The report's warnings ([`trust::warnings`]): the load before the run, each measured figure's
/// competition and spread (ours, PyTorch's and transformers' beside it), and a reference that
/// transformers shows wrong or that could not be checked ([`reference::warning`]).
fn report_warnings(
    load_before: Option<f64>,
    rows: &[Row],
    torch: &[(String, TorchRun)],
) -> Vec<String> {
    let mut figures = Vec::new();
    let mut add = |who: String, m: &Measurement, competing: Option<f64>| {
        figures.push(Figure {
            what: format!("{who} {} step", m.attention),
            spread: m.step_spread,
            competing,
        });
        figures.push(Figure {
            what: format!("{who} {} forward", m.attention),
            spread: m.forward_spread,
            competing: None,
        });
    };
    for row in rows {
        add(row.device.clone(), &row.ours, row.ours.competing_cores);
    }
    for (device, run) in torch {
        for m in &run.results {
            add(format!("PyTorch {device}"), m, run.competing_cores);
        }
    }
    figures.extend(
        torch
            .iter()
            .filter_map(|(device, run)| reference::figure(device, run)),
    );
    let mut warnings = trust::warnings(load_before, &figures);
    warnings.extend(
        torch
            .iter()
            .filter_map(|(device, run)| reference::warning(device, run)),
    );
    warnings
}

fn print_table(args: &BenchArgs, shape: &Shape, torch: &[(String, TorchRun)], rows: &[Row]) {
    println!(
        "d_model {} · {} layers · {} heads{} · vocab {} · {} × {} tokens · {} · {} threads · median of {} after {} warm-up{}",
        shape.d_model,
        shape.layers,
        shape.heads,
        shape
            .kv_heads
            .map(|k| format!(" ({k} kv)"))
            .unwrap_or_default(),
        shape.vocab,
        args.batch,
        args.seq,
        args.dtype,
        threads(),
        args.reps,
        args.warmup,
        if crate::allocator::tuned() {
            ""
        } else {
            " · allocator not tuned"
        },
    );
    println!(
        "{} · {} attention{}",
        cpu(),
        args.attention_impl,
        match args.recompute() {
            Recompute::Block => " · blocks recomputed",
            Recompute::None => "",
        }
    );
    for (_, run) in torch {
        println!(
            "PyTorch {} on {} ({} attention, {} threads)",
            run.torch, run.device, run.attention_impl, run.threads
        );
        println!("{}", reference::line(run));
    }
    let mib = |b: Option<u64>| b.map_or("-".into(), |b| format!("{:.0}", b as f64 / 1048576.0));
    let ratio = |r: Option<f64>| r.map_or("-".into(), |r| format!("{r:.2}"));
    println!(
        "\n{:<10} {:<12} {:>10} {:>11} {:>11} {:>7} {:>6} {:>9} {:>9} {:>7}{}",
        "device",
        "attention",
        "params",
        "fwd tok/s",
        "step tok/s",
        "spread",
        "others",
        "step/base",
        "peak MiB",
        if args.gpu.is_some() { "MFU" } else { "GFLOP/s" },
        if torch.is_empty() {
            ""
        } else {
            "  | torch fwd  torch step  torch MiB | fwd×torch step×torch mem×torch"
        }
    );
    for row in rows {
        let flops = match row.mfu {
            Some(mfu) => format!("{:.1}%", 100.0 * mfu),
            None => format!("{:.1}", row.train_flops_per_sec / 1e9),
        };
        let torch = match (&row.torch, &row.vs_torch) {
            (Some(t), Some(v)) => format!(
                "  | {:>9.0} {:>11.0} {:>10} | {:>9.2} {:>10.2} {:>9}",
                t.forward_tokens_per_sec,
                t.step_tokens_per_sec,
                mib(t.peak_bytes),
                v.forward,
                v.step,
                ratio(v.memory)
            ),
            _ => String::new(),
        };
        let spread = row
            .ours
            .step_spread
            .map_or("-".into(), |s| format!("{:.0}%", 100.0 * s.width()));
        let others = row
            .ours
            .competing_cores
            .map_or("-".into(), |c| format!("{c:.2}"));
        println!(
            "{:<10} {:<12} {:>10} {:>11.0} {:>11.0} {:>7} {:>6} {:>9} {:>9} {:>7}{torch}",
            row.device,
            row.ours.attention,
            row.ours.params,
            row.ours.forward_tokens_per_sec,
            row.ours.step_tokens_per_sec,
            spread,
            others,
            ratio(row.step_time_vs_transformer),
            mib(row.ours.peak_bytes),
            flops,
        );
    }
}

/// Runs this binary on one device and variant and reads its measurement.
fn spawn_child(args: &BenchArgs, spec: &str, attention: AttentionKind) -> Result<Measurement> {
    let exe = std::env::current_exe().context("locating the diffzoo binary")?;
    let mut command = Command::new(exe);
    command.args(["bench", "--child", "--device", spec]);
    command.args(["--attention", attention.as_str(), "--size", &args.size]);
    for (flag, value) in [
        ("--seq", args.seq),
        ("--batch", args.batch),
        ("--vocab", args.vocab),
        ("--warmup", args.warmup),
        ("--reps", args.reps),
    ] {
        command.args([flag, &value.to_string()]);
    }
    command.args(["--dtype", &args.dtype]);
    if let Some(kv) = args.kv_heads {
        command.args(["--kv-heads", &kv.to_string()]);
    }
    command.args(["--attention-impl", &args.attention_impl]);
    command.args(["--attention-block", &args.attention_block.to_string()]);
    command.args(["--recompute", &args.recompute]);
    if args.profile {
        command.arg("--profile");
    }
    let threads = threads().to_string();
    command.env("RAYON_NUM_THREADS", &threads);
    command.env("OMP_NUM_THREADS", &threads);
    let out = command
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("starting a bench process")?;
    if !out.status.success() {
        bail!("measuring {attention} on {spec} failed ({})", out.status);
    }
    // The measurement is the last line; a backend may have printed before it.
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .with_context(|| format!("reading the measurement of {attention} on {spec}"))
}

/// One device, one variant: prints a [`Measurement`] as JSON.
fn child(args: &BenchArgs, shape: &Shape) -> Result<()> {
    let (spec, attention) = match (&args.devices[..], &args.attention[..]) {
        ([spec], [attention]) => (spec, *attention),
        _ => bail!("--child measures one device and one variant"),
    };
    let config = shape.config(attention, args.seq, args.implementation())?;
    let device = device::parse_as(spec, |d| {
        train::configure_dtype(d, &args.dtype, spec, "--dtype")
    })?;
    let base = proc_status_bytes("VmRSS:");
    let training = device.clone().autodiff();
    training.seed(0);
    let model = config.init(&training);
    let params = model.num_params() as u64;
    let tokens = args.batch * args.seq;
    let mut rng = Rng::new(0);
    let windows: Vec<Vec<u32>> = (0..args.batch)
        .map(|_| {
            (0..=args.seq)
                .map(|_| rng.below(shape.vocab as u64) as u32)
                .collect()
        })
        .collect();

    // The forward passes run without autodiff, on the initial weights.
    let inference = model.clone().valid();
    let mut stepper = Stepper {
        model: Some(model),
        optimizer: train::optimizer(&OptimizerSection::default())?,
        batch: LmBatcher.batch(windows.clone(), &training),
        recompute: args.recompute(),
        device: &device,
        spec,
        phases: Vec::new(),
        pool_peak: None,
    };
    // Resetting the peak resident set makes it the current one; no figure if that is refused.
    let rss_reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let mut one_step = || stepper.step();
    let step = timed(tokens, args.warmup, args.reps, &mut one_step)?;
    let hwm = proc_status_bytes("VmHWM:");
    // The profiled steps come after the timed ones and their peak: the clock never touches the
    // reported figures. (Only CPU devices are profiled, whose peak is `hwm`, not the pool's.)
    let booked = match args.profile {
        true => Some(profiled(args.reps, &mut one_step)?),
        false => None,
    };
    // Host memory says nothing of a GPU's: a GPU backend without a pool report gets no figure.
    let on_cpu = torch_device(spec).as_deref() == Some("cpu");
    let peak_bytes = stepper.pool_peak.or_else(|| {
        let (base, hwm) = (base?, hwm?);
        (rss_reset && on_cpu).then(|| hwm.saturating_sub(base))
    });
    drop(stepper.model.take());
    let mut step_profile = booked.map(|booked| {
        let replayed = clock::replay_backward(&booked, &training, args.reps);
        profile::step(&booked, args.reps, &replayed)
    });

    let inputs = LmBatcher.batch(windows, &device).inputs;
    let forward = timed(tokens, args.warmup, args.reps, || {
        inference.forward(inputs.clone()).sum().into_scalar::<f32>();
        Ok(())
    })?;
    if let Some(step_profile) = &mut step_profile {
        step_profile.decode = profiled_decode(&inference, inputs.clone(), args.reps)?;
        // The same step as `generate --dtype bf16` decodes: f32 activations, bf16 matrices.
        if args.dtype == "f32" && device::reads_bf16_weights(spec) {
            let bf16 = inference.clone().with_weight_dtype(FloatDType::BF16);
            step_profile.decode_bf16 = profiled_decode(&bf16, inputs, args.reps)?;
        }
    }
    let measurement = Measurement {
        attention: attention.as_str().into(),
        params,
        forward_tokens_per_sec: forward.median,
        step_tokens_per_sec: step.median,
        forward_spread: Some(forward),
        step_spread: Some(step),
        competing_cores: None,
        peak_bytes,
        step_phases: StepPhases::of(&stepper.phases[..args.warmup + args.reps], args.reps),
        profile: step_profile,
        transformers: None,
    };
    println!("{}", serde_json::to_string(&measurement)?);
    Ok(())
}

/// The trainer's step on one batch, repeated: forward, backward, clipping to global norm 1 and
/// AdamW, the device synchronised after each phase.
struct Stepper<'a> {
    /// The model between steps.
    model: Option<Model>,
    optimizer: ModuleOptimizer,
    batch: LmBatch,
    recompute: Recompute,
    device: &'a Device,
    spec: &'a str,
    /// Each step's forward+backward, clipping and optimizer seconds.
    phases: Vec<[f64; 3]>,
    /// The device allocator's largest reservation after a step, where the backend reports one.
    pool_peak: Option<u64>,
}

impl Stepper<'_> {
    fn step(&mut self) -> Result<()> {
        let model = self.model.take().expect("the model between steps");
        let started = Instant::now();
        let mut accumulator = GradientsAccumulator::new();
        let loss = step::backward(&model, &self.batch, self.recompute, None, |grads| {
            accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
        });
        let value = loss.into_scalar::<f32>();
        if !value.is_finite() {
            bail!("non-finite loss {value}");
        }
        let mut g = accumulator.grads();
        let sync = || {
            self.device
                .sync()
                .map_err(|e| anyhow!("{}: the step failed: {e:?}", self.spec))
        };
        sync()?;
        let backward_done = Instant::now();
        grads::clip_global_norm(&model, &mut g, 1.0);
        sync()?;
        let clipped = Instant::now();
        self.model = Some(self.optimizer.step(1e-4, model, g));
        // On a GPU the update is still queued: the step ends when the device is idle.
        sync()?;
        self.phases.push([
            (backward_done - started).as_secs_f64(),
            (clipped - backward_done).as_secs_f64(),
            clipped.elapsed().as_secs_f64(),
        ]);
        if let Some(usage) = self.device.memory_pool_usage() {
            self.pool_peak = self.pool_peak.max(Some(usage.bytes_reserved));
        }
        Ok(())
    }
}

/// `steps` calls of `step` with the profile's clock on, and what it booked.
fn profiled(steps: usize, mut step: impl FnMut() -> Result<()>) -> Result<clock::Profile> {
    clock::take();
    clock::enable(true);
    let done = (0..steps).try_for_each(|_| step());
    clock::enable(false);
    done.map(|()| clock::take())
}

/// Decoding steps of the first sequence of `inputs` (its first half as the prompt, then one
/// position at a time, at most `reps` of them), profiled; `None` for a sequence too short.
fn profiled_decode(
    model: &diffzoo_models::Model,
    inputs: burn::tensor::Tensor<2, burn::tensor::Int>,
    reps: usize,
) -> Result<Option<profile::PassProfile>> {
    let seq = inputs.dims()[1];
    let prompt = seq / 2;
    if prompt == 0 {
        return Ok(None);
    }
    let tokens = inputs.narrow(0, 0, 1);
    let mut cache = model.cache();
    model.forward_cached_last(tokens.clone().narrow(1, 0, prompt), &mut cache);
    let booked = profiled(reps.min(seq - prompt), || {
        let next = tokens.clone().narrow(1, cache.len(), 1);
        clock::pass(clock::Pass::Decode, || {
            model
                .forward_cached_last(next, &mut cache)
                .argmax(2)
                .into_scalar::<i64>()
        });
        Ok(())
    })?;
    Ok(profile::decode(&booked))
}

/// The Python that has torch: `--python`, `$DIFFZOO_PYTHON`, the venv `bench/setup` makes, or
/// `python3`.
fn python(args: &BenchArgs) -> PathBuf {
    if let Some(p) = &args.python {
        return p.clone();
    }
    if let Some(p) = std::env::var_os("DIFFZOO_PYTHON") {
        return p.into();
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/torch-venv/bin/python");
    if venv.exists() {
        return venv;
    }
    "python3".into()
}

fn run_torch(args: &BenchArgs, shape: &Shape, device: &str) -> Result<TorchRun> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/torch_reference.py");
    let python = python(args);
    let attention: Vec<&str> = args.attention.iter().map(|a| a.as_str()).collect();
    let mut command = Command::new(&python);
    command.arg(&script);
    command.args(["--attention", &attention.join(","), "--device", device]);
    for (flag, value) in [
        ("--d-model", shape.d_model),
        ("--layers", shape.layers),
        ("--heads", shape.heads),
        ("--vocab", shape.vocab),
        ("--seq", args.seq),
        ("--batch", args.batch),
        ("--warmup", args.warmup),
        ("--reps", args.reps),
        ("--threads", threads()),
    ] {
        command.args([flag, &value.to_string()]);
    }
    if let Some(kv) = shape.kv_heads {
        command.args(["--kv-heads", &kv.to_string()]);
    }
    if let Some(ffn) = shape.ffn_dim {
        command.args(["--ffn-dim", &ffn.to_string()]);
    }
    if let Some(d) = shape.head_dim {
        command.args(["--head-dim", &d.to_string()]);
    }
    if shape.tie_embeddings {
        command.arg("--tie-embeddings");
    }
    if shape.qkv_bias {
        command.arg("--qkv-bias");
    }
    if args.profile {
        command.arg("--profile");
    }
    command.args([
        "--dtype",
        &args.dtype,
        "--attention-impl",
        &args.torch_attention,
    ]);
    let out = command
        .output()
        .with_context(|| format!("running {} with {}", script.display(), python.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if stderr.contains("No module named 'torch'") {
            bail!(
                "{} has no PyTorch: run `bash bench/setup` (installs torch 2.9.0 into target/torch-venv), or pass --python or set DIFFZOO_PYTHON",
                python.display()
            );
        }
        bail!("{} failed ({}):\n{stderr}", script.display(), out.status);
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("reading the output of {}", script.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_from_numbers_or_recipes() {
        let shape = Shape::parse("512x8x8", 1000, Some(4)).unwrap();
        assert_eq!(
            shape,
            Shape {
                d_model: 512,
                layers: 8,
                heads: 8,
                kv_heads: Some(4),
                vocab: 1000,
                ffn_dim: None,
                tie_embeddings: false,
                head_dim: None,
                qkv_bias: false,
            }
        );
        let tiny = Shape::parse("tiny", 1000, None).unwrap();
        assert_eq!((tiny.d_model, tiny.layers, tiny.vocab), (256, 4, 4096));
        let err = Shape::parse("256x4", 1000, None).unwrap_err();
        assert!(format!("{err:#}").contains("--size `256x4`"), "{err:#}");
        // Three heads cannot be split into DIFF's pairs.
        let odd = Shape::parse("192x2x3", 100, None).unwrap();
        assert!(
            odd.config(AttentionKind::Transformer, 64, AttentionImpl::Explicit)
                .is_ok()
        );
        assert!(
            odd.config(AttentionKind::Diff, 64, AttentionImpl::Explicit)
                .is_err()
        );
    }

    #[test]
    fn torch_is_compared_on_the_same_kind_of_device() {
        let cpu = Some("cpu".to_string());
        for spec in ["cpu", "flex", "ndarray", "tch"] {
            assert_eq!(torch_device(spec), cpu);
        }
        assert_eq!(torch_device("wgpu"), None);
        assert_eq!(torch_device("cuda:1").as_deref(), Some("cuda:1"));
        assert_eq!(torch_device("tch-cuda:0").as_deref(), Some("cuda:0"));
    }

    #[test]
    fn step_phases_are_the_medians_of_the_timed_repetitions() {
        // The first is a warm-up step: left out.
        let phases = [
            [9.0, 9.0, 9.0],
            [2.0, 0.25, 0.5],
            [4.0, 0.75, 0.25],
            [3.0, 0.5, 1.5],
        ];
        let of = StepPhases::of(&phases, 3).unwrap();
        let expected = StepPhases {
            forward_backward: 3.0,
            clipping: 0.5,
            optimizer: 0.5,
        };
        assert_eq!(of, expected);
        assert_eq!(
            of.describe(),
            "forward+backward 3.00 s (75%), clipping 500.0 ms (12%), optimizer 500.0 ms (12%)"
        );
        assert_eq!(StepPhases::of(&[], 3), None);
    }

    fn m(attention: &str, fwd: f64, step: f64, peak: Option<u64>) -> Measurement {
        Measurement {
            attention: attention.into(),
            params: 10,
            forward_tokens_per_sec: fwd,
            step_tokens_per_sec: step,
            forward_spread: None,
            step_spread: None,
            peak_bytes: peak,
            competing_cores: None,
            step_phases: None,
            profile: None,
            transformers: None,
        }
    }

    #[test]
    fn rows_carry_the_ratios() {
        let measured = vec![
            ("flex".to_string(), m("transformer", 100.0, 50.0, Some(200))),
            ("flex".to_string(), m("diff", 90.0, 40.0, Some(300))),
            ("cuda:0".to_string(), m("diff", 1000.0, 500.0, None)),
        ];
        let torch = vec![(
            "cpu".to_string(),
            TorchRun {
                torch: "2.9.0".into(),
                threads: 2,
                device: "cpu".into(),
                attention_impl: "sdpa".into(),
                results: vec![
                    m("transformer", 200.0, 100.0, Some(400)),
                    m("diff", 180.0, 20.0, None),
                ],
                competing_cores: None,
            },
        )];
        let rows = rows(
            &measured,
            &torch,
            |a| if a == "diff" { 6.0 } else { 5.0 },
            Some(1000.0),
        );
        // DIFF's step takes 50/40 = 1.25× the baseline's on the same device; none on cuda.
        assert_eq!(rows[0].step_time_vs_transformer, Some(1.0));
        assert_eq!(rows[1].step_time_vs_transformer, Some(1.25));
        assert_eq!(rows[2].step_time_vs_transformer, None);
        assert_eq!(rows[1].train_flops_per_sec, 240.0);
        assert_eq!(rows[1].mfu, Some(0.24));
        let vs = rows[0].vs_torch.unwrap();
        assert_eq!((vs.forward, vs.step, vs.memory), (0.5, 0.5, Some(0.5)));
        let vs = rows[1].vs_torch.unwrap();
        assert_eq!((vs.forward, vs.step, vs.memory), (0.5, 2.0, None));
        // PyTorch ran on the CPU only.
        assert!(rows[2].vs_torch.is_none());
    }
}
