//! Parquet input: one document per row, its text in a top-level string column.
//!
//! The file is memory-mapped; small row groups are decoded (decompressed, dictionary-expanded) a
//! few at a time in parallel, one per thread, a large one a chunk of rows at a time, and rows are
//! handed out in file order, so memory holds a bounded amount of text, never the file. Whole-file problems (not Parquet, no such column, a column
//! that is not a string) are errors naming the file; a null, empty or non-UTF-8 value is a skip
//! naming its row (numbered from 0, as pyarrow and pandas number them).

use crate::error::{DataError, Result};
use ::parquet::basic::{Compression, ConvertedType, LogicalType, Type as PhysicalType};
use ::parquet::column::reader::{ColumnReader, ColumnReaderImpl};
use ::parquet::data_type::{ByteArray, ByteArrayType};
use ::parquet::file::reader::{FileReader, SerializedFileReader};
use bytes::Bytes;
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// A row's text, or why it is left out.
pub(crate) type RowText = std::result::Result<String, String>;

/// The text column of one Parquet file, read row group by row group.
pub(crate) struct ParquetText {
    source: Source,
    next_group: usize,
    next_row: u64,
    /// A large row group being read in chunks.
    streaming: Option<Cursor>,
    /// [`BUDGET`] and [`CHUNK_ROWS`] (smaller in tests).
    budget: u64,
    chunk_rows: usize,
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
            source: Source {
                path: path.to_path_buf(),
                reader,
                column,
                field: field.to_string(),
                nullable: descr.max_def_level() > 0,
            },
            next_group: 0,
            next_row: 0,
            streaming: None,
            budget: BUDGET,
            chunk_rows: CHUNK_ROWS,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.source.path
    }

    /// The rows (number in the file, text or why not) that come next, `None` after the last:
    /// small row groups a few at a time, decoded in parallel (at most [`BUDGET`] bytes of text
    /// between them), a larger one [`CHUNK_ROWS`] rows at a time.
    pub(crate) fn next_rows(&mut self) -> Option<Result<Vec<(u64, RowText)>>> {
        let result = match self.streaming.take() {
            Some(cursor) => self.stream(cursor),
            None if self.next_group == self.source.reader.num_row_groups() => return None,
            None => self.next_groups(),
        };
        let texts = match result {
            Ok(texts) => texts,
            Err(e) => {
                self.next_group = self.source.reader.num_row_groups();
                self.streaming = None;
                return Some(Err(e));
            }
        };
        let first = self.next_row;
        self.next_row += texts.len() as u64;
        Some(Ok((first..).zip(texts).collect()))
    }

    /// The next chunk of a large row group's rows.
    fn stream(&mut self, mut cursor: Cursor) -> Result<Vec<RowText>> {
        let source = &self.source;
        let texts = source.guarded(cursor.group, || source.read(&mut cursor, self.chunk_rows))?;
        if cursor.read < cursor.rows {
            self.streaming = Some(cursor);
        }
        Ok(texts)
    }

    /// The next row groups: one large one begun, or up to one small one per thread, whole.
    fn next_groups(&mut self) -> Result<Vec<RowText>> {
        let threads = rayon::current_num_threads().max(1);
        let small = self.budget / threads as u64;
        let size = |group: usize| {
            let chunk = (self.source.reader.metadata().row_group(group)).column(self.source.column);
            u64::try_from(chunk.uncompressed_size()).unwrap_or(u64::MAX)
        };
        let first = self.next_group;
        if size(first) > small {
            self.next_group += 1;
            let cursor = self.source.guarded(first, || self.source.cursor(first))?;
            return self.stream(cursor);
        }
        let total = self.source.reader.num_row_groups();
        let mut end = first + 1;
        while end < total && end - first < threads && size(end) <= small {
            end += 1;
        }
        self.next_group = end;
        let source = &self.source;
        let groups = source.guarded(first, || {
            (first..end)
                .into_par_iter()
                .map(|group| {
                    let mut cursor = source.cursor(group)?;
                    let rows = cursor.rows;
                    source.read(&mut cursor, rows)
                })
                .collect::<Result<Vec<_>>>()
        })?;
        Ok(groups.into_iter().flatten().collect())
    }
}

/// The file and where its text is: what the threads decoding row groups share.
struct Source {
    path: PathBuf,
    reader: SerializedFileReader<Bytes>,
    column: usize,
    field: String,
    /// Optional (nullable) columns carry a definition level per row: 1 for a value, 0 for null.
    nullable: bool,
}

