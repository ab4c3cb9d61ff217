//! TensorBoard event files: every metric of `metrics.jsonl` as a scalar series, written as
//! training goes (`tensorboard --logdir runs/` shows every run below it).
//!
//! An event file is a sequence of TFRecords, each `length (u64 LE)`, `masked CRC-32C of the
//! length (u32 LE)`, `data`, `masked CRC-32C of the data`, where a masked CRC is
//! `((crc >> 15) | (crc << 17)) + 0xa282ead8`. Each record's data is an `Event` protocol buffer:
//! `wall_time` (field 1, double), `step` (2, int64) and either `file_version` (3, string; the
//! first record, "brain.Event:2") or a `Summary` (5) of `Value`s, each a `tag` (1, string) and a
//! `simple_value` (2, float).
//!
//! Series are named `train/loss`, `validation/loss`, `train/lambda/layer_0` …, the step is the
//! optimizer step. `metrics.jsonl` stays the record: a run resumed from a checkpoint (its log cut
//! back to that step) gets a new event file that replays the log, and the earlier files are
//! removed, so no step appears twice.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// The run directory's folder of event files.
pub const DIR: &str = "tensorboard";

/// One event file being written.
pub struct EventFile {
    file: BufWriter<File>,
}

impl EventFile {
    /// Starts a new event file in `dir`, removing earlier ones, with the records of `log`
    /// (the run's `metrics.jsonl`, if any) replayed into it.
    pub fn replacing(dir: &Path, log: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            if name.starts_with("events.out.tfevents.") {
                std::fs::remove_file(&path)?;
            }
        }
        let name = format!(
            "events.out.tfevents.{}.diffzoo.{}",
            now().floor(),
            std::process::id()
        );
        let mut events = Self {
            file: BufWriter::new(File::create(dir.join(name))?),
        };
        events.record(&event(now(), 0, Payload::FileVersion("brain.Event:2")))?;
        let text = match std::fs::read_to_string(log) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        for line in text.lines() {
            if let Ok(record) = serde_json::from_str::<serde_json::Value>(line) {
                events.write(&record)?;
            }
        }
        events.file.flush()?;
        Ok(events)
    }

    /// Appends one `metrics.jsonl` record's values (flushed by the caller).
    pub fn write(&mut self, record: &serde_json::Value) -> std::io::Result<()> {
        let Some(step) = record["step"].as_i64() else {
            return Ok(());
        };
        let values = scalars(record);
        if values.is_empty() {
            return Ok(());
        }
        self.record(&event(now(), step, Payload::Scalars(&values)))
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let length = (data.len() as u64).to_le_bytes();
        self.file.write_all(&length)?;
        self.file.write_all(&masked_crc(&length).to_le_bytes())?;
        self.file.write_all(data)?;
        self.file.write_all(&masked_crc(data).to_le_bytes())
    }
}

/// The series of one record: `{split}/{metric}` for each number in it, λ per layer.
fn scalars(record: &serde_json::Value) -> Vec<(String, f32)> {
    let split = record["split"].as_str().unwrap_or("train");
    let mut values: Vec<(String, f32)> = [
        "loss",
        "perplexity",
        "lr",
        "grad_norm",
        "tokens_per_sec",
        "tokens_seen",
        "lambda_scale",
    ]
    .iter()
    .filter_map(|key| Some((format!("{split}/{key}"), record[*key].as_f64()? as f32)))
    .collect();
    if let Some(lambdas) = record["lambda"].as_array() {
        values.extend(lambdas.iter().enumerate().filter_map(|(layer, l)| {
            Some((format!("{split}/lambda/layer_{layer}"), l.as_f64()? as f32))
        }));
    }
    values
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

enum Payload<'a> {
    FileVersion(&'a str),
    Scalars(&'a [(String, f32)]),
}

/// An `Event` protocol buffer.
fn event(wall_time: f64, step: i64, payload: Payload) -> Vec<u8> {
    let mut out = vec![0x09]; // field 1, 64-bit
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(0x10); // field 2, varint
    varint(&mut out, step as u64);
    match payload {
        Payload::FileVersion(version) => delimited(&mut out, 0x1a, version.as_bytes()),
        Payload::Scalars(values) => {
            let mut summary = Vec::new();
            for (tag, value) in values {
                let mut entry = Vec::new();
                delimited(&mut entry, 0x0a, tag.as_bytes());
                entry.push(0x15); // field 2, 32-bit
                entry.extend_from_slice(&value.to_le_bytes());
                delimited(&mut summary, 0x0a, &entry);
            }
            delimited(&mut out, 0x2a, &summary);
        }
    }
    out
}

/// A length-delimited field: its key, the length, the bytes.
fn delimited(out: &mut Vec<u8>, key: u8, bytes: &[u8]) {
    out.push(key);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82f63b78), masked as TFRecords store it.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= byte as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_and_encodings_are_those_of_the_formats() {
        // The CRC-32C check value (RFC 3720, B.4) and a varint from the protobuf documentation.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        let mut out = Vec::new();
        varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
        let scalars = scalars(&serde_json::json!({
            "split": "validation", "step": 20, "loss": 4.5, "perplexity": 90.0, "lambda": [0.2, 0.3]
        }));
        let tags: Vec<&str> = scalars.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(
            tags,
            [
                "validation/loss",
                "validation/perplexity",
                "validation/lambda/layer_0",
                "validation/lambda/layer_1"
            ]
        );
    }

    #[test]
    fn a_resumed_run_replays_its_log_into_one_new_file() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("metrics.jsonl");
        std::fs::write(
            &log,
            "{\"split\":\"train\",\"step\":1,\"loss\":5.0}\n{\"split\":\"train\",\"step\":2,\"loss\":4.0}\n",
        )
        .unwrap();
        let events = dir.path().join(DIR);
        drop(EventFile::replacing(&events, &log).unwrap());
        let mut again = EventFile::replacing(&events, &log).unwrap();
        again
            .write(&serde_json::json!({"split": "train", "step": 3, "loss": 3.0}))
            .unwrap();
        again.flush().unwrap();
        let files: Vec<_> = std::fs::read_dir(&events).unwrap().collect();
        assert_eq!(files.len(), 1);
        // Records: the file version, then steps 1, 2 and 3, each framed with valid checksums.
        let bytes = std::fs::read(files[0].as_ref().unwrap().path()).unwrap();
        let (mut at, mut records) = (0, 0);
        while at < bytes.len() {
            let length = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + length];
            let crc = u32::from_le_bytes(
                bytes[at + 12 + length..at + 16 + length]
                    .try_into()
                    .unwrap(),
            );
            assert_eq!(crc, masked_crc(data));
            at += 16 + length;
            records += 1;
        }
        assert_eq!(records, 4);
    }
}
