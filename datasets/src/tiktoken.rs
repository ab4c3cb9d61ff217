//! tiktoken rank files (`cl100k_base.tiktoken`, `o200k_base.tiktoken`, as OpenAI publishes
//! them: `base64(token) rank` on each line) converted exactly to a byte-level BPE
//! `tokenizer.json`.
//!
//! tiktoken splits text with its encoding's pattern and encodes each piece on its own: a piece
//! that is a token is that token; otherwise its bytes are merged, always the adjacent pair whose
//! concatenation has the lowest rank (the leftmost of equals), until no pair is a token. The
//! converted tokenizer does the same:
//!
//! - a `Split` pre-tokenizer with the same pattern, then bytes mapped to characters as GPT-2 does;
//! - a BPE whose vocabulary is the ranks (a token's id is its rank) with `ignore_merges`, so that
//!   a piece in the vocabulary is one token;
//! - one merge per token of two or more bytes, listed by the token's rank: the two parts that
//!   merging the token's bytes alone, with the ranks below its own, ends in.
//!
//! That last step needs every token to be built that way: merging its bytes with the lower
//! ranks alone must end in two parts, as it does in files made by BPE training (OpenAI's are).
//! Then the merges tiktoken makes inside a token's span, before the token forms, are those that
//! merging its bytes alone makes, so the pair it finally merges is the one listed, and
//! tokenizers' BPE (lowest merge first, leftmost of equals) merges in tiktoken's order. A file
//! with a token built otherwise (rank 256 `abc`, rank 257 `bc`: tiktoken makes `abc` from `a` +
//! `bc`) is refused, as is a rank file with a gap, a byte that is not a token, or a line that
//! does not read, naming the line. One difference remains outside the ranks: the special tokens'
//! text in the input (`<|endoftext|>`) is that special token, as in tiktoken's `encode` with
//! them allowed, where `encode_ordinary` would split it as text.
//!
//! The file's name says which encoding it is, and so its pattern and special tokens; the special
//! tokens' ids lie as far past the number of ranks as in the published encoding (there: exactly
//! the published ids).

use crate::error::{DataError, Result};
use base64::Engine;
use std::collections::HashMap;
use std::path::Path;

/// An encoding tiktoken publishes: its split pattern, number of ranks and special tokens (each
/// with its id minus the number of ranks).
struct Encoding {
    name: &'static str,
    ranks: usize,
    pattern: &'static str,
    specials: &'static [(&'static str, u32)],
}

const CL100K_PATTERN: &str = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s";

const O200K_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

const ENCODINGS: [Encoding; 2] = [
    Encoding {
        name: "cl100k_base",
        ranks: 100_256,
        pattern: CL100K_PATTERN,
        specials: &[
            ("<|endoftext|>", 1),
            ("<|fim_prefix|>", 2),
            ("<|fim_middle|>", 3),
            ("<|fim_suffix|>", 4),
            ("<|endofprompt|>", 20),
        ],
    },
    Encoding {
        name: "o200k_base",
        ranks: 199_998,
        pattern: O200K_PATTERN,
        specials: &[("<|endoftext|>", 1), ("<|endofprompt|>", 20)],
    },
];

/// A converted rank file.
pub struct Converted {
    /// The `tokenizer.json` text.
    pub json: String,
    /// Said when the file has another number of ranks than the published encoding.
    pub warning: Option<String>,
}

/// Converts the rank file at `path`; its name (`cl100k_base.tiktoken`) names the encoding.
pub fn convert(path: &Path) -> Result<Converted> {
    let refuse = |reason: String| DataError::Tokenizer {
        path: path.to_path_buf(),
        reason,
    };
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let encoding = ENCODINGS.iter().find(|e| e.name == stem).ok_or_else(|| {
        let names: Vec<String> = ENCODINGS
            .iter()
            .map(|e| format!("{}.tiktoken", e.name))
            .collect();
        refuse(format!(
            "the name of a tiktoken rank file says its encoding (its pattern and special tokens), and `{stem}` is none of {}",
            names.join(", ")
        ))
    })?;
    let text = std::fs::read_to_string(path).map_err(DataError::io(path))?;
    let tokens = read_ranks(&text).map_err(refuse)?;
    let merges = merges(&tokens).map_err(refuse)?;
    let count = tokens.len();
    let byte_char = byte_chars();
    let as_text =
        |token: &[u8]| -> String { token.iter().map(|&b| byte_char[b as usize]).collect() };
    // The special tokens are in the model's vocabulary too: tokenizers gives an added token
    // that is not the next free id, whatever its `id` in the file says.
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(rank, token)| (as_text(token), rank.into()))
        .chain(
            encoding
                .specials
                .iter()
                .map(|&(content, offset)| (content.to_string(), (count + offset as usize).into())),
        )
        .collect();
    let merges: Vec<[String; 2]> = merges
        .into_iter()
        .map(|(a, b)| [as_text(a), as_text(b)])
        .collect();
    let added: Vec<serde_json::Value> = encoding
        .specials
        .iter()
        .map(|&(content, offset)| {
            serde_json::json!({
                "id": count + offset as usize,
                "content": content,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": true,
            })
        })
        .collect();
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": encoding.pattern}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            ],
        },
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": true,
            "vocab": vocab,
            "merges": merges,
        },
    });
    let warning = (count != encoding.ranks).then(|| {
        format!(
            "{}: {count} ranks where {} has {}; its special tokens are placed as far past them as there",
            path.display(),
            encoding.name,
            encoding.ranks
        )
    });
    Ok(Converted {
        json: json.to_string(),
        warning,
    })
}

