//! Verified checkpoints: each one is complete or invisible.
//!
//! Checkpoint `E` is the learner's files `model-E.bpk`, `optim-E.bpk` and `scheduler-E.bpk` and,
//! written after all three, `manifest-E.json`: the optimizer steps it holds, each file's size
//! and SHA-256, and the SHA-256 of those contents (so that a damaged manifest cannot pass either). Every file is written under a temporary name, fsync'd, renamed into place, and
//! the directory fsync'd after the renames, so that a crash or a power loss leaves either the
//! whole checkpoint or none of it under its name. A checkpoint verifies when its manifest is
//! present and every file matches it; one that does not (a torn or corrupted file, a missing
//! manifest) is reported and passed over by `--resume` and by every command that loads weights.
//!
//! Burn's learner saves the three files from three threads and asks for the deletion of the
//! checkpoint that falls out of `checkpoint.keep` right after: a deletion waits until a newer
//! checkpoint has verified, so the last verified one is never deleted. A save that fails (a full
//! disk) stops training with the error instead of panicking (see [`super::control`]), and leaves
//! the checkpoints before it as they were.

use super::control::Control;
use burn::train::checkpoint::{Checkpoint, Checkpointer, CheckpointerError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The learner's files of a checkpoint, in the order Burn saves them.
pub const PARTS: [&str; 3] = ["model", "optim", "scheduler"];

/// Marks a checkpoint directory whose checkpoints all have manifests (written when a run starts);
/// a directory without it is from an older diffzoo.
const FORMAT: &str = "format";
const FORMAT_TEXT: &str = "diffzoo checkpoints: {model,optim,scheduler}-E.bpk, manifest-E.json\n";

/// What `manifest-E.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub checkpoint: usize,
    /// Optimizer steps done when it was written.
    pub step: usize,
    pub files: Vec<FileEntry>,
    /// SHA-256 of the fields above (see [`Manifest::digest`]).
    pub sha256: String,
}

impl Manifest {
    fn new(checkpoint: usize, step: usize, files: Vec<FileEntry>) -> Self {
        let mut manifest = Self {
            checkpoint,
            step,
            files,
            sha256: String::new(),
        };
        manifest.sha256 = manifest.digest();
        manifest
    }

    /// SHA-256 of the checkpoint number, step and file entries, as compact JSON.
    fn digest(&self) -> String {
        let fields = serde_json::to_string(&(self.checkpoint, self.step, &self.files))
            .expect("manifest fields serialize");
        format!("{:x}", Sha256::digest(fields.as_bytes()))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
}

/// A checkpoint that verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verified {
    pub number: usize,
    pub step: usize,
}

/// A checkpoint found in the directory, and whether it verified (else why not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub number: usize,
    pub verdict: Result<usize, String>,
}

pub fn part_name(part: &str, number: usize) -> String {
    format!("{part}-{number}.bpk")
}

pub fn manifest_name(number: usize) -> String {
    format!("manifest-{number}.json")
}

/// Every checkpoint with a file in `dir`, oldest first, each verified against its manifest.
pub fn scan(dir: &Path) -> Vec<Found> {
    numbers(dir)
        .into_iter()
        .map(|number| Found {
            number,
            verdict: verify(dir, number),
        })
        .collect()
}

/// The newest checkpoint in `dir` that verifies, with the newer ones that did not (all of them
/// when none does). Older checkpoints are not read.
pub fn newest(dir: &Path) -> (Option<Verified>, Vec<Found>) {
    let mut rejected = Vec::new();
    for number in numbers(dir).into_iter().rev() {
        match verify(dir, number) {
            Ok(step) => return (Some(Verified { number, step }), rejected),
            Err(why) => rejected.push(Found {
                number,
                verdict: Err(why),
            }),
        }
    }
    (None, rejected)
}

/// [`newest`], with a warning on standard error for each newer checkpoint passed over.
pub fn newest_with_warnings(dir: &Path) -> (Option<Verified>, Vec<Found>) {
    let (newest, rejected) = newest(dir);
    for found in &rejected {
        if let Err(why) = &found.verdict {
            eprintln!(
                "warning: skipping checkpoint {} of {}: {why}",
                found.number,
                dir.display()
            );
        }
    }
    (newest, rejected)
}

