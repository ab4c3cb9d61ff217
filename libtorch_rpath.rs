// Included by the build scripts of all three crates: when LIBTORCH is set (`.cargo/config.toml`
// sets it to where `.ci/setup tch` puts a CPU LibTorch), its library directory is baked into the
// run path of the crate's binaries and test binaries — any of which links LibTorch when the
// workspace is built with the `tch` feature — so that nothing needs `LD_LIBRARY_PATH`.

fn libtorch_rpath() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    // With LIBTORCH_USE_PYTORCH, torch-sys links the Python environment's LibTorch, not LIBTORCH.
    if std::env::var_os("LIBTORCH_USE_PYTORCH").is_some() {
        return;
    }
    if let Some(libtorch) = std::env::var_os("LIBTORCH") {
        let lib = std::path::Path::new(&libtorch).join("lib");
        let lib = lib.canonicalize().unwrap_or(lib);
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}
