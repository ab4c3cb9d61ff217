//! Chat templates: a checkpoint's own Jinja template renders a conversation into the text its
//! model was tuned on, as transformers' `apply_chat_template` does.
//!
//! The template is `chat_template.jinja` (transformers 5 saves it there), else the
//! `chat_template` of `tokenizer_config.json` (a string, or a list of named templates whose
//! `default` is used). It renders with what transformers gives it: `messages`,
//! `add_generation_prompt`, the special tokens of `tokenizer_config.json` (`bos_token`,
//! `eos_token`, …) and `tools = none`; in an environment like transformers' (`trim_blocks`,
//! `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a `tojson` that writes what
//! Python's `json.dumps` writes, and Python's string, dict and list methods). The rendered text
//! is tokenized without adding special tokens: the template writes them.
//!
//! Not supported: transformers' `{% generation %}` blocks (its assistant-mask extension), and
//! dicts keep JSON's sorted key order rather than Python's insertion order.

use anyhow::{Context, Result, anyhow, bail};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The template's own file, looked for first.
pub const TEMPLATE_FILE: &str = "chat_template.jinja";
/// The tokenizer configuration, which may hold the template and names the special tokens.
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";

/// The special tokens transformers passes to a template by name.
const SPECIAL: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
];

/// One turn of a conversation. Other fields (`name`, `tool_calls`, …) reach the template as
/// they are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            extra: Default::default(),
        }
    }
}

/// Why a directory has no usable template.
#[derive(Debug)]
pub enum NoTemplate {
    /// No template anywhere: what was looked for.
    Missing(String),
    /// A template that does not parse, or a tokenizer configuration that does not read.
    Invalid(anyhow::Error),
}

impl std::fmt::Display for NoTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing(looked) => write!(f, "no chat template: {looked}"),
            Self::Invalid(e) => write!(f, "{e:#}"),
        }
    }
}

impl From<NoTemplate> for anyhow::Error {
    fn from(e: NoTemplate) -> Self {
        match e {
            NoTemplate::Invalid(e) => e,
            missing => anyhow!("{missing}"),
        }
    }
}

/// A compiled chat template with the special tokens it is rendered with.
pub struct Template {
    env: Environment<'static>,
    /// Where it came from, for errors.
    origin: String,
    special: BTreeMap<&'static str, String>,
}

impl std::fmt::Debug for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Template")
            .field("origin", &self.origin)
            .finish()
    }
}

impl Template {
    /// The template of a checkpoint or run directory `dir` (see the module documentation).
    pub fn find(dir: &Path) -> std::result::Result<Self, NoTemplate> {
        let config_path = dir.join(TOKENIZER_CONFIG);
        let config = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(
                serde_json::from_str::<serde_json::Value>(&text)
                    .map_err(|e| NoTemplate::Invalid(anyhow!("{}: {e}", config_path.display())))?,
            ),
            Err(_) => None,
        };
        let special = config.as_ref().map(special_tokens).unwrap_or_default();
        let file = dir.join(TEMPLATE_FILE);
        if file.is_file() {
            let source = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))
                .map_err(NoTemplate::Invalid)?;
            return Self::compile(source, file.display().to_string(), special)
                .map_err(NoTemplate::Invalid);
        }
        let origin = format!("{} (`chat_template`)", config_path.display());
        match config.as_ref().map(|c| &c["chat_template"]) {
            Some(serde_json::Value::String(source)) => {
                Self::compile(source.clone(), origin, special).map_err(NoTemplate::Invalid)
            }
            Some(serde_json::Value::Array(named)) => {
                let default = named
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str())
                    .ok_or_else(|| {
                        NoTemplate::Invalid(anyhow!(
                            "{origin}: a list of templates without one named \"default\""
                        ))
                    })?;
                Self::compile(default.into(), origin, special).map_err(NoTemplate::Invalid)
            }
            Some(serde_json::Value::Null) | None => Err(NoTemplate::Missing(format!(
                "{} has no {TEMPLATE_FILE} and no `chat_template` in {TOKENIZER_CONFIG}",
                dir.display()
            ))),
            Some(other) => Err(NoTemplate::Invalid(anyhow!(
                "{origin} = {other} is neither a template nor a list of named templates"
            ))),
        }
    }

    /// `path`: a template file (`.jinja`), or a directory holding one as [`Template::find`]
    /// looks for it. A file alone gets the special tokens of the `tokenizer_config.json`
    /// beside it, if any.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_dir() {
            return Ok(Self::find(path)?);
        }
        let source = std::fs::read_to_string(path)
            .with_context(|| format!("reading the chat template {}", path.display()))?;
        let special = path
            .parent()
            .and_then(|dir| std::fs::read_to_string(dir.join(TOKENIZER_CONFIG)).ok())
            .and_then(|text| serde_json::from_str(&text).ok())
            .map(|config| special_tokens(&config))
            .unwrap_or_default();
        Self::compile(source, path.display().to_string(), special)
    }

    fn compile(
        source: String,
        origin: String,
        special: BTreeMap<&'static str, String>,
    ) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source)
            .map_err(|e| anyhow!("{origin}: the chat template does not parse: {e:#}"))?;
        Ok(Self {
            env,
            origin,
            special,
        })
    }

    /// Where the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The text of `messages`, followed by the opening of an assistant turn with
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self.env.get_template("chat").expect("compiled as `chat`");
        let mut context: BTreeMap<&str, Value> = self
            .special
            .iter()
            .map(|(k, v)| (*k, Value::from(v.as_str())))
            .collect();
        context.insert("messages", Value::from_serialize(messages));
        context.insert("add_generation_prompt", Value::from(add_generation_prompt));
        context.insert("tools", Value::from(()));
        context.insert("documents", Value::from(()));
        template
            .render(context)
            .map_err(|e| anyhow!("{}: rendering the chat template: {e:#}", self.origin))
    }
}