/// What `scan` found, one line per checkpoint, for an error message.
pub fn describe(found: &[Found]) -> String {
    found
        .iter()
        .map(|f| match &f.verdict {
            Ok(step) => format!("checkpoint {} (step {step}): verified", f.number),
            Err(why) => format!("checkpoint {}: {why}", f.number),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// [`describe`] of the checkpoints a scan rejected, in parentheses after a space for the end
/// of an error message; empty where none was.
pub fn rejected(found: &[Found]) -> String {
    match found {
        [] => String::new(),
        found => format!(" ({})", describe(found)),
    }
}

/// Marks `dir` as holding checkpoints with manifests (a new run's, before its first).
pub fn mark_format(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(dir.join(FORMAT), FORMAT_TEXT))
        .map_err(|e| format!("writing {}: {e}", dir.join(FORMAT).display()))
}

/// Writes manifests for the checkpoints of a run written before diffzoo wrote them (a directory
/// without the [`mark_format`] marker): their files were renamed into place whole, and checkpoint
/// `E` holds `min(E · interval, total)` steps. Returns the checkpoints adopted.
pub fn adopt_legacy(dir: &Path, interval: usize, total: usize) -> Result<Vec<usize>, String> {
    let adopted = legacy_checkpoints(dir);
    for &number in &adopted {
        write_manifest(dir, number, (number * interval).min(total))?;
    }
    Ok(adopted)
}

/// Whether `--resume` has a checkpoint to take: one that verifies, or one to adopt (see
/// [`adopt_legacy`]).
pub fn resumable(dir: &Path) -> bool {
    newest(dir).0.is_some() || !legacy_checkpoints(dir).is_empty()
}

/// Whether checkpoint `number` has a manifest (complete once, whatever it is now).
pub fn has_manifest(dir: &Path, number: usize) -> bool {
    dir.join(manifest_name(number)).exists()
}

/// Removes the files of checkpoints older than `newest` that have no manifest (a kill while one
/// was written, or while one was deleted): nothing would ever delete them.
pub fn remove_unfinished(dir: &Path, newest: usize) -> Result<(), String> {
    for number in numbers(dir) {
        if number < newest && !has_manifest(dir, number) {
            remove(dir, number)?;
        }
    }
    Ok(())
}

/// Complete checkpoints of a directory from an older diffzoo.
fn legacy_checkpoints(dir: &Path) -> Vec<usize> {
    if dir.join(FORMAT).exists() {
        return Vec::new();
    }
    let numbers = numbers(dir);
    if numbers.iter().any(|&n| dir.join(manifest_name(n)).exists()) {
        return Vec::new();
    }
    numbers
        .into_iter()
        .filter(|&n| PARTS.iter().all(|p| dir.join(part_name(p, n)).is_file()))
        .collect()
}

/// Removes checkpoint `number` (its manifest first, so that it is invisible from then on).
fn remove(dir: &Path, number: usize) -> Result<(), String> {
    for name in std::iter::once(manifest_name(number)).chain(PARTS.map(|p| part_name(p, number))) {
        let path = dir.join(&name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(format!("removing {}: {e}", path.display()));
            }
            _ => {}
        }
    }
    sync_dir(dir)
}

/// Removes the temporary files a killed writer left in `dir` (the caller holds the run's lock).
pub fn remove_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().ends_with(".tmp") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Checkpoint numbers with any file (part or manifest) in `dir`, ascending.
pub fn numbers(dir: &Path) -> Vec<usize> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let numbers: BTreeSet<usize> = entries
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            let (stem, number) = name
                .strip_suffix(".bpk")
                .or_else(|| name.strip_suffix(".json"))?
                .rsplit_once('-')?;
            (stem == "manifest" || PARTS.contains(&stem))
                .then(|| number.parse().ok())
                .flatten()
        })
        .collect();
    numbers.into_iter().collect()
}

