//! `diffzoo`: train, compare and sample DIFF Transformers and their baseline.

/// `println!` that ignores a closed standard output: training goes on when whatever read its log
/// went away (`train … | head`), and ends and records its outcome as it would have.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

mod allocator;
mod bench;
mod chat;
mod convert;
mod data;
mod device;
mod eval;
mod generate;
mod hf;
mod layout;
mod plan;
mod plot;
mod recipe;
mod run;
mod scaling;
mod slurm;
mod stats;
mod sweep;
mod synth;
mod train;
mod trust;
mod watch;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "diffzoo",
    version,
    about = "Train and compare the DIFF Transformer and a matched baseline"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a recipe (with Burn's dashboard when stdout is a terminal).
    Train(train::TrainArgs),
    /// List or show recipes.
    Recipe {
        #[command(subcommand)]
        command: RecipeCommand,
    },
    /// Sample text from a run's model.
    Generate(generate::GenerateArgs),
    /// Evaluate a run's model: the paper's analyses.
    Eval {
        #[command(subcommand)]
        command: EvalCommand,
    },
    /// Run every analysis on two runs and write one Markdown report with figures.
    Compare(eval::compare::CompareArgs),
    /// Train every recipe of a sweep into one directory (skipping finished runs).
    Sweep(sweep::SweepArgs),
    /// Follow many runs (a sweep's directory, a Slurm array's output, run directories): their
    /// state, progress, validation loss and time left, and their loss curves overlaid.
    Watch(watch::WatchArgs),
    /// Scaling-law fits over sweeps.
    Scaling {
        #[command(subcommand)]
        command: ScalingCommand,
    },
    /// Tokens per second and peak memory of a forward pass and a training step, per backend and
    /// variant, optionally beside PyTorch eager on the same machine.
    #[command(args_override_self = true)]
    Bench(bench::BenchArgs),
    /// Prepare token shards.
    Data {
        #[command(subcommand)]
        command: DataCommand,
    },
    /// Turn a run's baseline Transformer into a DIFF model (V1 or V2): a run to fine-tune.
    Convert(convert::ConvertArgs),
    /// Bring a checkpoint from another framework into a run directory.
    Import {
        #[command(subcommand)]
        command: ImportCommand,
    },
    /// Write a run's model in another framework's format.
    Export {
        #[command(subcommand)]
        command: ExportCommand,
    },
}

#[derive(Subcommand)]
enum ImportCommand {
    /// A Hugging Face transformers checkpoint (LlamaForCausalLM, MistralForCausalLM,
    /// Qwen2ForCausalLM, DiffLlamaForCausalLM, or a diffzoo DIFF V2 export).
    Hf(hf::import::ImportArgs),
}

#[derive(Subcommand)]
enum ExportCommand {
    /// A directory transformers loads, in the run's own class (LlamaForCausalLM,
    /// MistralForCausalLM, Qwen2ForCausalLM, DiffLlamaForCausalLM), or DIFF V2 with its own
    /// modeling file (trust_remote_code).
    Hf(hf::export::ExportArgs),
}

