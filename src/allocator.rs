//! The C allocator's settings for tensor workloads.
//!
//! glibc's malloc serves large blocks with fresh `mmap`s and hands memory back to the kernel as
//! soon as the top of the heap is free, so every training step on a CPU backend page-faults its
//! activations and gradients in again (zeroed by the kernel). Measured with `diffzoo bench` at
//! d 256, 4 layers, 8 × 256 tokens on 2 cores: ~25% of Flex's step and ~15% of LibTorch's went
//! to this. Raising the mmap threshold to 1 GiB and never trimming keeps freed blocks in the
//! process for the next step; the cost is that memory freed once stays reserved.

use std::sync::atomic::{AtomicBool, Ordering};

static TUNED: AtomicBool = AtomicBool::new(false);

/// Applies the settings unless the user set glibc's malloc tunables themselves.
pub fn tune() {
    TUNED.store(apply(), Ordering::Relaxed);
}

/// Whether [`tune`] put the settings in effect (reports say so).
pub fn tuned() -> bool {
    TUNED.load(Ordering::Relaxed)
}

fn apply() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let user_set = std::env::vars_os().any(|(key, _)| {
            let key = key.to_string_lossy();
            key.starts_with("MALLOC_") || key == "GLIBC_TUNABLES"
        });
        !user_set && set_options()
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// Sets the mmap threshold to 1 GiB and turns trimming off; `true` when glibc took both.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_options() -> bool {
    // SAFETY: mallopt only changes allocator parameters; `tune` calls this before any other
    // thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_accepts_the_settings() {
        // Test binaries run with the environment cargo gives them; glibc must take both values.
        assert!(super::set_options());
    }
}