/// The tokens of a rank file, indexed by rank.
fn read_ranks(text: &str) -> std::result::Result<Vec<Vec<u8>>, String> {
    let mut entries: Vec<(usize, Vec<u8>, usize)> = Vec::new();
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let at = |reason: String| format!("line {}: {reason}", index + 1);
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (encoded, rank) = match fields.as_slice() {
            [] => continue,
            [encoded, rank] => (*encoded, *rank),
            _ => return Err(at(format!("expected `base64-token rank`, found {line:?}"))),
        };
        let token = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map_err(|e| at(format!("{encoded:?} is not base64: {e}")))?;
        if token.is_empty() {
            return Err(at("an empty token".into()));
        }
        let rank: usize = rank
            .parse()
            .map_err(|_| at(format!("rank {rank:?} is not a token id")))?;
        if let Some(first) = seen.insert(token.clone(), index + 1) {
            return Err(at(format!("the token of line {first} again")));
        }
        entries.push((rank, token, index + 1));
    }
    if entries.is_empty() {
        return Err("no ranks".into());
    }
    // Ranks run from 0 without a gap: each below the number of tokens, each once.
    let count = entries.len();
    let mut by_rank: Vec<Option<Vec<u8>>> = vec![None; count];
    let mut lines = vec![0; count];
    for (rank, token, line) in entries {
        let Some(slot) = by_rank.get_mut(rank) else {
            return Err(format!(
                "line {line}: rank {rank} is past the {count} tokens of the file (ranks run from 0 without a gap)"
            ));
        };
        if slot.is_some() {
            return Err(format!(
                "line {line}: rank {rank} again (line {})",
                lines[rank]
            ));
        }
        *slot = Some(token);
        lines[rank] = line;
    }
    if let Some(missing) = by_rank.iter().position(Option::is_none) {
        return Err(format!(
            "rank {missing} is missing (ranks run from 0 to {} without a gap)",
            by_rank.len() - 1
        ));
    }
    if let Some(byte) = (0..=255u8).find(|b| !seen.contains_key(&vec![*b])) {
        return Err(format!(
            "byte 0x{byte:02x} is not a token (every byte must be one)"
        ));
    }
    Ok(by_rank.into_iter().flatten().collect())
}

/// Two tokens merged into one.
type Merge<'a> = (&'a [u8], &'a [u8]);

/// The merge of each token of two or more bytes, in rank order (see the module documentation);
/// refuses a token that merging its bytes with the lower ranks does not build from two parts.
fn merges(tokens: &[Vec<u8>]) -> std::result::Result<Vec<Merge<'_>>, String> {
    let rank: HashMap<&[u8], usize> = tokens
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r))
        .collect();
    let mut merges = Vec::new();
    for (own, token) in tokens.iter().enumerate().filter(|(_, t)| t.len() > 1) {
        // Part boundaries: part i is token[bounds[i]..bounds[i + 1]].
        let mut bounds: Vec<usize> = (0..=token.len()).collect();
        while let Some((_, i)) = (0..bounds.len() - 2)
            .filter_map(|i| {
                let r = *rank.get(&token[bounds[i]..bounds[i + 2]])?;
                (r < own).then_some((r, i))
            })
            .min()
        {
            bounds.remove(i + 1);
        }
        if bounds.len() != 3 {
            return Err(format!(
                "the token of rank {own} is not built by merging two tokens of lower rank (its bytes merge into {} parts), so no BPE encodes as tiktoken does",
                bounds.len() - 1
            ));
        }
        merges.push((&token[..bounds[1]], &token[bounds[1]..]));
    }
    Ok(merges)
}

