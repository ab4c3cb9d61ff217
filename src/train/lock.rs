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
    file: File,
    path: std::path::PathBuf,
}

impl RunLock {
    /// Takes the lock of run directory `dir` (created if missing), or says who holds it. Its
    /// file keeps naming the last process that [claimed](Self::claim) the run.
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
                return Ok(Self { file, path });
            }
            if error.kind() != std::io::ErrorKind::WouldBlock {
                bail!("locking {}: {error}", path.display());
            }
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            bail!(
                "{} is being trained by another process ({}, holding {}): wait for it to finish or stop it first",
                dir.display(),
                match Holder::parse(&text) {
                    None => "process id unknown".to_string(),
                    Some(h) => format!("process {} on {}", h.pid, h.host),
                },
                path.display()
            );
        }
        Ok(Self { file, path })
    }

    /// Writes `PID HOST` into the lock file: this process now trains the run (called once the
    /// run directory is its own, so a refused `train` leaves the last trainer named).
    pub fn claim(&mut self) -> Result<()> {
        let text = format!("{} {}\n", std::process::id(), host());
        self.file
            .rewind()
            .and_then(|()| self.file.write_all(text.as_bytes()))
            .and_then(|()| self.file.set_len(text.len() as u64))
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// Who took a run's lock last: `run.lock` holds `PID HOST`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    pub host: String,
}

impl Holder {
    /// The last taker of `dir`'s lock, if any ever took it.
    pub fn of(dir: &Path) -> Option<Self> {
        Self::parse(&std::fs::read_to_string(dir.join(LOCK)).ok()?)
    }

    /// `PID HOST`, or a lone `PID` as runs wrote before hosts were recorded (this host's).
    fn parse(text: &str) -> Option<Self> {
        let mut words = text.split_whitespace();
        let pid = words.next()?.parse().ok()?;
        let host = words.next().map_or_else(host, str::to_string);
        Some(Self { pid, host })
    }

    /// Whether the lock is held now — answerable only on the holder's own host, from the
    /// kernel's table of locks (`/proc/locks`, read without touching the lock: a `train` starting
    /// meanwhile is never refused), else from whether the process is alive.
    pub fn holds(&self, dir: &Path) -> Option<bool> {
        if self.host != host() {
            return None;
        }
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(dir.join(LOCK)).ok()?;
        let device = format!(
            "{:02x}:{:02x}",
            libc::major(meta.dev()),
            libc::minor(meta.dev())
        );
        let (inode, pid) = (meta.ino().to_string(), self.pid.to_string());
        Some(match std::fs::read_to_string("/proc/locks") {
            // `N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END`; waiters have `->` as their
            // second word. The inode must match, and the device or (where a stacked file system
            // shows another device) the process that claimed the run.
            Ok(table) => table.lines().any(|line| {
                let words: Vec<&str> = line.split_whitespace().collect();
                let Some((dev, ino)) = words.get(5).and_then(|w| w.rsplit_once(':')) else {
                    return false;
                };
                words[1] == "FLOCK" && ino == inode && (dev == device || words[4] == pid)
            }),
            Err(_) => alive(self.pid),
        })
    }
}

/// Whether process `pid` exists (one of another user's too).
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only asks whether the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// This machine's host name.
pub fn host() -> String {
    let mut name = [0u8; 256];
    // SAFETY: the buffer is valid for its length; the name is NUL-terminated when it fits.
    if unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } != 0 {
        return "localhost".into();
    }
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    String::from_utf8_lossy(&name[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let mut first = RunLock::take(&run).unwrap();
        first.claim().unwrap();
        let err = RunLock::take(&run).err().unwrap().to_string();
        let pid = std::process::id();
        assert!(
            err.contains("being trained by another process")
                && err.contains(&format!("process {pid} on {}", host())),
            "{err}"
        );
        let holder = Holder::of(&run).unwrap();
        assert_eq!(holder, Holder { pid, host: host() });
        assert_eq!(holder.holds(&run), Some(true));
        drop(first);
        assert_eq!(holder.holds(&run), Some(false));
        RunLock::take(&run).unwrap();
        let elsewhere = Holder {
            pid,
            host: "another-host".into(),
        };
        assert_eq!(elsewhere.holds(&run), None);
        // Before hosts were recorded: a lone process id is this host's.
        assert_eq!(Holder::parse("123\n").map(|h| h.host), Some(host()));
        assert!(alive(pid) && !alive(0) && !alive(u32::MAX));
    }
}
