//! Preparing one corpus on many machines: the input files are cut into N contiguous parts of
//! about equal size, each prepared on its own into `OUT/part-I` (`data prepare --part I/N`), and
//! [`merge`] then writes one manifest over all parts' shards (`OUT/manifest.json`, shard files
//! named `part-I/...`), copying nothing.
//!
//! Merged shards hold exactly the tokens of one preparation of all inputs: the parts are
//! contiguous in input order and concatenated in part order, so documents keep their order, and
//! a document's split is decided by its own text ([`SplitRule::Sha256`]), not by its position.

use crate::error::{DataError, Result};
use crate::input::{InputFile, Skip};
use crate::shards::{
    MANIFEST, Manifest, PartInfo, ShardInfo, Shards, SplitInfo, SplitRule, TOKENIZER,
};
use crate::tokenizer::write_atomically;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The directory part `index` is prepared into.
pub fn part_dir(out: &Path, index: usize) -> PathBuf {
    out.join(format!("part-{index}"))
}

/// One part of the inputs.
pub struct Part {
    pub files: Vec<InputFile>,
    /// What resolving the inputs skipped: part 0 records it, so that a merge lists it once.
    pub skipped: Vec<Skip>,
    pub info: PartInfo,
}

/// Part `index` of `count` of the inputs (`files` and what resolving them `skipped`). Parts are
/// contiguous runs of `files` (in their order) cut where the running byte total crosses each
/// k/`count` of the whole, every part keeping at least one file; `files` must be at least
/// `count`.
pub fn select(
    files: Vec<InputFile>,
    skipped: Vec<Skip>,
    index: usize,
    count: usize,
) -> Result<Part> {
    if count == 0 || index >= count {
        return Err(DataError::Invalid(format!(
            "part {index}/{count}: parts are numbered 0 to N-1 of N (N at least 1)"
        )));
    }
    if files.len() < count {
        return Err(DataError::Invalid(format!(
            "{count} parts need at least {count} input files; the inputs hold {}",
            files.len()
        )));
    }
    let mut sizes = Vec::with_capacity(files.len());
    let mut list = Sha256::new();
    for file in &files {
        let size = std::fs::metadata(&file.path)
            .map_err(DataError::io(&file.path))?
            .len();
        list.update(format!("{}\t{size}\n", file.path.display()).as_bytes());
        sizes.push(size);
    }
    let starts = boundaries(&sizes, count);
    let range = starts[index]..starts[index + 1];
    let info = PartInfo {
        index,
        count,
        inputs: format!("{:x}", list.finalize()),
        files: range.len(),
    };
    Ok(Part {
        files: files
            .into_iter()
            .skip(range.start)
            .take(range.len())
            .collect(),
        skipped: if index == 0 { skipped } else { Vec::new() },
        info,
    })
}

/// `count + 1` file indices: part k is `starts[k]..starts[k + 1]`. Each cut is the first file
/// whose running total (before it) reaches k/`count` of all bytes, kept so that every part has
/// at least one file.
fn boundaries(sizes: &[u64], count: usize) -> Vec<usize> {
    let n = sizes.len();
    let total: u128 = sizes.iter().map(|&s| s as u128).sum();
    let mut starts = vec![0];
    let mut before = 0u128;
    let mut file = 0;
    for k in 1..count {
        let target = total * k as u128 / count as u128;
        while file < n && before < target {
            before += sizes[file] as u128;
            file += 1;
        }
        let lowest = starts[k - 1] + 1;
        let highest = n - (count - k);
        let cut = file.clamp(lowest, highest);
        while file < cut {
            before += sizes[file] as u128;
            file += 1;
        }
        while file > cut {
            file -= 1;
            before -= sizes[file] as u128;
        }
        starts.push(cut);
    }
    starts.push(n);
    starts
}

