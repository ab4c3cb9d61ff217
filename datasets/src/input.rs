//! Input text: `.txt` files (one document each), `.jsonl` files (one document per line, its text
//! in a configurable field), either gzipped (`.gz`), `.parquet` files (one document per row, its
//! text in a string column of the same name), and directories walked recursively.
//!
//! Whole-file problems (a missing path, an explicitly named file of another type, a directory
//! with nothing usable, corrupt gzip or Parquet, a Parquet file without that string column) are
//! errors. Per-document problems (invalid UTF-8, a malformed JSON line, a missing, null or
//! non-string field, an empty text) are skips: counted, reported with file and line or row,
//! never silent.

use crate::error::{DataError, Result};
use crate::parquet_text::{ParquetText, RowText};
use flate2::read::MultiGzDecoder;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// One document of text and where it came from (`path` or `path:line`, and a Parquet file's
/// row).
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    pub origin: String,
    pub text: String,
    /// The row of a Parquet file, numbered from 0.
    pub row: Option<u64>,
}

/// Something left out, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skip {
    pub file: String,
    /// 1-based line for JSON lines; `None` for a whole file or a Parquet row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
    /// Row of a Parquet file, numbered from 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row: Option<u64>,
    pub reason: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Text,
    JsonLines,
    Parquet,
}

/// What the input types are, for messages.
const TYPES: &str = ".txt, .jsonl, .txt.gz, .jsonl.gz or .parquet";

/// A file to read.
#[derive(Debug, Clone)]
pub struct InputFile {
    pub path: PathBuf,
    format: Format,
    gzip: bool,
}

impl InputFile {
    /// `None` for a file type we do not read.
    fn classify(path: &Path) -> Option<Self> {
        let name = path.file_name()?.to_str()?.to_ascii_lowercase();
        let (stem, gzip) = match name.strip_suffix(".gz") {
            Some(stem) => (stem.to_string(), true),
            None => (name, false),
        };
        let format = if stem.ends_with(".txt") {
            Format::Text
        } else if stem.ends_with(".jsonl") {
            Format::JsonLines
        } else if stem.ends_with(".parquet") && !gzip {
            Format::Parquet
        } else {
            return None;
        };
        Some(Self {
            path: path.to_path_buf(),
            format,
            gzip,
        })
    }
}

/// A stream of documents for `prepare`, which reports what it skipped and how far it got.
pub trait DocumentSource: Iterator<Item = Result<Document>> {
    /// What was left out so far.
    fn skipped(&self) -> Vec<Skip>;
    /// Input bytes consumed so far (for progress).
    fn bytes_read(&self) -> u64;
}

/// Documents already in memory (the embedded corpus, tests).
pub struct InMemory {
    docs: std::vec::IntoIter<Document>,
    bytes: u64,
}

impl InMemory {
    pub fn new(docs: Vec<Document>) -> Self {
        Self {
            bytes: docs.iter().map(|d| d.text.len() as u64).sum(),
            docs: docs.into_iter(),
        }
    }
}

impl Iterator for InMemory {
    type Item = Result<Document>;

    fn next(&mut self) -> Option<Self::Item> {
        self.docs.next().map(Ok)
    }
}

impl DocumentSource for InMemory {
    fn skipped(&self) -> Vec<Skip> {
        Vec::new()
    }

    fn bytes_read(&self) -> u64 {
        self.bytes
    }
}

/// Resolves the given paths into the files to read (directories walked recursively, in sorted
/// order) and the files skipped for their type.
pub fn resolve(paths: &[PathBuf]) -> Result<(Vec<InputFile>, Vec<Skip>)> {
    if paths.is_empty() {
        return Err(DataError::Invalid("no input paths given".into()));
    }
    let (mut files, mut skips) = (Vec::new(), Vec::new());
    for path in paths {
        let meta = std::fs::metadata(path).map_err(DataError::io(path))?;
        if meta.is_dir() {
            let before = files.len();
            walk(path, &mut files, &mut skips)?;
            if files.len() == before {
                return Err(DataError::Input {
                    path: path.clone(),
                    reason: format!("directory has no {TYPES} files"),
                });
            }
        } else {
            files.push(InputFile::classify(path).ok_or_else(|| DataError::Input {
                path: path.clone(),
                reason: format!("unsupported file type (expected {TYPES})"),
            })?);
        }
    }
    Ok((files, skips))
}

fn walk(dir: &Path, files: &mut Vec<InputFile>, skips: &mut Vec<Skip>) -> Result<()> {
    let mut entries = std::fs::read_dir(dir)
        .map_err(DataError::io(dir))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(DataError::io(dir))?;
    entries.sort();
    for path in entries {
        if path.is_dir() {
            walk(&path, files, skips)?;
        } else if let Some(file) = InputFile::classify(&path) {
            files.push(file);
        } else {
            skips.push(Skip {
                file: path.display().to_string(),
                line: None,
                row: None,
                reason: "unsupported file type".into(),
            });
        }
    }
    Ok(())
}