#[derive(Subcommand)]
enum RecipeCommand {
    /// List the built-in recipes.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Show a recipe resolved (inheritance and overrides applied) with its derived numbers, and
    /// with --gpu its memory and time plan.
    Show {
        name: String,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Plan for this GPU: h100, h200, a100, or a memory size in GB.
        #[arg(long)]
        gpu: Option<String>,
        /// Devices for the time estimate (default: the fewest that hold the run).
        #[arg(long, requires = "gpu")]
        gpus: Option<usize>,
        /// Model FLOPs utilisation assumed for the time estimate.
        #[arg(long, default_value_t = 0.4, requires = "gpu")]
        mfu: f64,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum EvalCommand {
    /// Validation loss and perplexity.
    Ppl(eval::ppl::PplArgs),
    /// Zero-shot multiple-choice accuracy from JSONL questions (Table 1's tasks).
    Choice(eval::choice::ChoiceArgs),
    /// Cumulative average NLL by position in the context (Fig. 4).
    NllPosition(eval::position::PositionArgs),
    /// Multi-needle retrieval accuracy (Table 2, Fig. 5).
    Needle(eval::needle::NeedleArgs),
    /// Attention on the answer span versus the rest of the context (Table 3).
    Attention(eval::attention::AttentionArgs),
    /// Multi-query associative recall accuracy and attention, by pairs, distractors and distance.
    Recall(eval::recall::RecallArgs),
    /// Top and median magnitudes of attention logits and hidden states (Table 5).
    Outliers(eval::outliers::OutlierArgs),
    /// Loss (and retrieval) with attention logits quantised to fewer bits (Fig. 8).
    Quant(eval::quant::QuantArgs),
    /// λ of every layer across the run's checkpoints.
    Lambda(eval::lambda::LambdaArgs),
    /// Many-shot in-context classification by the number and order of demonstrations (Fig. 6, 7).
    Icl(eval::icl::IclArgs),
    /// Contextual hallucination: outputs from a source, judged supported or not (Table 4).
    Hallucination(eval::hallucination::HallucinationArgs),
}

#[derive(Subcommand)]
enum ScalingCommand {
    /// Fit L(x) = E + A·x^(−α) per architecture and compare them as the paper does.
    Fit(scaling::FitArgs),
}

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize text files (.txt, .jsonl, their .gz, .parquet, directories) into shards.
    Prepare(Box<data::PrepareArgs>),
    /// Train a byte-level BPE tokenizer alone (once, before preparing parts on many machines).
    Tokenizer(data::TokenizerArgs),
    /// Write one manifest over the parts of `data prepare --part I/N` (copying nothing).
    Merge(data::MergeArgs),
    /// Check a shard directory: every shard's size and SHA-256 against its manifest.
    Verify(data::VerifyArgs),
    /// Write a seeded synthetic task: training documents and its evaluation sets.
    Synth {
        #[command(subcommand)]
        task: synth::SynthTask,
    },
}

fn main() {
    cpu_default_device();
    allocator::tune();
    quiet_broken_pipe();
    match dispatch(Cli::parse()) {
        Ok(Outcome::Done) => {}
        Ok(Outcome::Stopped(_)) => std::process::exit(train::RESUMABLE),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}

/// Makes Burn's default device the CPU one, unless `BURN_DEVICE` says otherwise. diffzoo gives
/// every tensor it makes a device of its own choosing (`--device`), but Burn materialises a
/// device-free record on its default device — a resumed run's optimizer state, before it moves to
/// each parameter's device — and that default is the first GPU backend compiled in: a resume on
/// the CPU of a `--features wgpu` build started a Vulkan instance for it (Mesa then printed
/// `XDG_RUNTIME_DIR is invalid` over the dashboard), and with `cuda` compiled in, a CUDA one.
fn cpu_default_device() {
    let cpu = match (cfg!(feature = "flex"), cfg!(feature = "ndarray")) {
        (true, _) => "flex",
        (false, true) => "ndarray",
        (false, false) => return,
    };
    if std::env::var_os("BURN_DEVICE").is_none() {
        // SAFETY: the first thing `main` does, while the process has one thread and nothing
        // reads the environment concurrently.
        unsafe { std::env::set_var("BURN_DEVICE", cpu) };
    }
}

/// A command whose output goes to a reader that closed it (`diffzoo recipe show X | head -3`)
/// ends quietly with status 0, as `cat` and `grep` do, instead of panicking on the failed print.
/// (Training does not print that way: [`say!`] ignores the closed output and the run goes on.)
fn quiet_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(0);
        }
        default(info);
    }));
}

/// How a command ended, when it did not fail.
pub enum Outcome {
    Done,
    /// Training stopped early with a checkpoint to resume from (exit status [`train::RESUMABLE`]),
    /// and why (a signal, the dashboard, a time limit).
    Stopped(String),
}

fn dispatch(cli: Cli) -> Result<Outcome> {
    let done = match cli.command {
        Command::Train(args) => return train::run(&args),
        Command::Sweep(args) => return sweep::run(&args),
        Command::Recipe { command } => match command {
            RecipeCommand::List { json } => recipe::list(json),
            RecipeCommand::Show {
                name,
                overrides,
                gpu,
                gpus,
                mfu,
                json,
            } => plan::show(&name, &overrides, gpu.map(|g| (g, gpus, mfu)), json),
        },
        Command::Generate(args) => generate::run(&args),
        Command::Eval { command } => match command {
            EvalCommand::Ppl(args) => eval::ppl::run(&args),
            EvalCommand::Choice(args) => eval::choice::run(&args),
            EvalCommand::NllPosition(args) => eval::position::run(&args),
            EvalCommand::Needle(args) => eval::needle::run(&args),
            EvalCommand::Attention(args) => eval::attention::run(&args),
            EvalCommand::Recall(args) => eval::recall::run(&args),
            EvalCommand::Outliers(args) => eval::outliers::run(&args),
            EvalCommand::Quant(args) => eval::quant::run(&args),
            EvalCommand::Lambda(args) => eval::lambda::run(&args),
            EvalCommand::Icl(args) => eval::icl::run(&args),
            EvalCommand::Hallucination(args) => eval::hallucination::run(&args),
        },
        Command::Compare(args) => eval::compare::run(&args),
        Command::Watch(args) => watch::run(&args),
        Command::Scaling { command } => match command {
            ScalingCommand::Fit(args) => scaling::run(&args),
        },
        Command::Bench(args) => bench::run(&args),
        Command::Data { command } => match command {
            DataCommand::Prepare(args) => data::prepare(&args),
            DataCommand::Tokenizer(args) => data::tokenizer(&args),
            DataCommand::Merge(args) => data::merge(&args),
            DataCommand::Verify(args) => data::verify(&args),
            DataCommand::Synth { task } => synth::run(&task),
        },
        Command::Convert(args) => convert::run(&args),
        Command::Import { command } => match command {
            ImportCommand::Hf(args) => hf::import::run(&args),
        },
        Command::Export { command } => match command {
            ExportCommand::Hf(args) => hf::export::run(&args),
        },
    };
    done.map(|()| Outcome::Done)
}