/// Checks that `out` holds every part of one partitioned preparation, made with one tokenizer
/// and one set of options, and writes `out/manifest.json` (and `out/tokenizer.json`) over their
/// shards. Returns the merged manifest and the number of parts.
pub fn merge(out: &Path) -> Result<(Manifest, usize)> {
    let parts = parts_in(out)?;
    let count = complete(out, &parts)?;
    let first = &parts[0].1;
    let tokenizer = first.tokenizer()?;
    let reference = &first.manifest;
    let mut merged = Manifest {
        part: None,
        input_bytes: 0,
        train: SplitInfo::default(),
        validation: SplitInfo::default(),
        skipped: Vec::new(),
        ..reference.clone()
    };
    for (index, shards) in &parts {
        same_preparation(reference, shards)?;
        shards.tokenizer()?;
        add_part(&mut merged, *index, shards)?;
    }
    if merged.split_rule != SplitRule::Sha256 && count > 1 {
        return Err(DataError::shards(
            out,
            "the parts split validation by position, which depends on the partition; prepare them with `diffzoo data prepare`",
        ));
    }
    if merged.train.tokens == 0 {
        return Err(DataError::shards(out, "the parts hold no training tokens"));
    }
    tokenizer.save(&out.join(TOKENIZER))?;
    let json = serde_json::to_string_pretty(&merged).expect("manifest serializes");
    write_atomically(&out.join(MANIFEST), json.as_bytes())?;
    Ok((merged, count))
}

/// The `part-I` directories in `out`, by index, each a part whose manifest says it is part I.
fn parts_in(out: &Path) -> Result<Vec<(usize, Shards)>> {
    let mut parts: Vec<(usize, Shards)> = Vec::new();
    let entries = std::fs::read_dir(out).map_err(DataError::io(out))?;
    for entry in entries {
        let entry = entry.map_err(DataError::io(out))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(index) = name
            .strip_prefix("part-")
            .and_then(|i| i.parse::<usize>().ok())
            .filter(|i| name == format!("part-{i}"))
        else {
            continue;
        };
        let shards = Shards::open(&entry.path())?;
        let Some(part) = &shards.manifest.part else {
            return Err(DataError::shards(
                &entry.path(),
                "not a part of a partitioned preparation (its manifest has no `part`)",
            ));
        };
        if part.index != index {
            return Err(DataError::shards(
                &entry.path(),
                format!("its manifest says it is part {}", part.index),
            ));
        }
        parts.push((index, shards));
    }
    parts.sort_by_key(|(index, _)| *index);
    Ok(parts)
}

/// The number of parts part 0 says the preparation has, where `parts` (by index) are all of
/// them and no others.
fn complete(out: &Path, parts: &[(usize, Shards)]) -> Result<usize> {
    let Some((_, first)) = parts.first() else {
        return Err(DataError::shards(
            out,
            "holds no part-I directories; prepare them with `diffzoo data prepare --part I/N`",
        ));
    };
    let count = first
        .manifest
        .part
        .as_ref()
        .expect("checked by parts_in")
        .count;
    if let Some((index, shards)) = parts.iter().find(|(index, _)| *index >= count) {
        return Err(DataError::shards(
            &shards.dir,
            format!(
                "part {index}, but part-0 is one of {count} parts: remove what is left of another preparation"
            ),
        ));
    }
    // Every index is below `count` and appears once, so `count - parts` are missing.
    let absent = count - parts.len();
    if absent > 0 {
        let missing: Vec<String> = (0..count)
            .filter(|i| !parts.iter().any(|(index, _)| index == i))
            .take(10)
            .map(|i| format!("part-{i}"))
            .collect();
        return Err(DataError::shards(
            out,
            format!(
                "a preparation in {count} parts, but {absent} missing ({}{}); prepare with `diffzoo data prepare --part I/{count}`",
                missing.join(", "),
                if absent > missing.len() { ", ..." } else { "" }
            ),
        ));
    }
    Ok(count)
}

