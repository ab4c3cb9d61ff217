//! Parquet input: one document per row, its text in a top-level string column.
//!
//! The file is memory-mapped; row groups are decoded (decompressed, dictionary-expanded) a few
//! at a time in parallel, one per thread, and handed out in file order, so memory holds a few
//! row groups' text, never the file. Whole-file problems (not Parquet, no such column, a column
//! that is not a string) are errors naming the file; a null, empty or non-UTF-8 value is a skip
//! naming its row (numbered from 0, as pyarrow and pandas number them).

use crate::error::{DataError, Result};
use ::parquet::basic::{Compression, ConvertedType, LogicalType, Type as PhysicalType};
use ::parquet::column::reader::ColumnReader;
use ::parquet::file::reader::{FileReader, SerializedFileReader};
use bytes::Bytes;
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// A row's text, or why it is left out.
pub(crate) type RowText = std::result::Result<String, String>;

/// The text column of one Parquet file, read row group by row group.
pub(crate) struct ParquetText {
    path: PathBuf,
    reader: SerializedFileReader<Bytes>,
    column: usize,
    field: String,
    /// Optional (nullable) columns carry a definition level per row: 1 for a value, 0 for null.
    nullable: bool,
    next_group: usize,
    next_row: u64,
}

impl ParquetText {
    /// Opens `path` and finds the column `field`.
    pub(crate) fn open(path: &Path, field: &str) -> Result<Self> {
        let bad = |reason: String| DataError::Input {
            path: path.to_path_buf(),
            reason,
        };
        let file = std::fs::File::open(path).map_err(DataError::io(path))?;
        // SAFETY: the input is only read; like every reader of files, we assume no one truncates
        // it while it is being prepared.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(DataError::io(path))?;
        let reader = SerializedFileReader::new(Bytes::from_owner(map))
            .map_err(|e| bad(format!("not a readable Parquet file: {e}")))?;
        let schema = reader.metadata().file_metadata().schema_descr_ptr();
        let root = schema.root_schema();
        let top: Vec<&str> = root.get_fields().iter().map(|f| f.name()).collect();
        let Some(node) = root.get_fields().iter().find(|f| f.name() == field) else {
            return Err(bad(format!(
                "no column `{field}` (columns: {}); choose one with --text-field",
                top.join(", ")
            )));
        };
        if node.is_group() {
            return Err(bad(format!(
                "column `{field}` is a group (struct, list or map), not a string"
            )));
        }
        let column = (0..schema.num_columns())
            .find(|&i| schema.column(i).path().parts() == [field])
            .expect("a primitive top-level field is a leaf column");
        let descr = schema.column(column);
        if descr.max_rep_level() > 0 {
            return Err(bad(format!("column `{field}` is repeated, not one string")));
        }
        let is_string = descr.physical_type() == PhysicalType::BYTE_ARRAY
            && (matches!(descr.logical_type_ref(), Some(LogicalType::String))
                || descr.converted_type() == ConvertedType::UTF8);
        if !is_string {
            let kind = match descr.logical_type_ref() {
                Some(logical) => format!("{} ({logical:?})", descr.physical_type()),
                None if descr.physical_type() == PhysicalType::BYTE_ARRAY => {
                    "binary (BYTE_ARRAY without the STRING annotation)".to_string()
                }
                None => descr.physical_type().to_string(),
            };
            return Err(bad(format!("column `{field}` is {kind}, not a string")));
        }
        let metadata = reader.metadata();
        for group in 0..metadata.num_row_groups() {
            let codec = match metadata.row_group(group).column(column).compression() {
                Compression::BROTLI(_) => "BROTLI",
                Compression::LZO => "LZO",
                _ => continue,
            };
            return Err(bad(format!(
                "column `{field}` is compressed with {codec} (row group {group}), which diffzoo does not read: rewrite it with zstd, snappy, gzip or lz4 (pyarrow: pq.write_table(table, path, compression=\"zstd\"))"
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            reader,
            column,
            field: field.to_string(),
            nullable: descr.max_def_level() > 0,
            next_group: 0,
            next_row: 0,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The rows (number in the file, text or why not) of the next row groups, as many as there
    /// are threads, decoded in parallel; `None` after the last.
    pub(crate) fn next_rows(&mut self) -> Option<Result<Vec<(u64, RowText)>>> {
        let total = self.reader.num_row_groups();
        if self.next_group == total {
            return None;
        }
        let end = total.min(self.next_group + rayon::current_num_threads().max(1));
        let groups = (self.next_group..end)
            .into_par_iter()
            .map(|group| self.row_group(group))
            .collect::<Result<Vec<_>>>();
        self.next_group = end;
        let groups = match groups {
            Ok(groups) => groups,
            Err(e) => {
                self.next_group = total;
                return Some(Err(e));
            }
        };
        let mut rows = Vec::with_capacity(groups.iter().map(Vec::len).sum());
        for text in groups.into_iter().flatten() {
            rows.push((self.next_row, text));
            self.next_row += 1;
        }
        Some(Ok(rows))
    }

    /// One row group's values of the column, nulls included.
    fn row_group(&self, group: usize) -> Result<Vec<RowText>> {
        let bad = |e: ::parquet::errors::ParquetError| DataError::Input {
            path: self.path.clone(),
            reason: format!("cannot read row group {group}: {e}"),
        };
        let reader = self.reader.get_row_group(group).map_err(bad)?;
        let rows = usize::try_from(reader.metadata().num_rows()).unwrap_or(0);
        let ColumnReader::ByteArrayColumnReader(mut column): ColumnReader =
            reader.get_column_reader(self.column).map_err(bad)?
        else {
            unreachable!("the column was checked to be BYTE_ARRAY when the file was opened")
        };
        let (mut levels, mut values) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
        let mut read = 0;
        while read < rows {
            let (records, _, _) = column
                .read_records(rows - read, Some(&mut levels), None, &mut values)
                .map_err(bad)?;
            if records == 0 {
                return Err(DataError::Input {
                    path: self.path.clone(),
                    reason: format!(
                        "row group {group} says it holds {rows} rows, its `{}` column ends after {read}",
                        self.field
                    ),
                });
            }
            read += records;
        }
        let mut values = values.into_iter();
        let text = |value: Option<::parquet::data_type::ByteArray>| match value {
            None => Err(format!("null `{}`", self.field)),
            Some(value) => match String::from_utf8(value.data().to_vec()) {
                Err(_) => Err(format!("invalid UTF-8 in `{}`", self.field)),
                Ok(s) if s.trim().is_empty() => Err(format!("empty `{}`", self.field)),
                Ok(s) => Ok(s),
            },
        };
        Ok(if self.nullable {
            levels
                .iter()
                .map(|&level| text(if level > 0 { values.next() } else { None }))
                .collect()
        } else {
            (0..rows).map(|_| text(values.next())).collect()
        })
    }
}