/// The steps checkpoint `number` holds, if its manifest is present and every file matches it.
pub fn verify(dir: &Path, number: usize) -> Result<usize, String> {
    let path = dir.join(manifest_name(number));
    let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!(
            "no {} (the checkpoint was not completed, or was written by an older diffzoo: `diffzoo train --resume` adds manifests to those)",
            manifest_name(number)
        ),
        _ => format!("{}: {e}", path.display()),
    })?;
    let manifest: Manifest = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a checkpoint manifest ({e})", path.display()))?;
    if manifest.digest() != manifest.sha256 {
        return Err(format!(
            "{}: its contents differ from its own SHA-256 (a corrupted manifest)",
            path.display()
        ));
    }
    let names: BTreeSet<&str> = manifest.files.iter().map(|f| f.name.as_str()).collect();
    let wanted = PARTS.map(|p| part_name(p, number));
    if manifest.checkpoint != number || names != wanted.iter().map(String::as_str).collect() {
        return Err(format!(
            "{}: describes checkpoint {} with files {names:?}, not checkpoint {number}",
            path.display(),
            manifest.checkpoint
        ));
    }
    for file in &manifest.files {
        let (bytes, sha256) = digest(&dir.join(&file.name))?;
        if bytes != file.bytes {
            return Err(format!(
                "{}: {bytes} bytes, its manifest says {} (a torn file)",
                file.name, file.bytes
            ));
        }
        if sha256 != file.sha256 {
            return Err(format!(
                "{}: its SHA-256 differs from its manifest's (a corrupted file)",
                file.name
            ));
        }
    }
    Ok(manifest.step)
}

/// Size and SHA-256 (hex) of a file.
fn digest(path: &Path) -> Result<(u64, String), String> {
    let error = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut file = File::open(path).map_err(error)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0; 1 << 20];
    let mut bytes = 0;
    loop {
        let n = file.read(&mut buffer).map_err(error)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        bytes += n as u64;
    }
    Ok((bytes, format!("{:x}", hasher.finalize())))
}

