// SPDX-License-Identifier: MIT OR Apache-2.0
//! The include closure of a source and the key its compiled binary is stored under.
//!
//! A compiled module depends on more than its own file: every header it includes with quotes,
//! transitively, and the flags, arch and compiler version. [`CompileKey`] hashes exactly those, so
//! two targets that compile the same closure the same way share one binary, and editing a header
//! recompiles only the sources whose closure contains it.
//!
//! Not covered, by design: angle-bracket includes (toolkit headers; the compiler version stands in
//! for them) and preprocessor conditionals (the whole file is hashed whichever branch is taken).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// A quoted include that resolves nowhere, or a file that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ClosureError {
    /// The included file is in none of the searched directories.
    #[error("{from}: `#include \"{name}\"` not found next to it nor in {searched:?}")]
    Missing {
        /// The including file.
        from: PathBuf,
        /// The include as written.
        name: String,
        /// The directories searched after the including file's own.
        searched: Vec<PathBuf>,
    },
    /// A file could not be read.
    #[error("cannot read {path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
}

/// The quoted includes of one file, in order of appearance.
pub fn quoted_includes(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let rest = line
                .trim_start()
                .strip_prefix('#')?
                .trim_start()
                .strip_prefix("include")?;
            let rest = rest.trim_start().strip_prefix('"')?;
            rest.split_once('"').map(|(name, _)| name.to_string())
        })
        .collect()
}

/// The source and every file it reaches through quoted includes, source first, each once, in
/// depth-first order. A quoted include resolves against the including file's directory first,
/// then `include_dirs` in order, as the compiler does with `-I`.
pub fn include_closure(
    source: &Path,
    include_dirs: &[PathBuf],
) -> Result<Vec<PathBuf>, ClosureError> {
    let mut seen = BTreeSet::new();
    let mut order = Vec::new();
    visit(source, include_dirs, &mut seen, &mut order)?;
    Ok(order)
}

fn visit(
    file: &Path,
    include_dirs: &[PathBuf],
    seen: &mut BTreeSet<PathBuf>,
    order: &mut Vec<PathBuf>,
) -> Result<(), ClosureError> {
    let canonical = file.canonicalize().unwrap_or_else(|_| file.to_path_buf());
    if !seen.insert(canonical) {
        return Ok(());
    }
    order.push(file.to_path_buf());
    let text = std::fs::read_to_string(file).map_err(|e| ClosureError::Io {
        path: file.to_path_buf(),
        message: e.to_string(),
    })?;
    let own_dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
    for name in quoted_includes(&text) {
        let found = std::iter::once(&own_dir)
            .chain(include_dirs)
            .map(|d| d.join(&name))
            .find(|p| p.is_file());
        match found {
            Some(path) => visit(&path, include_dirs, seen, order)?,
            None => {
                return Err(ClosureError::Missing {
                    from: file.to_path_buf(),
                    name,
                    searched: include_dirs.to_vec(),
                });
            }
        }
    }
    Ok(())
}

/// The content hash a compiled module is stored and shared under.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CompileKey(pub String);

impl CompileKey {
    /// Hashes the closure's file names and contents, the flags, the arch and the compiler's
    /// identity (its `--version` output).
    pub fn new(
        closure: &[PathBuf],
        flags: &[String],
        arch: &str,
        compiler: &str,
    ) -> Result<Self, ClosureError> {
        let mut h = Sha256::new();
        h.update(b"metrale-compile-key v1\0");
        for part in [arch, compiler] {
            h.update(part.as_bytes());
            h.update(b"\0");
        }
        for flag in flags {
            h.update(flag.as_bytes());
            h.update(b"\0");
        }
        for file in closure {
            let bytes = std::fs::read(file).map_err(|e| ClosureError::Io {
                path: file.clone(),
                message: e.to_string(),
            })?;
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            h.update(name.as_bytes());
            h.update(b"\0");
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(&bytes);
        }
        Ok(CompileKey(hex(&h.finalize())))
    }
}

/// Hashes a set of strings into one hex digest (the per-target closure hash over its modules'
/// compile keys and manifests).
pub fn hash_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_quoted_includes_only() {
        let text = "#include \"a.cuh\"\n  #  include \"sub/b.cuh\" // x\n#include <cuda_bf16.h>\n// #include \"c.cuh\"\n";
        assert_eq!(quoted_includes(text), vec!["a.cuh", "sub/b.cuh"]);
    }

    #[test]
    fn closure_follows_includes_and_key_tracks_headers() {
        let dir = tempfile::tempdir().unwrap();
        let common = dir.path().join("common");
        let leaf = dir.path().join("leaf");
        std::fs::create_dir_all(&common).unwrap();
        std::fs::create_dir_all(&leaf).unwrap();
        std::fs::write(common.join("util.cuh"), "#include \"base.cuh\"\n").unwrap();
        std::fs::write(common.join("base.cuh"), "// base\n#include \"util.cuh\"\n").unwrap();
        std::fs::write(leaf.join("k.cu"), "#include \"util.cuh\"\n").unwrap();
        let dirs = vec![leaf.clone(), common.clone()];
        let closure = include_closure(&leaf.join("k.cu"), &dirs).unwrap();
        assert_eq!(closure.len(), 3, "{closure:?}");
        let flags = vec!["-O3".to_string()];
        let before = CompileKey::new(&closure, &flags, "sm_90a", "nvcc 13").unwrap();
        assert_eq!(
            before,
            CompileKey::new(&closure, &flags, "sm_90a", "nvcc 13").unwrap()
        );
        assert_ne!(
            before,
            CompileKey::new(&closure, &flags, "sm_100a", "nvcc 13").unwrap()
        );
        assert_ne!(
            before,
            CompileKey::new(&closure, &[], "sm_90a", "nvcc 13").unwrap()
        );
        std::fs::write(common.join("base.cuh"), "// changed\n").unwrap();
        let after = CompileKey::new(
            &include_closure(&leaf.join("k.cu"), &dirs).unwrap(),
            &flags,
            "sm_90a",
            "nvcc 13",
        )
        .unwrap();
        assert_ne!(before, after);

        std::fs::write(leaf.join("bad.cu"), "#include \"nowhere.cuh\"\n").unwrap();
        let err = include_closure(&leaf.join("bad.cu"), &dirs)
            .unwrap_err()
            .to_string();
        assert!(err.contains("nowhere.cuh"), "{err}");
    }
}
