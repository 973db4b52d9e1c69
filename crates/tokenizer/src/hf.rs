// SPDX-License-Identifier: MIT OR Apache-2.0
//! A Hugging Face model directory: `tokenizer.json`, `tokenizer_config.json` (special tokens,
//! chat template), `chat_template.jinja` and `generation_config.json` (extra EOS ids).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value as Json};

use crate::{ChatTemplate, Tokenizer, TokenizerError};

/// The special-token attributes `transformers` passes to every chat template render.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

impl Tokenizer {
    /// Loads `dir/tokenizer.json` with the special tokens and chat template(s) of
    /// `dir/tokenizer_config.json`. The chat template comes from `chat_template.jinja` (plus
    /// `additional_chat_templates/*.jinja`) when present, else from the config's `chat_template`
    /// (a string, or a list of `{name, template}`). EOS ids are the config's `eos_token` followed
    /// by `generation_config.json`'s `eos_token_id` (a number or a list).
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| TokenizerError::Io {
            path: path.clone(),
            message: format!("{e} (a Hugging Face model directory needs tokenizer.json)"),
        })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::Format {
                path: path.clone(),
                message: format!("not a tokenizer.json that `tokenizers` 0.23 can load: {e}"),
            })?;
        let config_path = dir.join("tokenizer_config.json");
        let config = read_object(&config_path)?.unwrap_or_default();
        let generation_path = dir.join("generation_config.json");
        let generation = read_object(&generation_path)?.unwrap_or_default();

        // Special tokens by text, as chat templates see them (in transformers' order), and by id.
        let mut special_texts = Map::new();
        for key in SPECIAL_TOKEN_KEYS {
            if let Some(text) = token_text(&config, key, &config_path)? {
                special_texts.insert(key.to_string(), Json::String(text));
            }
        }
        let id_of =
            |key: &str| -> Result<Option<u32>, TokenizerError> {
                let Some(Json::String(text)) = special_texts.get(key) else {
                    return Ok(None);
                };
                inner.token_to_id(text).map(Some).ok_or_else(|| TokenizerError::Format {
                path: config_path.clone(),
                message: format!(
                    "{key} `{text}` is not in tokenizer.json's vocabulary: the two files come \
                     from different models"
                ),
            })
            };
        let vocab_size = inner.get_vocab_size(true);
        let generation_ids = |key| generation_ids(&generation, key, &generation_path, vocab_size);
        let bos_token_id = id_of("bos_token")?;
        let mut eos_token_ids: Vec<u32> = id_of("eos_token")?.into_iter().collect();
        for id in generation_ids("eos_token_id")? {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let pad_token_id = match id_of("pad_token")? {
            Some(id) => Some(id),
            None => generation_ids("pad_token_id")?.first().copied(),
        };

        let mut templates = Vec::new();
        for (name, source, origin) in template_sources(dir, &config, &config_path)? {
            let mut template =
                ChatTemplate::new(&source, None, None).map_err(|e| TokenizerError::Format {
                    path: origin,
                    message: format!("chat template `{name}`: {e}"),
                })?;
            for (key, value) in &special_texts {
                template = template.with_variable(key, value.clone());
            }
            templates.push((name, template));
        }
        Ok(Tokenizer {
            inner,
            bos_token_id,
            eos_token_ids,
            pad_token_id,
            templates,
        })
    }
}

/// `generation_config.json`'s token ids under `key`: a number, a list of numbers, or absent.
fn generation_ids(
    generation: &Map<String, Json>,
    key: &str,
    path: &Path,
    vocab_size: usize,
) -> Result<Vec<u32>, TokenizerError> {
    let bad = |what: String| TokenizerError::Format {
        path: path.to_path_buf(),
        message: format!("{key}: {what}"),
    };
    let values: Vec<&Json> = match generation.get(key) {
        None | Some(Json::Null) => return Ok(Vec::new()),
        Some(Json::Array(items)) => items.iter().collect(),
        Some(value) => vec![value],
    };
    values
        .into_iter()
        .map(|value| {
            let id = value
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| bad(format!("{value} is not a token id")))?;
            if (id as usize) < vocab_size {
                Ok(id)
            } else {
                Err(bad(format!(
                    "{id} is outside the vocabulary ({vocab_size} tokens)"
                )))
            }
        })
        .collect()
}

