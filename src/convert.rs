//! `diffzoo convert RUN --to diff|diff-v2 --out RUN2`: a run whose model is RUN's baseline
//! Transformer with every attention layer turned into differential attention and every other
//! weight carried over exactly ([`diffzoo_models::convert`] says how each is made).
//!
//! RUN2 is a run as any other: `generate`, every `eval`, `compare` and `export hf` read it, and
//! `train --recipe RUN2/recipe.toml --out RUN3` fine-tunes it (its `training.init_from` is RUN2).
//! Its recipe is RUN's with the attention replaced; `convert.json` records the source and the
//! initialisation. With `--warmup N` the recipe holds `training.lambda_warmup = N`: fine-tuning
//! scales λ by min(1, step/N), and RUN2 itself, at step 0, computes with the scale 0.
//!
//! The run is written under a temporary name and renamed at the end: an error leaves nothing at
//! `--out`.

use crate::device;
use crate::layout;
use crate::recipe::Recipe;
use crate::run;
use anyhow::{Context, Result, anyhow, bail};
use diffzoo_models::AttentionKind;
use diffzoo_models::convert::{self, Init, Options};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, clap::Args)]
pub struct ConvertArgs {
    /// The run whose baseline Transformer to convert (trained here or imported).
    pub run: PathBuf,
    /// The attention to convert to: diff (V1) or diff-v2.
    #[arg(long)]
    pub to: AttentionKind,
    /// The run directory to write (must not exist).
    #[arg(long)]
    pub out: PathBuf,
    /// How the new attention is made: for diff-v2 `copy` (the source exactly; the default) or
    /// `perturbed` (the second map of each pair perturbed by --noise); for diff `paired`.
    #[arg(long)]
    pub init: Option<String>,
    /// With `--init perturbed`: the perturbation's standard deviation relative to the RMS of the
    /// layer's query weights.
    #[arg(long, default_value_t = 0.02)]
    pub noise: f64,
    /// Warm the negative map up over this many fine-tuning steps (`training.lambda_warmup`).
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Seed of what is drawn (DIFF V1's λ vectors, the perturbation).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

/// What `convert.json` in the run records.
pub const NOTE: &str = "convert.json";

pub fn run(args: &ConvertArgs) -> Result<()> {
    let options = options(args)?;
    let source = run::run_recipe(&args.run)?;
    let source_config = source.model_config();
    convert::converted_config(&source_config, args.to)
        .map_err(|e| anyhow!("{}: {e}", args.run.join(layout::RECIPE).display()))?;
    let staging = crate::hf::staging(&args.out)?;
    let result = write(args, &source, options, &staging);
    if result.is_err() {
        std::fs::remove_dir_all(&staging).ok();
    }
    let exact = result?;
    std::fs::rename(&staging, &args.out)
        .with_context(|| format!("renaming {} to {}", staging.display(), args.out.display()))?;
    let how = match (exact, args.warmup) {
        (true, None) => "computes what the source computes".to_string(),
        (true, Some(n)) => {
            format!("computes what the source computes at the start of its {n}-step λ warm-up")
        }
        (false, _) => "approximates the source (fine-tune it: see convert.json)".to_string(),
    };
    println!(
        "converted {} ({} layers × {}) to {} with --init {} into {}: it {how}; fine-tune with `diffzoo train --recipe {} --out RUN`",
        args.run.display(),
        source_config.layers,
        source_config.d_model,
        args.to,
        options.init.name(),
        args.out.display(),
        args.out.join(layout::RECIPE).display(),
    );
    Ok(())
}

/// Refuses to start training from a DIFF V2 conversion in `init` (its `convert.json`) under a
/// warm-up choice other than the one its W_o was written for: converted with `--warmup`, W_o is
/// the source's and only a warm-up's scale 0 computes the source (at scale 1, half of each
/// head); converted without, W_o is doubled for λ = ½, and a warm-up's scale 0 doubles every
/// head. Other runs, and V1 conversions (never exact), pass.
pub fn check_start(init: &Path, recipe: &Recipe) -> Result<()> {
    let path = init.join(NOTE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let note: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    if note["to"].as_str() != Some(AttentionKind::DiffV2.as_str()) {
        return Ok(());
    }
    let converted = note["lambda_warmup"].as_u64();
    match (converted, recipe.training.warmup_steps()) {
        (Some(n), None) => bail!(
            "`training.lambda_warmup` is unset or 0, but `training.init_from` = {:?} is a DIFF V2 conversion made with --warmup {n} (its W_o is the source's): without a warm-up it starts at half of every attention output, not the source; keep a warm-up (any length) or convert again without --warmup",
            init.display().to_string()
        ),
        (None, Some(m)) => bail!(
            "`training.lambda_warmup` = {m}, but `training.init_from` = {:?} is a DIFF V2 conversion made without --warmup (its W_o is doubled for the subtracted half): at the warm-up's scale 0 it starts at twice every attention output, not the source; drop the warm-up or convert again with --warmup {m}",
            init.display().to_string()
        ),
        _ => Ok(()),
    }
}

/// The conversion the arguments ask for; a wrong `--init` or `--noise` names the choices.
fn options(args: &ConvertArgs) -> Result<Options> {
    let offered = Init::offered(args.to);
    let name = args
        .init
        .as_deref()
        .or(offered.first().copied())
        .ok_or_else(|| {
            anyhow!(
                "--to transformer: convert turns a Transformer into DIFF; choose diff or diff-v2"
            )
        })?;
    let init = match name {
        "copy" => Init::Copy,
        "perturbed" => Init::Perturbed { noise: args.noise },
        "paired" => Init::Paired,
        other => bail!(
            "--init {other}: converting to {} offers {}",
            args.to,
            offered.join(", ")
        ),
    };
    if !offered.contains(&init.name()) {
        bail!(
            "--init {name} does not convert to {}: choose {}",
            args.to,
            offered.join(" or ")
        );
    }
    if !(args.noise.is_finite() && args.noise > 0.0) {
        bail!("--noise {} must be positive", args.noise);
    }
    if args.warmup == Some(0) {
        bail!("--warmup must be positive (leave it out for no warm-up)");
    }
    Ok(Options {
        to: args.to,
        init,
        warmup: args.warmup.is_some(),
    })
}

/// Writes the converted run into `staging`; whether it computes the source's function exactly.
fn write(args: &ConvertArgs, source: &Recipe, options: Options, staging: &Path) -> Result<bool> {
    let device = device::parse("cpu")?;
    device.seed(args.seed);
    let (model, weights) = run::load_model(&args.run, source, &device)?;
    let model = convert::convert(&model, &source.model_config(), options)
        .map_err(|e| anyhow!("{}: {e}", args.run.display()))?;
    std::fs::create_dir_all(staging).with_context(|| format!("creating {}", staging.display()))?;
    let out = std::path::absolute(&args.out)
        .with_context(|| format!("resolving {}", args.out.display()))?;
    let recipe = recipe_of(args, source, &out, options)?;
    crate::hf::write_file(&staging.join(layout::RECIPE), recipe.to_toml())?;
    let tokenizer = args.run.join(layout::TOKENIZER);
    if tokenizer.is_file() {
        std::fs::copy(&tokenizer, staging.join(layout::TOKENIZER))
            .with_context(|| format!("copying {}", tokenizer.display()))?;
    }
    let companions = layout::copy_companions(&args.run, staging)?;
    // V2 with copies is the source; with a warm-up, perturbed or not, it is at the warm-up's
    // start (the second heads are multiplied by 0 there).
    let exact = args.to == AttentionKind::DiffV2 && (options.init == Init::Copy || options.warmup);
    let note = serde_json::json!({
        "source": std::path::absolute(&args.run)?.display().to_string(),
        "source_weights": weights.stage(),
        "source_attention": source.model.attention.as_str(),
        "to": args.to.as_str(),
        "init": options.init.name(),
        "noise": matches!(options.init, Init::Perturbed { .. }).then_some(args.noise),
        "lambda_warmup": args.warmup,
        "seed": args.seed,
        "exact": exact,
        "tokenizer_files": companions,
        "diffzoo": env!("CARGO_PKG_VERSION"),
    });
    crate::hf::write_file(
        &staging.join(NOTE),
        serde_json::to_string_pretty(&note)? + "\n",
    )?;
    run::save_final(staging, &model, None, false)?;
    Ok(exact)
}

/// RUN's recipe with the attention replaced, the class `export hf` writes following it, the
/// tokenizer read from RUN2, and fine-tuning starting from RUN2's weights.
fn recipe_of(args: &ConvertArgs, source: &Recipe, out: &Path, options: Options) -> Result<Recipe> {
    // The source's recipe as it is (an import without a tokenizer has no data to train on until
    // one is given), the model already checked by `converted_config`.
    let mut recipe = source.clone();
    let from = std::path::absolute(&args.run)?;
    recipe.description = format!(
        "{} converted from the Transformer of {} (--init {}{})",
        args.to,
        from.display(),
        options.init.name(),
        args.warmup
            .map_or(String::new(), |n| format!(", λ warm-up over {n} steps"))
    );
    recipe.model.attention = args.to;
    recipe.model.hf_architecture = None;
    let same = |a: &Path, b: &Path| {
        a.canonicalize()
            .ok()
            .is_some_and(|a| b.canonicalize().ok() == Some(a))
    };
    if let Some(tokenizer) = &mut recipe.data.tokenizer
        && same(Path::new(tokenizer.as_str()), &from.join(layout::TOKENIZER))
    {
        *tokenizer = out.join(layout::TOKENIZER).display().to_string();
    }
    recipe.training.init_from = Some(out.display().to_string());
    recipe.training.lambda_warmup = args.warmup;
    Ok(recipe)
}
