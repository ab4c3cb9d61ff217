//! Checkpoints written to a temporary name and renamed, so that a crash never leaves a torn
//! file under a checkpoint's name (Burn's `FileCheckpointer` writes in place).

use burn::train::checkpoint::{Checkpoint, Checkpointer, CheckpointerError};
use std::path::{Path, PathBuf};

pub struct AtomicCheckpointer {
    dir: PathBuf,
    name: &'static str,
}

impl AtomicCheckpointer {
    pub fn new(dir: &Path, name: &'static str) -> Self {
        Self {
            dir: dir.to_path_buf(),
            name,
        }
    }

    fn path(&self, epoch: usize) -> PathBuf {
        self.dir.join(format!("{}-{epoch}.bpk", self.name))
    }
}

impl<R: Checkpoint> Checkpointer<R> for AtomicCheckpointer {
    fn save(&self, epoch: usize, record: R) -> Result<(), CheckpointerError> {
        std::fs::create_dir_all(&self.dir).map_err(CheckpointerError::IOError)?;
        let path = self.path(epoch);
        let tmp = path.with_extension("bpk.tmp");
        record.save(tmp.clone())?;
        std::fs::rename(&tmp, &path).map_err(CheckpointerError::IOError)
    }

    fn restore(&self, epoch: usize) -> Result<R, CheckpointerError> {
        R::load(self.path(epoch))
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        let path = self.path(epoch);
        if path.exists() {
            std::fs::remove_file(path).map_err(CheckpointerError::IOError)?;
        }
        Ok(())
    }
}