/// Writes `manifest-E.json` over the checkpoint's files as they are on disk.
fn write_manifest(dir: &Path, number: usize, step: usize) -> Result<(), String> {
    let files = PARTS
        .iter()
        .map(|part| {
            let name = part_name(part, number);
            let (bytes, sha256) = digest(&dir.join(&name))?;
            Ok(FileEntry {
                name,
                bytes,
                sha256,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let manifest = Manifest::new(number, step, files);
    let json = serde_json::to_string_pretty(&manifest).expect("a manifest serializes");
    let path = dir.join(manifest_name(number));
    write_whole(&path, json.as_bytes()).map_err(|e| format!("writing {}: {e}", path.display()))?;
    sync_dir(dir)
}

/// Writes `bytes` to a temporary name, fsyncs and renames it to `path`: a crash leaves the old
/// file or the new one, never a torn one (nothing is left under the temporary name on failure).
pub fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = temporary(path);
    let written = File::create(&tmp)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn temporary(path: &Path) -> PathBuf {
    let mut name = path.file_name().expect("a file name").to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

fn sync_dir(dir: &Path) -> Result<(), String> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| format!("syncing {}: {e}", dir.display()))
}

/// Writes the learner's checkpoints into one directory, completing each with its manifest (see
/// the module documentation). [`CheckpointWriter::part`] gives Burn one checkpointer per file.
pub struct CheckpointWriter {
    dir: PathBuf,
    control: Arc<Control>,
    state: Mutex<WriterState>,
}

#[derive(Default)]
struct WriterState {
    /// Parts written of checkpoints not yet complete.
    written: BTreeMap<usize, BTreeSet<&'static str>>,
    /// The newest checkpoint that verified.
    newest: Option<Verified>,
    /// Deletions asked for before a newer checkpoint verified.
    pending: BTreeSet<usize>,
    /// A save failed: the run is stopping, nothing more is written.
    failed: bool,
}

impl CheckpointWriter {
    /// Writes into `dir` for a run whose newest verified checkpoint is `newest`; `control` gives
    /// each checkpoint's step and takes a failure.
    pub fn new(dir: &Path, newest: Option<Verified>, control: Arc<Control>) -> Arc<Self> {
        Arc::new(Self {
            dir: dir.to_path_buf(),
            control,
            state: Mutex::new(WriterState {
                newest,
                ..WriterState::default()
            }),
        })
    }

    /// The checkpointer of one of [`PARTS`].
    pub fn part(self: &Arc<Self>, part: &'static str) -> Part {
        Part {
            writer: self.clone(),
            part,
        }
    }

    /// The newest checkpoint written and verified, or the run's before it.
    pub fn newest(&self) -> Option<Verified> {
        self.lock().newest
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WriterState> {
        self.state.lock().expect("checkpoint writer lock")
    }

    fn save<R: Checkpoint>(&self, part: &'static str, number: usize, record: R) {
        if self.lock().failed {
            return;
        }
        let path = self.dir.join(part_name(part, number));
        let tmp = temporary(&path);
        let written = std::fs::create_dir_all(&self.dir)
            .map_err(|e| format!("creating {}: {e}", self.dir.display()))
            .and_then(|()| {
                record
                    .save(tmp.clone())
                    .map_err(|e| format!("writing {}: {e}", tmp.display()))
            })
            .and_then(|()| {
                File::open(&tmp)
                    .and_then(|f| f.sync_all())
                    .and_then(|()| std::fs::rename(&tmp, &path))
                    .map_err(|e| format!("writing {}: {e}", path.display()))
            });
        let mut state = self.lock();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return self.fail(&mut state, number, e);
        }
        if state.failed {
            let _ = std::fs::remove_file(&path);
            return;
        }
        let parts = state.written.entry(number).or_default();
        parts.insert(part);
        if parts.len() < PARTS.len() {
            return;
        }
        state.written.remove(&number);
        let step = self.control.checkpoint_step(number);
        if let Err(e) = write_manifest(&self.dir, number, step) {
            return self.fail(&mut state, number, e);
        }
        state.newest = Some(Verified { number, step });
        let older: Vec<usize> = state.pending.range(..number).copied().collect();
        for old in older {
            state.pending.remove(&old);
            if let Err(e) = remove(&self.dir, old) {
                eprintln!("warning: checkpoint {old}: {e}");
            }
        }
    }

    fn delete(&self, number: usize) {
        let mut state = self.lock();
        if state.newest.is_some_and(|newest| newest.number > number) {
            if let Err(e) = remove(&self.dir, number) {
                eprintln!("warning: checkpoint {number}: {e}");
            }
        } else {
            state.pending.insert(number);
        }
    }

    /// Records the failure, removes what was written of checkpoint `number` and has training
    /// stopped.
    fn fail(&self, state: &mut WriterState, number: usize, error: String) {
        let kept = match state.newest {
            Some(newest) => format!(
                "checkpoint {} (step {}) is intact",
                newest.number, newest.step
            ),
            None => "no earlier checkpoint exists".to_string(),
        };
        let message = format!("cannot write checkpoint {number}: {error}; {kept}");
        let _ = remove(&self.dir, number);
        state.written.remove(&number);
        state.failed = true;
        self.control.fail(message);
    }
}

/// Burn's checkpointer for one file of each checkpoint (see [`CheckpointWriter`]). Errors are
/// the writer's to report: Burn's learner panics on a checkpointer error.
pub struct Part {
    writer: Arc<CheckpointWriter>,
    part: &'static str,
}

impl<R: Checkpoint> Checkpointer<R> for Part {
    fn save(&self, number: usize, record: R) -> Result<(), CheckpointerError> {
        self.writer.save(self.part, number, record);
        Ok(())
    }

    fn restore(&self, number: usize) -> Result<R, CheckpointerError> {
        R::load(self.writer.dir.join(part_name(self.part, number)))
    }

    fn delete(&self, number: usize) -> Result<(), CheckpointerError> {
        self.writer.delete(number);
        Ok(())
    }
}