/// The named special tokens of a `tokenizer_config.json`: strings, or transformers'
/// `AddedToken` objects (their `content`).
fn special_tokens(config: &serde_json::Value) -> BTreeMap<&'static str, String> {
    SPECIAL
        .iter()
        .filter_map(|&name| {
            let token = match &config[name] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o.get("content")?.as_str()?.to_string(),
                _ => return None,
            };
            Some((name, token))
        })
        .collect()
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time formatted by C's `strftime`, as Python's
/// `datetime.now().strftime` formats it.
fn strftime_now(format: String) -> std::result::Result<Value, Error> {
    let invalid =
        |why: &str| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: {why}"));
    let c_format = std::ffi::CString::new(format).map_err(|_| invalid("a NUL in the format"))?;
    // SAFETY: `time` and `localtime_r` write into the local `tm`; `strftime` writes at most
    // `buffer.len()` bytes into `buffer` and returns how many.
    let text = unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(invalid("the local time is unknown"));
        }
        let mut buffer = vec![0u8; 512];
        let n = libc::strftime(
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            c_format.as_ptr(),
            &tm,
        );
        String::from_utf8_lossy(&buffer[..n]).into_owned()
    };
    Ok(Value::from(text))
}

/// `tojson(indent=None)`: what Python's `json.dumps(value, ensure_ascii=False, indent=indent)`
/// writes (transformers' filter), separators `", "` and `": "` (`","` between lines when
/// indented).
fn tojson(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, Error> {
    let indent = match indent.or(kwargs.get::<Option<Value>>("indent")?) {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v.clone()).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: indent {v} is not a count"),
            )
        })?),
    };
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` layout of `value` (`ensure_ascii=False`), at nesting `level`.
fn python_json(value: &serde_json::Value, indent: Option<usize>, level: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, level: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * level));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match value {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, level + 1);
                python_json(item, indent, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, level + 1);
                out.push_str(&serde_json::to_string(key).expect("a string serializes"));
                out.push_str(": ");
                python_json(item, indent, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
        J::Number(n) if n.is_f64() => {
            let x = n.as_f64().expect("an f64");
            // Python writes integral floats with a trailing `.0`, as serde_json does.
            out.push_str(&serde_json::to_string(&x).expect("a finite float serializes"));
        }
        other => out.push_str(&serde_json::to_string(other).expect("JSON serializes")),
    }
}

/// The roles a conversation may hold.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// A conversation rendered for fine-tuning: its text, token ids, and which tokens the loss
/// scores as targets — those of each assistant turn, from where the template's prompt for it
/// ends (`render(turns before it, add_generation_prompt)`) to where the rendering with it ends
/// (its end-of-turn tokens included). A token counts when it starts inside such a span. The
/// template must render the turns so far as a prefix of the whole conversation; an error says
/// what does not hold.
pub fn scored_tokens(
    template: &Template,
    tokenizer: &diffzoo_datasets::TextTokenizer,
    messages: &[Message],
) -> Result<(String, Vec<u32>, Vec<bool>)> {
    if let Some(m) = messages.iter().find(|m| !ROLES.contains(&m.role.as_str())) {
        bail!("unknown role {:?} (roles: {})", m.role, ROLES.join(", "));
    }
    let text = template.render(messages, false)?;
    let mut spans = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        let prompt = template.render(&messages[..i], true)?;
        let upto = template.render(&messages[..=i], false)?;
        if !upto.starts_with(&prompt) || !text.starts_with(&upto) {
            bail!(
                "the chat template does not render turn {} as a continuation of the turns before it, so its tokens cannot be told apart",
                i + 1
            );
        }
        spans.push(prompt.len()..upto.len());
    }
    if spans.is_empty() {
        bail!("no assistant turn: nothing to learn from");
    }
    let (ids, offsets) = tokenizer.encode_with_offsets(&text)?;
    let scored: Vec<bool> = offsets
        .iter()
        .enumerate()
        .map(|(i, (start, _))| i > 0 && spans.iter().any(|s| s.contains(start)))
        .collect();
    if !scored.contains(&true) {
        bail!("its assistant turns render to no tokens");
    }
    Ok((text, ids, scored))
}

/// Conversations from `path`: a JSON list of messages (one conversation), or JSON lines, each a
/// list of messages or an object with `messages`. Errors name the file and line.
pub fn read_conversations(path: &Path) -> Result<Vec<Vec<Message>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    if let Ok(one) = serde_json::from_str::<serde_json::Value>(&text)
        && one.is_array()
    {
        return Ok(vec![
            conversation(&one).map_err(|e| anyhow!("{}: {e}", path.display()))?,
        ]);
    }
    let mut all = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| anyhow!("{}: {e}", at()))?;
        all.push(conversation(&value).map_err(|e| anyhow!("{}: {e}", at()))?);
    }
    if all.is_empty() {
        bail!("{}: no conversations", path.display());
    }
    Ok(all)
}

/// The turns of one line of instruction data: its `messages`, or its `prompt` and `completion`
/// (texts, which become a user and an assistant turn, or lists of messages, TRL's
/// conversational prompt–completion form).
pub fn training_turns(record: &serde_json::Value) -> Result<Vec<Message>> {
    if record.get("messages").is_some() {
        return conversation(record);
    }
    match (record.get("prompt"), record.get("completion")) {
        (Some(serde_json::Value::String(p)), Some(serde_json::Value::String(c))) => {
            Ok(vec![Message::new("user", p), Message::new("assistant", c)])
        }
        (Some(p @ serde_json::Value::Array(_)), Some(c @ serde_json::Value::Array(_))) => {
            let mut turns = conversation(p)?;
            turns.extend(conversation(c)?);
            Ok(turns)
        }
        (Some(_), Some(_)) => {
            bail!("`prompt` and `completion` must both be texts or both lists of messages")
        }
        _ => bail!("no `messages`, nor `prompt` and `completion`"),
    }
}

/// One conversation: a list of messages, or an object whose `messages` is one.
pub fn conversation(value: &serde_json::Value) -> Result<Vec<Message>> {
    let list = match value {
        serde_json::Value::Array(_) => value,
        serde_json::Value::Object(map) => map
            .get("messages")
            .ok_or_else(|| anyhow!("an object without `messages`"))?,
        other => bail!("expected a list of messages, got {other}"),
    };
    let messages = list
        .as_array()
        .ok_or_else(|| anyhow!("`messages` = {list} is not a list"))?;
    if messages.is_empty() {
        bail!("a conversation without messages");
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m["role"].as_str();
            let content = m["content"].as_str();
            match (role, content) {
                (Some(_), Some(_)) => {
                    serde_json::from_value(m.clone()).map_err(|e| anyhow!("message {}: {e}", i + 1))
                }
                (None, _) => bail!("message {}: no `role` string in {m}", i + 1),
                (_, None) => bail!(
                    "message {}: `content` = {} is not a string (diffzoo renders text turns only)",
                    i + 1,
                    m["content"]
                ),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> Template {
        let special = BTreeMap::from([("bos_token", "<s>".to_string())]);
        Template::compile(source.into(), "test".into(), special).unwrap()
    }

    #[test]
    fn a_chatml_template_renders_turns_and_the_generation_prompt() {
        let t = template(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}\
             {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        );
        let messages = [
            Message::new("system", "Be brief."),
            Message::new("user", " Hi "),
        ];
        assert_eq!(
            t.render(&messages, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(!t.render(&messages, false).unwrap().ends_with("assistant\n"));
    }

    #[test]
    fn transformers_extras_behave_as_in_python() {
        let t = template(
            "{{ bos_token }}{{ messages[0].content.strip().upper() }}|{{ {'a': [1, 2.0], 'b': 'é'} | tojson }}|\
             {{ [1] | tojson(indent=2) }}|{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.role }}{% endfor %}",
        );
        let messages = [Message::new("user", " hi "), Message::new("assistant", "x")];
        assert_eq!(
            t.render(&messages, false).unwrap(),
            "<s>HI|{\"a\": [1, 2.0], \"b\": \"é\"}|[\n  1\n]|assistant"
        );
        let refusing = template("{{ raise_exception('roles must alternate') }}");
        let err = refusing.render(&messages, false).unwrap_err().to_string();
        assert!(err.contains("roles must alternate"), "{err}");
        let date = template("{{ strftime_now('%Y') }}")
            .render(&[], false)
            .unwrap();
        assert_eq!(date.len(), 4, "{date}");
    }

    #[test]
    fn templates_are_found_where_transformers_saves_them() {
        let dir = tempfile::tempdir().unwrap();
        let err = Template::find(dir.path()).unwrap_err();
        assert!(matches!(err, NoTemplate::Missing(_)), "{err}");
        assert!(err.to_string().contains(TEMPLATE_FILE), "{err}");
        let config = serde_json::json!({
            "bos_token": {"content": "<B>", "__type": "AddedToken"},
            "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages | length }}"}],
        });
        std::fs::write(dir.path().join(TOKENIZER_CONFIG), config.to_string()).unwrap();
        let messages = [Message::new("user", "a")];
        let found = Template::find(dir.path()).unwrap();
        assert_eq!(found.render(&messages, false).unwrap(), "<B>1");
        // The template's own file comes first.
        std::fs::write(dir.path().join(TEMPLATE_FILE), "file:{{ bos_token }}").unwrap();
        let found = Template::find(dir.path()).unwrap();
        assert_eq!(found.render(&messages, false).unwrap(), "file:<B>");
        std::fs::write(dir.path().join(TEMPLATE_FILE), "{% if %}").unwrap();
        let err = Template::find(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("does not parse") && err.contains(TEMPLATE_FILE),
            "{err}"
        );
    }

    #[test]
    fn assistant_turns_and_their_end_of_turn_are_scored_and_nothing_else() {
        let tokenizer = diffzoo_datasets::TextTokenizer::train_bpe(
            ["user assistant hello there fine thanks <|im_start|> <|im_end|>"].into_iter(),
            300,
        )
        .unwrap();
        let t = template(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
             {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        );
        let messages = [
            Message::new("user", "hello"),
            Message::new("assistant", "there"),
            Message::new("user", "fine"),
            Message::new("assistant", "thanks"),
        ];
        let (text, ids, scored) = scored_tokens(&t, &tokenizer, &messages).unwrap();
        assert_eq!(ids.len(), scored.len());
        let (_, offsets) = tokenizer.encode_with_offsets(&text).unwrap();
        let scored_text: String = offsets
            .iter()
            .zip(&scored)
            .filter(|(_, s)| **s)
            .map(|((a, b), _)| &text[*a..*b])
            .collect();
        assert_eq!(scored_text, "there<|im_end|>\nthanks<|im_end|>\n");
        let err = scored_tokens(&t, &tokenizer, &messages[..1]).unwrap_err();
        assert!(err.to_string().contains("no assistant turn"), "{err}");
        let odd = [Message::new("robot", "x"), Message::new("assistant", "y")];
        let err = scored_tokens(&t, &tokenizer, &odd).unwrap_err();
        assert!(err.to_string().contains("\"robot\""), "{err}");
        // A template that rewrites earlier turns once later ones come cannot be scored.
        let rewriting = template(
            "{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}{% endfor %}",
        );
        let err = scored_tokens(&rewriting, &tokenizer, &messages[..2]).unwrap_err();
        assert!(err.to_string().contains("continuation"), "{err}");
    }

    #[test]
    fn conversations_read_as_one_list_or_json_lines_and_errors_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let one = dir.path().join("one.json");
        std::fs::write(&one, r#"[{"role": "user", "content": "hi"}]"#).unwrap();
        assert_eq!(
            read_conversations(&one).unwrap(),
            vec![vec![Message::new("user", "hi")]]
        );
        let lines = dir.path().join("many.jsonl");
        std::fs::write(
            &lines,
            "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n\n[{\"role\": \"user\", \"content\": \"b\", \"name\": \"x\"}]\n",
        )
        .unwrap();
        let read = read_conversations(&lines).unwrap();
        assert_eq!(read.len(), 2);
        assert_eq!(read[1][0].extra["name"], "x");
        std::fs::write(&lines, "[{\"role\": \"user\", \"content\": \"a\"}]\n[{\"role\": \"user\", \"content\": [1]}]\n").unwrap();
        let err = read_conversations(&lines).unwrap_err().to_string();
        assert!(
            err.contains("many.jsonl:2") && err.contains("content"),
            "{err}"
        );
    }
}
