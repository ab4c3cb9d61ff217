//! One writer per run directory: `train` holds an exclusive `flock` on `run.lock` for as long as
//! it lives. The kernel releases the lock when the process ends, however it ends, so a lock left
//! by a killed process is taken over by the next `train` without anyone deleting a file.

use anyhow::{Context, Result, bail};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::Path;

pub const LOCK: &str = "run.lock";

/// The lock, released when dropped (or when the process ends).
pub struct RunLock {
    _file: Option<File>,
}

impl RunLock {
    /// Takes the lock of run directory `dir` (created if missing), or says who holds it.
    pub fn take(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(LOCK);
        let mut file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: flock on a descriptor this File owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let error = std::io::Error::last_os_error();
            if matches!(
                error.raw_os_error(),
                Some(libc::ENOSYS | libc::ENOLCK | libc::EOPNOTSUPP)
            ) {
                eprintln!(
                    "warning: {}: this file system cannot lock files ({error}); nothing keeps a second `train` out of this run",
                    path.display()
                );
                return Ok(Self { _file: None });
            }
            if error.kind() != std::io::ErrorKind::WouldBlock {
                bail!("locking {}: {error}", path.display());
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            bail!(
                "{} is being trained by another process ({}, holding {}): wait for it to finish or stop it first",
                dir.display(),
                match holder.trim() {
                    "" => "process id unknown".to_string(),
                    pid => format!("process {pid}"),
                },
                path.display()
            );
        }
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{}", std::process::id()))
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Self { _file: Some(file) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let first = RunLock::take(&run).unwrap();
        let err = RunLock::take(&run).err().unwrap().to_string();
        let pid = std::process::id().to_string();
        assert!(
            err.contains("being trained by another process") && err.contains(&pid),
            "{err}"
        );
        drop(first);
        RunLock::take(&run).unwrap();
    }
}