/// GPT-2's characters for the 256 bytes: printable Latin-1 bytes stand for themselves, the
/// others for the characters from U+0100 on, in byte order.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for (byte, slot) in chars.iter_mut().enumerate() {
        let printable = matches!(byte, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
        let code = if printable {
            byte as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).expect("a valid character");
    }
    chars
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TextTokenizer;
    use std::path::PathBuf;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiktoken")
    }

    /// Rank files trained by tiktoken's own trainer under each encoding's pattern, and the ids
    /// PyPI's tiktoken gives for a varied sample (`tests/reference/tiktoken_ranks.py`).
    #[test]
    fn converted_rank_files_give_tiktokens_ids() {
        let expected: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join("expected.json")).unwrap(),
        )
        .unwrap();
        for encoding in ENCODINGS {
            let path = fixtures().join(format!("{}.tiktoken", encoding.name));
            let tokenizer = TextTokenizer::from_file(&path).unwrap();
            let want = &expected[encoding.name];
            for (special, id) in want["special_tokens"].as_object().unwrap() {
                let id = id.as_u64().unwrap() as usize;
                assert_eq!(tokenizer.encode(special).unwrap(), [id as u32], "{special}");
            }
            assert_eq!(
                tokenizer.eot_id() as u64,
                want["special_tokens"]["<|endoftext|>"].as_u64().unwrap()
            );
            let samples = want["samples"].as_array().unwrap();
            assert!(samples.len() > 10);
            for sample in samples {
                let text = sample["text"].as_str().unwrap();
                let ids: Vec<u32> = serde_json::from_value(sample["ids"].clone()).unwrap();
                assert_eq!(
                    tokenizer.encode(text).unwrap(),
                    ids,
                    "{}: {text:?}",
                    encoding.name
                );
                assert_eq!(tokenizer.decode(&ids).unwrap(), text);
            }
        }
    }

    #[test]
    fn a_bad_rank_file_is_refused_naming_the_line() {
        let good = std::fs::read_to_string(fixtures().join("cl100k_base.tiktoken")).unwrap();
        let lines: Vec<&str> = good.lines().collect();
        let with = |edit: &dyn Fn(&mut Vec<String>)| {
            let mut lines: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
            edit(&mut lines);
            lines.join("\n")
        };
        let cases: Vec<(String, &str)> = vec![
            (
                with(&|l| l[2] = "!!notbase64 2".into()),
                "line 3: \"!!notbase64\" is not base64",
            ),
            (
                with(&|l| l[3] = "QQ== 3 extra".into()),
                "line 4: expected `base64-token rank`",
            ),
            (
                with(&|l| l[4] = "QQ== 4".into()),
                "line 66: the token of line 5 again",
            ),
            (
                with(&|l| l[5] = format!("{} 4", l[5].split(' ').next().unwrap())),
                "line 6: rank 4 again (line 5)",
            ),
            (
                with(&|l| l[6] = format!("{} x", l[6].split(' ').next().unwrap())),
                "line 7: rank \"x\"",
            ),
            (
                with(&|l| l[7] = "Bwc= 7".into()),
                "byte 0x07 is not a token",
            ),
            (
                with(&|l| l.push("Zm9vYmFy 4000000000".into())),
                "line 521: rank 4000000000 is past the 521 tokens",
            ),
            (String::new(), "no ranks"),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cl100k_base.tiktoken");
        for (text, reason) in cases {
            std::fs::write(&path, text).unwrap();
            let error = TextTokenizer::from_file(&path).unwrap_err().to_string();
            assert!(
                error.contains("cl100k_base.tiktoken") && error.contains(reason),
                "{reason}: {error}"
            );
        }
        let unknown = dir.path().join("mine.tiktoken");
        std::fs::write(&unknown, &good).unwrap();
        let error = TextTokenizer::from_file(&unknown).unwrap_err().to_string();
        assert!(
            error.contains("`mine` is none of cl100k_base.tiktoken, o200k_base.tiktoken"),
            "{error}"
        );
    }

    #[test]
    fn byte_characters_are_those_of_the_byte_level_pre_tokenizer() {
        let ours: std::collections::HashSet<char> = byte_chars().into_iter().collect();
        let theirs: std::collections::HashSet<char> =
            tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
                .into_iter()
                .collect();
        assert_eq!(ours, theirs);
        assert_eq!(byte_chars()[b' ' as usize], 'Ġ');
        assert_eq!(byte_chars()[b'\n' as usize], 'Ċ');
    }

    #[test]
    fn a_token_merges_from_the_parts_its_lower_ranks_make() {
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for t in ["ab", "bc", "abc", "cd", "abcd"] {
            tokens.push(t.as_bytes().to_vec());
        }
        let merges: Vec<(String, String)> = merges(&tokens)
            .unwrap()
            .into_iter()
            .map(|(a, b)| {
                (
                    String::from_utf8(a.to_vec()).unwrap(),
                    String::from_utf8(b.to_vec()).unwrap(),
                )
            })
            .collect();
        let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
        // "abcd": ab (lowest) first, then "abc" from ab+c, then abc+d.
        assert_eq!(
            merges,
            vec![
                pair("a", "b"),
                pair("b", "c"),
                pair("ab", "c"),
                pair("c", "d"),
                pair("abc", "d")
            ]
        );
        // tiktoken builds `abc` (256) from `a` + `bc` (257): no merge list can say that.
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        tokens.extend([b"abc".to_vec(), b"bc".to_vec()]);
        let error = super::merges(&tokens).unwrap_err();
        assert!(error.contains("the token of rank 256"), "{error}");
    }
}