/// Reads a JSON object file; `None` if the file does not exist.
fn read_object(path: &Path) -> Result<Option<Map<String, Json>>, TokenizerError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(TokenizerError::Io {
                path: path.to_path_buf(),
                message: e.to_string(),
            });
        }
    };
    match serde_json::from_str(&text) {
        Ok(Json::Object(map)) => Ok(Some(map)),
        Ok(_) => Err(TokenizerError::Format {
            path: path.to_path_buf(),
            message: "is not a JSON object".into(),
        }),
        Err(e) => Err(TokenizerError::Format {
            path: path.to_path_buf(),
            message: format!("is not valid JSON: {e}"),
        }),
    }
}

/// A special token's text from `tokenizer_config.json`: a string, or an `AddedToken` object
/// with `content`. `null` or absent is `None`.
fn token_text(
    config: &Map<String, Json>,
    key: &str,
    path: &Path,
) -> Result<Option<String>, TokenizerError> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(token)) => match token.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(TokenizerError::Format {
                path: path.to_path_buf(),
                message: format!("{key} is an object without a string `content`"),
            }),
        },
        Some(other) => Err(TokenizerError::Format {
            path: path.to_path_buf(),
            message: format!("{key} should be a string or an AddedToken object, not {other}"),
        }),
    }
}

/// The named chat template sources, the unnamed one as `default`, with the file each came from.
fn template_sources(
    dir: &Path,
    config: &Map<String, Json>,
    config_path: &Path,
) -> Result<Vec<(String, String, PathBuf)>, TokenizerError> {
    let read = |path: PathBuf| {
        std::fs::read_to_string(&path)
            .map_err(|e| TokenizerError::Io {
                path: path.clone(),
                message: e.to_string(),
            })
            .map(|source| (source, path))
    };
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let (source, path) = read(jinja)?;
        let mut templates = vec![("default".to_string(), source, path)];
        let extra_dir = dir.join("additional_chat_templates");
        if extra_dir.is_dir() {
            let entries = std::fs::read_dir(&extra_dir).map_err(|e| TokenizerError::Io {
                path: extra_dir.clone(),
                message: e.to_string(),
            })?;
            let mut paths: Vec<PathBuf> =
                entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
            paths.sort();
            for path in paths {
                if let (Some(name), Some("jinja")) = (
                    path.file_stem()
                        .and_then(|s| s.to_str())
                        .map(str::to_string),
                    path.extension().and_then(|s| s.to_str()),
                ) {
                    let (source, path) = read(path.clone())?;
                    templates.push((name, source, path));
                }
            }
        }
        return Ok(templates);
    }
    let bad = |message: String| TokenizerError::Format {
        path: config_path.to_path_buf(),
        message,
    };
    let from_config = |name: &str, source: &str| {
        (
            name.to_string(),
            source.to_string(),
            config_path.to_path_buf(),
        )
    };
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::String(source)) => Ok(vec![from_config("default", source)]),
        Some(Json::Array(entries)) => entries
            .iter()
            .map(|entry| {
                match (
                    entry.get("name").and_then(Json::as_str),
                    entry.get("template").and_then(Json::as_str),
                ) {
                    (Some(name), Some(template)) => Ok(from_config(name, template)),
                    _ => Err(bad(
                        "chat_template list entries need string `name` and `template`".into(),
                    )),
                }
            })
            .collect(),
        Some(other) => Err(bad(format!(
            "chat_template should be a string or a list of {{name, template}}, not {other}"
        ))),
    }
}