/// Reads the documents of `files` lazily, one file at a time; skips accumulate in
/// [`Documents::skips`]. Items are errors only for whole-file problems.
pub struct Documents {
    files: std::vec::IntoIter<InputFile>,
    current: Option<(InputFile, Box<dyn BufRead + Send>, usize)>,
    /// The Parquet file being read and the rows decoded from it not yet handed out.
    parquet: Option<(ParquetText, std::vec::IntoIter<(u64, RowText)>)>,
    field: String,
    skips: Vec<Skip>,
    /// Bytes of input files opened so far (compressed size for gzip).
    bytes_opened: u64,
}

impl Documents {
    pub fn new(files: Vec<InputFile>, text_field: &str) -> Self {
        Self {
            files: files.into_iter(),
            current: None,
            parquet: None,
            field: text_field.to_string(),
            skips: Vec::new(),
            bytes_opened: 0,
        }
    }

    fn open(&mut self, file: InputFile) -> Result<Box<dyn BufRead + Send>> {
        let handle = File::open(&file.path).map_err(DataError::io(&file.path))?;
        self.bytes_opened += handle.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(if file.gzip {
            Box::new(BufReader::new(MultiGzDecoder::new(handle)))
        } else {
            Box::new(BufReader::new(handle))
        })
    }

    fn skip(&mut self, file: &Path, line: Option<usize>, reason: impl Into<String>) {
        self.skips.push(Skip {
            file: file.display().to_string(),
            line,
            row: None,
            reason: reason.into(),
        });
    }

    fn open_parquet(&mut self, file: &InputFile) -> Result<()> {
        let table = ParquetText::open(&file.path, &self.field)?;
        self.bytes_opened += std::fs::metadata(&file.path).map_or(0, |m| m.len());
        self.parquet = Some((table, Vec::new().into_iter()));
        Ok(())
    }

    /// The next document of the current Parquet file, or `None` at its end.
    fn next_row(&mut self) -> Option<Result<Document>> {
        loop {
            let (table, rows) = self.parquet.as_mut()?;
            let Some((row, text)) = rows.next() else {
                match table.next_rows() {
                    Some(Ok(next)) => *rows = next.into_iter(),
                    Some(Err(e)) => {
                        self.parquet = None;
                        return Some(Err(e));
                    }
                    None => self.parquet = None,
                }
                continue;
            };
            let file = table.path().display().to_string();
            match text {
                Ok(text) => {
                    return Some(Ok(Document {
                        origin: file,
                        text,
                        row: Some(row),
                    }));
                }
                Err(reason) => self.skips.push(Skip {
                    file,
                    line: None,
                    row: Some(row),
                    reason,
                }),
            }
        }
    }

    /// The next document of the current JSON-lines file, or `None` at its end.
    fn next_line(&mut self) -> Option<Result<Document>> {
        loop {
            let (file, reader, line_no) = self.current.as_mut()?;
            let mut bytes = Vec::new();
            match reader.read_until(b'\n', &mut bytes) {
                Ok(0) => {
                    self.current = None;
                    return None;
                }
                Ok(_) => {}
                Err(e) => {
                    let path = file.path.clone();
                    self.current = None;
                    return Some(Err(read_error(&path, e)));
                }
            }
            *line_no += 1;
            let (path, line) = (file.path.clone(), *line_no);
            let Ok(text) = std::str::from_utf8(&bytes) else {
                self.skip(&path, Some(line), "invalid UTF-8");
                continue;
            };
            if text.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = match serde_json::from_str(text) {
                Ok(v) => v,
                Err(e) => {
                    self.skip(&path, Some(line), format!("malformed JSON: {e}"));
                    continue;
                }
            };
            match value.get(&self.field) {
                None => self.skip(&path, Some(line), format!("no `{}` field", self.field)),
                Some(serde_json::Value::String(s)) if s.trim().is_empty() => {
                    self.skip(&path, Some(line), format!("empty `{}`", self.field))
                }
                Some(serde_json::Value::String(s)) => {
                    return Some(Ok(Document {
                        origin: format!("{}:{line}", path.display()),
                        text: s.clone(),
                        row: None,
                    }));
                }
                Some(_) => self.skip(
                    &path,
                    Some(line),
                    format!("`{}` is not a string", self.field),
                ),
            }
        }
    }