impl Source {
    /// `work` on row groups from `group` on, a panic in the Parquet reader (a corrupt file it
    /// does not catch) turned into an error naming the file.
    fn guarded<T>(&self, group: usize, work: impl FnOnce() -> Result<T>) -> Result<T> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).unwrap_or_else(|_| {
            Err(DataError::Input {
                path: self.path.clone(),
                reason: format!("the Parquet reader failed on row group {group} (a corrupt file?)"),
            })
        })
    }

    fn bad(&self, group: usize, reason: impl std::fmt::Display) -> DataError {
        DataError::Input {
            path: self.path.clone(),
            reason: format!("cannot read row group {group}: {reason}"),
        }
    }

    /// The column of row group `group`, before its first row.
    fn cursor(&self, group: usize) -> Result<Cursor> {
        let reader = self
            .reader
            .get_row_group(group)
            .map_err(|e| self.bad(group, e))?;
        let rows = reader.metadata().num_rows();
        let rows = usize::try_from(rows)
            .map_err(|_| self.bad(group, format!("it says it holds {rows} rows")))?;
        let ColumnReader::ByteArrayColumnReader(column) = reader
            .get_column_reader(self.column)
            .map_err(|e| self.bad(group, e))?
        else {
            unreachable!("the column was checked to be BYTE_ARRAY when the file was opened")
        };
        Ok(Cursor {
            group,
            column,
            rows,
            read: 0,
        })
    }

    /// Up to `max` more rows of the cursor's row group, nulls included.
    fn read(&self, cursor: &mut Cursor, max: usize) -> Result<Vec<RowText>> {
        let want = max.min(cursor.rows - cursor.read);
        let capacity = want.min(CHUNK_ROWS);
        let (mut levels, mut values) = (Vec::with_capacity(capacity), Vec::with_capacity(capacity));
        let mut got = 0;
        while got < want {
            let (records, _, _) = cursor
                .column
                .read_records(want - got, Some(&mut levels), None, &mut values)
                .map_err(|e| self.bad(cursor.group, e))?;
            if records == 0 {
                return Err(self.bad(
                    cursor.group,
                    format!(
                        "it says it holds {} rows, its `{}` column ends after {}",
                        cursor.rows,
                        self.field,
                        cursor.read + got
                    ),
                ));
            }
            got += records;
        }
        cursor.read += got;
        let mut values = values.into_iter();
        let text = |value: Option<ByteArray>| match value {
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
            (0..got).map(|_| text(values.next())).collect()
        })
    }
}

/// Writes `texts` as a Parquet file of an int64 `id` (the row number) and a nullable string
/// `text` (snappy-compressed, `rows_per_group` rows to a row group): a file like the hub's, for
/// tests and examples.
pub fn write(path: &Path, texts: &[Option<&str>], rows_per_group: usize) -> Result<()> {
    use ::parquet::data_type::Int64Type;
    use ::parquet::file::properties::WriterProperties;
    use ::parquet::file::writer::SerializedFileWriter;
    let bad = |e: ::parquet::errors::ParquetError| DataError::Input {
        path: path.to_path_buf(),
        reason: format!("cannot write: {e}"),
    };
    let schema = ::parquet::schema::parser::parse_message_type(
        "message doc { required int64 id; optional binary text (STRING); }",
    )
    .expect("the schema parses");
    let props = WriterProperties::builder()
        .set_compression(::parquet::basic::Compression::SNAPPY)
        .build();
    let file = std::fs::File::create(path).map_err(DataError::io(path))?;
    let mut writer = SerializedFileWriter::new(file, schema.into(), props.into()).map_err(bad)?;
    for (g, group) in texts.chunks(rows_per_group.max(1)).enumerate() {
        let mut row_group = writer.next_row_group().map_err(bad)?;
        let first = (g * rows_per_group.max(1)) as i64;
        let ids: Vec<i64> = (first..).take(group.len()).collect();
        let values: Vec<ByteArray> = group.iter().flatten().map(|&t| t.into()).collect();
        let levels: Vec<i16> = group.iter().map(|t| i16::from(t.is_some())).collect();
        let mut column = row_group.next_column().map_err(bad)?.expect("an id column");
        column
            .typed::<Int64Type>()
            .write_batch(&ids, None, None)
            .map_err(bad)?;
        column.close().map_err(bad)?;
        let mut column = row_group
            .next_column()
            .map_err(bad)?
            .expect("a text column");
        column
            .typed::<ByteArrayType>()
            .write_batch(&values, Some(&levels), None)
            .map_err(bad)?;
        column.close().map_err(bad)?;
        row_group.close().map_err(bad)?;
    }
    writer.close().map_err(bad)?;
    Ok(())
}

/// Text bytes (uncompressed column chunks) decoded at once across threads; a row group larger
/// than its thread's share is read [`CHUNK_ROWS`] rows at a time instead.
const BUDGET: u64 = 256 << 20;
/// Rows read at a time from a large row group.
const CHUNK_ROWS: usize = 4096;

/// A row group's text column being read.
struct Cursor {
    group: usize,
    column: ColumnReaderImpl<ByteArrayType>,
    rows: usize,
    read: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(budget: u64, chunk_rows: usize) -> (Vec<(u64, RowText)>, usize) {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parquet/zstd-v2.parquet");
        let mut table = ParquetText::open(&path, "text").unwrap();
        (table.budget, table.chunk_rows) = (budget, chunk_rows);
        let (mut all, mut calls) = (Vec::new(), 0);
        while let Some(rows) = table.next_rows() {
            all.extend(rows.unwrap());
            calls += 1;
        }
        (all, calls)
    }

    #[test]
    fn large_row_groups_stream_in_chunks_and_small_ones_decode_together_alike() {
        // Nine rows in row groups of 3, 3 and 3.
        let (whole, calls) = rows(BUDGET, CHUNK_ROWS);
        assert_eq!(whole.len(), 9);
        assert_eq!(calls, 3usize.div_ceil(rayon::current_num_threads().min(3)));
        // Every row group over budget: 2 rows, then 1, from each.
        let (streamed, calls) = rows(0, 2);
        assert_eq!((streamed, calls), (whole, 6));
    }
}
