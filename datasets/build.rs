//! LibTorch's run path for this crate's test binaries (see `libtorch_rpath.rs`).

include!("../libtorch_rpath.rs");

fn main() {
    libtorch_rpath();
}