    /// A whole text file as one document, or `None` when it was skipped.
    fn text_file(
        &mut self,
        file: &InputFile,
        mut reader: Box<dyn BufRead + Send>,
    ) -> Result<Option<Document>> {
        let mut bytes = Vec::new();
        reader
            .read_to_end(&mut bytes)
            .map_err(|e| read_error(&file.path, e))?;
        match String::from_utf8(bytes) {
            Err(e) => {
                let at = e.utf8_error().valid_up_to();
                self.skip(&file.path, None, format!("invalid UTF-8 at byte {at}"));
                Ok(None)
            }
            Ok(text) if text.trim().is_empty() => {
                self.skip(&file.path, None, "empty file");
                Ok(None)
            }
            Ok(text) => Ok(Some(Document {
                origin: file.path.display().to_string(),
                text,
                row: None,
            })),
        }
    }
}

/// One object of a JSON-lines file, with where it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub file: PathBuf,
    /// 1-based.
    pub line: usize,
    pub value: serde_json::Value,
}

/// The objects of JSON-lines files (`.jsonl`, `.jsonl.gz`) one by one, for inputs whose
/// documents are structured (conversations). Lines that are not UTF-8 or not JSON objects are
/// skips, like [`Documents`]'; any other file type is an error naming it.
pub struct Records {
    files: std::vec::IntoIter<InputFile>,
    current: Option<(PathBuf, Box<dyn BufRead + Send>, usize)>,
    skips: Vec<Skip>,
}

impl Records {
    pub fn new(files: Vec<InputFile>) -> Result<Self> {
        if let Some(other) = files.iter().find(|f| f.format != Format::JsonLines) {
            return Err(DataError::Input {
                path: other.path.clone(),
                reason: "structured records are read from .jsonl or .jsonl.gz files only".into(),
            });
        }
        Ok(Self {
            files: files.into_iter(),
            current: None,
            skips: Vec::new(),
        })
    }

    /// What was left out so far.
    pub fn skipped(&self) -> &[Skip] {
        &self.skips
    }
}

impl Iterator for Records {
    type Item = Result<Record>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let Some((path, reader, line)) = self.current.as_mut() else {
                let file = self.files.next()?;
                let handle = match File::open(&file.path) {
                    Ok(h) => h,
                    Err(e) => return Some(Err(DataError::io(&file.path)(e))),
                };
                let reader: Box<dyn BufRead + Send> = if file.gzip {
                    Box::new(BufReader::new(MultiGzDecoder::new(handle)))
                } else {
                    Box::new(BufReader::new(handle))
                };
                self.current = Some((file.path, reader, 0));
                continue;
            };
            let mut bytes = Vec::new();
            match reader.read_until(b'\n', &mut bytes) {
                Ok(0) => {
                    self.current = None;
                    continue;
                }
                Ok(_) => *line += 1,
                Err(e) => {
                    let path = path.clone();
                    self.current = None;
                    return Some(Err(read_error(&path, e)));
                }
            }
            let (path, line) = (path.clone(), *line);
            let skip = |reason: String| Skip {
                file: path.display().to_string(),
                line: Some(line),
                row: None,
                reason,
            };
            let Ok(text) = std::str::from_utf8(&bytes) else {
                self.skips.push(skip("invalid UTF-8".into()));
                continue;
            };
            if text.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<serde_json::Value>(text) {
                Ok(value) if value.is_object() => {
                    return Some(Ok(Record {
                        file: path,
                        line,
                        value,
                    }));
                }
                Ok(_) => self.skips.push(skip("not a JSON object".into())),
                Err(e) => self.skips.push(skip(format!("malformed JSON: {e}"))),
            }
        }
    }
}

/// A read error; for gzip input usually a corrupt or truncated file.
fn read_error(path: &Path, e: std::io::Error) -> DataError {
    DataError::Input {
        path: path.to_path_buf(),
        reason: format!("cannot read: {e}"),
    }
}

impl Iterator for Documents {
    type Item = Result<Document>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.current.is_some() {
                match self.next_line() {
                    Some(item) => return Some(item),
                    None => continue,
                }
            }
            if self.parquet.is_some() {
                match self.next_row() {
                    Some(item) => return Some(item),
                    None => continue,
                }
            }
            let file = self.files.next()?;
            if file.format == Format::Parquet {
                if let Err(e) = self.open_parquet(&file) {
                    return Some(Err(e));
                }
                continue;
            }
            let reader = match self.open(file.clone()) {
                Ok(r) => r,
                Err(e) => return Some(Err(e)),
            };
            match file.format {
                Format::JsonLines => self.current = Some((file, reader, 0)),
                Format::Text => match self.text_file(&file, reader) {
                    Ok(Some(doc)) => return Some(Ok(doc)),
                    Ok(None) => {}
                    Err(e) => return Some(Err(e)),
                },
                Format::Parquet => unreachable!("Parquet files are opened above"),
            }
        }
    }
}

impl DocumentSource for Documents {
    fn skipped(&self) -> Vec<Skip> {
        self.skips.clone()
    }

    fn bytes_read(&self) -> u64 {
        self.bytes_opened
    }
}