/// Checks that the part in `shards` was prepared as the one whose manifest is `reference` (part
/// 0): one tokenizer, dtype, validation split and input list.
fn same_preparation(reference: &Manifest, shards: &Shards) -> Result<()> {
    let manifest = &shards.manifest;
    let differs = |what: &str, theirs: String, ours: String| {
        Err(DataError::shards(
            &shards.dir,
            format!("{what} {theirs}, but part 0 has {ours}: the parts are not of one preparation"),
        ))
    };
    if manifest.tokenizer != reference.tokenizer {
        return differs(
            "tokenizer",
            manifest.tokenizer.hash.clone(),
            reference.tokenizer.hash.clone(),
        );
    }
    if manifest.dtype != reference.dtype {
        return differs(
            "dtype",
            format!("{:?}", manifest.dtype),
            format!("{:?}", reference.dtype),
        );
    }
    if (manifest.validation_every, manifest.split_rule)
        != (reference.validation_every, reference.split_rule)
    {
        return differs(
            "validation split",
            format!(
                "every {} ({:?})",
                manifest.validation_every, manifest.split_rule
            ),
            format!(
                "every {} ({:?})",
                reference.validation_every, reference.split_rule
            ),
        );
    }
    let part = manifest.part.as_ref().expect("checked by parts_in");
    let first = reference.part.as_ref().expect("checked by parts_in");
    if (part.count, &part.inputs) != (first.count, &first.inputs) {
        return differs(
            "input list",
            format!("{} of {} parts", part.inputs, part.count),
            format!("{} of {} parts", first.inputs, first.count),
        );
    }
    Ok(())
}

/// Adds part `index` (in `shards`) to `merged`: its splits' counts and shards (their files
/// named under `part-I/`), input bytes and what it skipped.
fn add_part(merged: &mut Manifest, index: usize, shards: &Shards) -> Result<()> {
    let manifest = &shards.manifest;
    let prefix = format!("part-{index}");
    let overflow = || {
        DataError::shards(
            &shards.dir,
            "token, document or byte counts overflow when added to the other parts'",
        )
    };
    let relocate = |split: &SplitInfo, into: &mut SplitInfo| -> Result<()> {
        into.tokens = into.tokens.checked_add(split.tokens).ok_or_else(overflow)?;
        into.documents = into
            .documents
            .checked_add(split.documents)
            .ok_or_else(overflow)?;
        into.shards.extend(split.shards.iter().map(|s| ShardInfo {
            file: format!("{prefix}/{}", s.file),
            ..s.clone()
        }));
        Ok(())
    };
    relocate(&manifest.train, &mut merged.train)?;
    relocate(&manifest.validation, &mut merged.validation)?;
    merged.input_bytes = merged
        .input_bytes
        .checked_add(manifest.input_bytes)
        .ok_or_else(overflow)?;
    merged.skipped.extend(manifest.skipped.iter().cloned());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::boundaries;

    #[test]
    fn parts_are_contiguous_non_empty_and_balanced() {
        assert_eq!(boundaries(&[10, 10, 10, 10], 2), vec![0, 2, 4]);
        assert_eq!(boundaries(&[10, 10, 10, 10], 4), vec![0, 1, 2, 3, 4]);
        // One huge file: the others still get parts of their own.
        assert_eq!(boundaries(&[1000, 1, 1, 1], 3), vec![0, 1, 2, 4]);
        assert_eq!(boundaries(&[1, 1, 1, 1000], 3), vec![0, 2, 3, 4]);
        assert_eq!(boundaries(&[0, 0, 0], 3), vec![0, 1, 2, 3]);
        for count in 1..=7 {
            let sizes: Vec<u64> = (0..23).map(|i| (i * 37 % 11 + 1) as u64).collect();
            let starts = boundaries(&sizes, count);
            assert_eq!(starts.len(), count + 1);
            assert!(starts.windows(2).all(|w| w[0] < w[1]), "{starts:?}");
            let total: u64 = sizes.iter().sum();
            let largest = *sizes.iter().max().unwrap();
            for w in starts.windows(2) {
                let part: u64 = sizes[w[0]..w[1]].iter().sum();
                assert!(
                    part <= total / count as u64 + 2 * largest,
                    "{count}: {starts:?}"
                );
            }
        }
    }
}
