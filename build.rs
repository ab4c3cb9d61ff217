//! Compiles the recipes under `recipes/` into the binary (see `src/recipe.rs`), and bakes
//! LibTorch's library directory into the binary's run path (`libtorch_rpath.rs`).

use std::path::{Path, PathBuf};

fn collect(dir: &Path, root: &Path, out: &mut Vec<(String, PathBuf)>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("readable recipes directory").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            collect(&path, root, out);
        } else if path.extension().is_some_and(|e| e == "toml") {
            let name = path
                .strip_prefix(root)
                .expect("under recipes/")
                .with_extension("")
                .to_string_lossy()
                .replace('\\', "/");
            out.push((name, path));
        }
    }
}

fn main() {
    // The manifest directory cargo gives this run, not the one this script was compiled in:
    // clones at other paths share one target directory (the CI cache), and cargo may reuse a
    // build script compiled for another clone, which may be gone.
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = Path::new(&manifest).join("recipes");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut recipes = Vec::new();
    collect(&root, &root, &mut recipes);
    for (_, path) in &recipes {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let entries: String = recipes
        .iter()
        .map(|(name, path)| {
            format!(
                "    ({name:?}, include_str!({:?})),\n",
                path.display().to_string()
            )
        })
        .collect();
    let code = format!(
        "/// Built-in recipes: (name, TOML).\nstatic BUILTIN: &[(&str, &str)] = &[\n{entries}];\n"
    );
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("recipes.rs");
    std::fs::write(out, code).expect("write recipes.rs");

    libtorch_rpath();
}

include!("libtorch_rpath.rs");
