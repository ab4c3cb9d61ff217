//! What the end-to-end tests share: running the binary and reading its output.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

/// The `--device` of every backend compiled into the binary.
pub const BACKENDS: &[&str] = &[
    #[cfg(feature = "flex")]
    "flex",
    #[cfg(feature = "ndarray")]
    "ndarray",
    #[cfg(feature = "wgpu")]
    "wgpu",
    #[cfg(feature = "tch")]
    "tch",
];

/// The binary with a shared cache (tokenizers and shards are made once per test run).
pub fn command(args: &[&str]) -> Command {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("diffzoo-cache");
    let mut command = Command::new(env!("CARGO_BIN_EXE_diffzoo"));
    command.args(args).env("DIFFZOO_CACHE", cache);
    command
}

/// Runs the binary to its end.
pub fn diffzoo(args: &[&str]) -> Output {
    command(args).output().expect("the binary runs")
}

pub fn ok(args: &[&str]) -> String {
    let out = diffzoo(args);
    assert!(
        out.status.success(),
        "diffzoo {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

pub fn fails(args: &[&str]) -> String {
    let out = diffzoo(args);
    assert!(!out.status.success(), "diffzoo {args:?} should fail");
    String::from_utf8(out.stderr).expect("utf-8 output")
}

pub fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}
