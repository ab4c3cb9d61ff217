//! `diffzoo`: train, compare and sample DIFF Transformers and their baseline.

mod data;
mod device;
mod eval;
mod generate;
mod recipe;
mod run;
mod train;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

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
    Train {
        /// A built-in recipe name (`diffzoo recipe list`) or a TOML file.
        #[arg(long)]
        recipe: String,
        /// Device, e.g. cpu, flex, ndarray, wgpu, tch, tch-cuda:0, cuda:0 (default: the recipe's).
        #[arg(long)]
        device: Option<String>,
        /// Run directory (default: runs/<recipe name>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Continue the run in the run directory from its newest complete checkpoint.
        #[arg(long)]
        resume: bool,
        /// Override a recipe value, e.g. --set model.layers=4 (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Print metric lines instead of the dashboard, even on a terminal.
        #[arg(long)]
        no_dashboard: bool,
    },
    /// List or show recipes.
    Recipe {
        #[command(subcommand)]
        command: RecipeCommand,
    },
    /// Sample text from a run's model.
    Generate {
        /// Run directory.
        #[arg(long)]
        run: PathBuf,
        #[arg(long, default_value = "")]
        prompt: String,
        #[arg(long, default_value_t = 200)]
        max_tokens: usize,
        /// Sampling temperature; 0 decodes greedily.
        #[arg(long, default_value_t = 0.8)]
        temperature: f64,
        #[arg(long)]
        top_k: Option<usize>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value = "cpu")]
        device: String,
        #[arg(long)]
        json: bool,
    },
    /// Evaluate a run's model.
    Eval {
        #[command(subcommand)]
        command: EvalCommand,
    },
    /// Prepare token shards.
    Data {
        #[command(subcommand)]
        command: DataCommand,
    },
}

#[derive(Subcommand)]
enum RecipeCommand {
    /// List the built-in recipes.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Show a recipe resolved (inheritance and overrides applied) with its derived numbers.
    Show {
        name: String,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum EvalCommand {
    /// Validation loss and perplexity.
    Ppl {
        #[arg(long)]
        run: PathBuf,
        /// A shard directory (default: the run's data).
        #[arg(long)]
        data: Option<PathBuf>,
        /// Evaluate at most this many micro-batches.
        #[arg(long)]
        max_batches: Option<usize>,
        #[arg(long, default_value = "cpu")]
        device: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize text files (.txt, .jsonl, their .gz, directories) into shards.
    Prepare(data::PrepareArgs),
}

fn main() {
    if let Err(e) = dispatch(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train {
            recipe,
            device,
            out,
            resume,
            overrides,
            no_dashboard,
        } => train::run(&train::TrainArgs {
            recipe,
            device,
            out,
            resume,
            overrides,
            dashboard: !no_dashboard,
        }),
        Command::Recipe { command } => match command {
            RecipeCommand::List { json } => recipe::list(json),
            RecipeCommand::Show {
                name,
                overrides,
                json,
            } => recipe::show(&name, &overrides, json),
        },
        Command::Generate {
            run,
            prompt,
            max_tokens,
            temperature,
            top_k,
            seed,
            device,
            json,
        } => generate::run(&generate::GenerateArgs {
            run,
            prompt,
            max_tokens,
            temperature,
            top_k,
            seed,
            device,
            json,
        }),
        Command::Eval { command } => match command {
            EvalCommand::Ppl {
                run,
                data,
                max_batches,
                device,
                json,
            } => eval::ppl(&eval::PplArgs {
                run,
                data,
                max_batches,
                device,
                json,
            })
            .map(|_| ()),
        },
        Command::Data { command } => match command {
            DataCommand::Prepare(args) => data::prepare(&args),
        },
    }
}
