// SPDX-License-Identifier: MIT OR Apache-2.0
//! The layer resolver: which source files a `(hardware, model, quant)` target compiles.
//!
//! A target reads its layers in priority order: its own leaf `kernels/<hw>/<model>/<quant>/`, its
//! own `kernels/<hw>/common/`, then the same pair of every class up the `[hardware] inherits`
//! chain. A layer holds the `.cu` files in its directory plus the `[sources] use` entries of its
//! `KERNEL.toml`.
//!
//! Invariants the resolver enforces (each a build error):
//! - a file whose stem a higher layer also has is shadowed whole-file, and the winning layer's
//!   `KERNEL.toml` must declare the stem in `[shadow]` with a reason;
//! - a `[shadow]` declaration with nothing below it to shadow is an error, so a stale override
//!   cannot linger;
//! - two sources that end up with the same module name are an error.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::manifest::{self, HardwareManifest, KernelManifest, ModelManifest};

/// Everything that can be wrong with the kernel tree.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// A file could not be read.
    #[error("cannot read {path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// A manifest does not parse or has unknown keys.
    #[error("invalid manifest {path}: {message}")]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// What the TOML parser said.
        message: String,
    },
    /// A file shadows a lower layer's file without declaring it.
    #[error(
        "undeclared shadow: {winner} replaces {shadowed}; declare it in {manifest} as `[shadow] {stem} = \"<reason>\"`, or rename the file"
    )]
    UndeclaredShadow {
        /// The shared stem.
        stem: String,
        /// The file that wins.
        winner: PathBuf,
        /// The file it replaces.
        shadowed: PathBuf,
        /// The `KERNEL.toml` that must declare it.
        manifest: PathBuf,
    },
    /// A `[shadow]` entry whose stem no lower layer has.
    #[error(
        "{manifest} declares `[shadow] {stem}` but no lower layer of target {target} has a `{stem}.cu` to shadow; remove the declaration"
    )]
    ShadowWithoutTarget {
        /// The declared stem.
        stem: String,
        /// The manifest declaring it.
        manifest: PathBuf,
        /// The target being resolved.
        target: String,
    },
    /// A `[shadow]` entry whose stem the declaring layer does not have.
    #[error("{manifest} declares `[shadow] {stem}` but its layer has no `{stem}.cu`")]
    ShadowWithoutWinner {
        /// The declared stem.
        stem: String,
        /// The manifest declaring it.
        manifest: PathBuf,
    },
    /// Two sources with one stem in one layer (a local file and a `use`, or two `use`s).
    #[error("{first} and {second} have the same stem `{stem}` in one layer")]
    DuplicateStem {
        /// The stem.
        stem: String,
        /// The first file.
        first: PathBuf,
        /// The second file.
        second: PathBuf,
    },
    /// Two sources map to one module name.
    #[error("module name `{module}` is produced by both {first} and {second}")]
    DuplicateModule {
        /// The module name.
        module: String,
        /// The first file.
        first: PathBuf,
        /// The second file.
        second: PathBuf,
    },
    /// A `[sources] use` entry that does not exist or is not a `.cu` file in the tree.
    #[error("{manifest}: `[sources] use` entry `{entry}` is not a .cu file under {root}")]
    BadUse {
        /// The entry as written.
        entry: String,
        /// The manifest holding it.
        manifest: PathBuf,
        /// The kernel tree root.
        root: PathBuf,
    },
    /// A `[modules]` entry naming a stem the layer does not have.
    #[error("{manifest}: `[modules] {stem}` names no source of this layer")]
    BadModuleOverride {
        /// The stem.
        stem: String,
        /// The manifest.
        manifest: PathBuf,
    },
    /// `[hardware] inherits` names a missing class or forms a cycle.
    #[error("hardware class `{hardware}`: {message}")]
    Inheritance {
        /// The class being resolved.
        hardware: String,
        /// What is wrong.
        message: String,
    },
    /// The requested target does not exist in the tree.
    #[error("no kernel target {0} in the tree")]
    NoSuchTarget(String),
}

/// A `(hardware, model, quant)` point of the tree, by directory names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TargetId {
    /// Hardware class directory.
    pub hardware: String,
    /// Model directory.
    pub model: String,
    /// Quantization directory.
    pub quant: String,
}

impl fmt::Display for TargetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.hardware, self.model, self.quant)
    }
}

/// Whether a layer is a leaf or a `common/` directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// `kernels/<hw>/<model>/<quant>/`.
    Leaf,
    /// `kernels/<hw>/common/`.
    Common,
}

/// One layer of a target: a directory and the class it belongs to.
#[derive(Clone, Debug)]
pub struct Layer {
    /// The hardware class owning the directory (the target's own class or an ancestor).
    pub hardware: String,
    /// Leaf or common.
    pub kind: LayerKind,
    /// The directory.
    pub dir: PathBuf,
    /// Its `KERNEL.toml`, when it has one.
    pub manifest_path: Option<PathBuf>,
}

/// One source a target compiles.
#[derive(Clone, Debug)]
pub struct ResolvedSource {
    /// File stem.
    pub stem: String,
    /// Module name it is exposed under.
    pub module: String,
    /// The file.
    pub path: PathBuf,
    /// Index into [`ResolvedTarget::layers`] of the layer it comes from.
    pub layer: usize,
}

/// A fully resolved target: what to compile, with which flags, for which arch.
#[derive(Clone, Debug)]
pub struct ResolvedTarget {
    /// The target.
    pub id: TargetId,
    /// The own class's `HARDWARE.toml`.
    pub hardware: HardwareManifest,
    /// The nearest `MODEL.toml` up the inheritance chain.
    pub model: ModelManifest,
    /// Layers in priority order (own leaf first).
    pub layers: Vec<Layer>,
    /// Sources, sorted by module name.
    pub sources: Vec<ResolvedSource>,
    /// Compiler flags: hardware, then each layer's `KERNEL.toml` from lowest to highest priority.
    pub flags: Vec<String>,
    /// Schedule defaults (`key`, value as text): the hardware's `[tuning]`, then each layer's
    /// `KERNEL.toml` `[tuning]` from lowest to highest priority, a later value replacing an
    /// earlier one of the same key.
    pub tuning: BTreeMap<String, String>,
    /// Directories searched for quoted includes, in priority order.
    pub include_dirs: Vec<PathBuf>,
    /// Every manifest the resolution read, for rebuild tracking and the target hash.
    pub manifests: Vec<PathBuf>,
}

/// Does `name` match a `METRALE_TARGET_*` pattern: `*`, a comma-separated list, `*` globs inside?
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    pattern.split(',').map(str::trim).any(|p| glob(p, name))
}

fn glob(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => {
            let Some(tail) = name.strip_prefix(head) else {
                return false;
            };
            if rest.is_empty() {
                return true;
            }
            (0..=tail.len()).any(|i| tail.is_char_boundary(i) && glob(rest, &tail[i..]))
        }
    }
}

fn subdirs(dir: &Path) -> Result<Vec<String>, LayoutError> {
    let entries = std::fs::read_dir(dir).map_err(|e| LayoutError::Io {
        path: dir.to_path_buf(),
        message: e.to_string(),
    })?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| LayoutError::Io {
            path: dir.to_path_buf(),
            message: e.to_string(),
        })?;
        if entry.path().is_dir()
            && let Some(name) = entry.file_name().to_str()
        {
            names.push(name.to_string());
        }
    }
    names.sort();
    Ok(names)
}

/// The class and its ancestors, nearest first.
fn inheritance_chain(
    root: &Path,
    hardware: &str,
) -> Result<Vec<(String, HardwareManifest)>, LayoutError> {
    let mut chain: Vec<(String, HardwareManifest)> = Vec::new();
    let mut next = Some(hardware.to_string());
    while let Some(hw) = next {
        if chain.iter().any(|(h, _)| *h == hw) {
            return Err(LayoutError::Inheritance {
                hardware: hardware.to_string(),
                message: format!("`inherits` forms a cycle through `{hw}`"),
            });
        }
        let path = root.join(&hw).join("HARDWARE.toml");
        if !path.is_file() {
            return Err(LayoutError::Inheritance {
                hardware: hardware.to_string(),
                message: format!("class `{hw}` has no {}", path.display()),
            });
        }
        let manifest: HardwareManifest = manifest::read(&path)?;
        next = manifest.hardware.inherits.clone();
        chain.push((hw, manifest));
    }
    Ok(chain)
}

/// Every target in the tree whose directory names match the three patterns. A class's targets
/// include its ancestors' leaves: inheriting a class means serving what it serves.
pub fn discover_targets(
    root: &Path,
    hardware: &str,
    model: &str,
    quant: &str,
) -> Result<Vec<TargetId>, LayoutError> {
    let mut found = BTreeSet::new();
    for hw in subdirs(root)? {
        if !root.join(&hw).join("HARDWARE.toml").is_file() || !pattern_matches(hardware, &hw) {
            continue;
        }
        for (class, _) in inheritance_chain(root, &hw)? {
            let class_dir = root.join(&class);
            for m in subdirs(&class_dir)? {
                if m == "common" || !class_dir.join(&m).join("MODEL.toml").is_file() {
                    continue;
                }
                if !pattern_matches(model, &m) {
                    continue;
                }
                for q in subdirs(&class_dir.join(&m))? {
                    let leaf = class_dir.join(&m).join(&q);
                    if leaf.join("KERNEL.toml").is_file() && pattern_matches(quant, &q) {
                        found.insert(TargetId {
                            hardware: hw.clone(),
                            model: m.clone(),
                            quant: q.clone(),
                        });
                    }
                }
            }
        }
    }
    Ok(found.into_iter().collect())
}

struct LayerFiles {
    layer: Layer,
    manifest: KernelManifest,
    /// stem -> file
    files: BTreeMap<String, PathBuf>,
}

fn read_layer(root: &Path, layer: Layer) -> Result<LayerFiles, LayoutError> {
    let manifest = match &layer.manifest_path {
        Some(p) => manifest::read::<KernelManifest>(p)?,
        None => KernelManifest::default(),
    };
    let manifest_display = layer
        .manifest_path
        .clone()
        .unwrap_or_else(|| layer.dir.join("KERNEL.toml"));
    let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut add = |stem: String, path: PathBuf| -> Result<(), LayoutError> {
        if let Some(first) = files.get(&stem) {
            return Err(LayoutError::DuplicateStem {
                stem,
                first: first.clone(),
                second: path,
            });
        }
        files.insert(stem, path);
        Ok(())
    };
    let entries = std::fs::read_dir(&layer.dir).map_err(|e| LayoutError::Io {
        path: layer.dir.clone(),
        message: e.to_string(),
    })?;
    let mut local: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "cu"))
        .collect();
    local.sort();
    for path in local {
        add(stem_of(&path), path)?;
    }
    for entry in &manifest.sources.use_ {
        let path = root.join(entry);
        let in_tree = path
            .canonicalize()
            .ok()
            .zip(root.canonicalize().ok())
            .is_some_and(|(p, r)| p.starts_with(r));
        if !in_tree || !path.is_file() || path.extension().is_none_or(|x| x != "cu") {
            return Err(LayoutError::BadUse {
                entry: entry.clone(),
                manifest: manifest_display.clone(),
                root: root.to_path_buf(),
            });
        }
        add(stem_of(&path), path)?;
    }
    for stem in manifest.modules.keys() {
        if !files.contains_key(stem) {
            return Err(LayoutError::BadModuleOverride {
                stem: stem.clone(),
                manifest: manifest_display.clone(),
            });
        }
    }
    for stem in manifest.shadow.keys() {
        if !files.contains_key(stem) {
            return Err(LayoutError::ShadowWithoutWinner {
                stem: stem.clone(),
                manifest: manifest_display.clone(),
            });
        }
    }
    Ok(LayerFiles {
        layer,
        manifest,
        files,
    })
}

fn stem_of(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Resolves one target: its layers, its sources after shadowing, its flags and include dirs.
pub fn resolve_target(root: &Path, id: &TargetId) -> Result<ResolvedTarget, LayoutError> {
    let chain = inheritance_chain(root, &id.hardware)?;
    let mut layers = Vec::new();
    let mut manifests = Vec::new();
    let mut model = None;
    for (class, hw_manifest) in &chain {
        manifests.push(root.join(class).join("HARDWARE.toml"));
        let _ = hw_manifest;
        let model_path = root.join(class).join(&id.model).join("MODEL.toml");
        if model.is_none() && model_path.is_file() {
            model = Some(manifest::read::<ModelManifest>(&model_path)?);
            manifests.push(model_path);
        }
        let leaf = root.join(class).join(&id.model).join(&id.quant);
        if leaf.join("KERNEL.toml").is_file() {
            layers.push(Layer {
                hardware: class.clone(),
                kind: LayerKind::Leaf,
                manifest_path: Some(leaf.join("KERNEL.toml")),
                dir: leaf,
            });
        }
        let common = root.join(class).join("common");
        if common.is_dir() {
            let kernel_toml = common.join("KERNEL.toml");
            layers.push(Layer {
                hardware: class.clone(),
                kind: LayerKind::Common,
                manifest_path: kernel_toml.is_file().then_some(kernel_toml),
                dir: common,
            });
        }
    }
    let Some(model) = model else {
        return Err(LayoutError::NoSuchTarget(id.to_string()));
    };
    if !layers.iter().any(|l| l.kind == LayerKind::Leaf) {
        return Err(LayoutError::NoSuchTarget(id.to_string()));
    }
    manifests.extend(layers.iter().filter_map(|l| l.manifest_path.clone()));

    let layer_files = layers
        .into_iter()
        .map(|l| read_layer(root, l))
        .collect::<Result<Vec<_>, _>>()?;

    // Highest priority first: the first layer to hold a stem wins, and must declare every lower
    // file of the same stem it replaces.
    let mut winners: BTreeMap<String, usize> = BTreeMap::new();
    let mut used_declarations: BTreeSet<(usize, String)> = BTreeSet::new();
    for (index, layer) in layer_files.iter().enumerate() {
        for (stem, path) in &layer.files {
            match winners.get(stem) {
                None => {
                    winners.insert(stem.clone(), index);
                }
                Some(&winner) => {
                    let w = &layer_files[winner];
                    if !w.manifest.shadow.contains_key(stem) {
                        return Err(LayoutError::UndeclaredShadow {
                            stem: stem.clone(),
                            winner: w.files[stem].clone(),
                            shadowed: path.clone(),
                            manifest: w
                                .layer
                                .manifest_path
                                .clone()
                                .unwrap_or_else(|| w.layer.dir.join("KERNEL.toml")),
                        });
                    }
                    used_declarations.insert((winner, stem.clone()));
                }
            }
        }
    }
    for (index, layer) in layer_files.iter().enumerate() {
        for stem in layer.manifest.shadow.keys() {
            if !used_declarations.contains(&(index, stem.clone())) {
                return Err(LayoutError::ShadowWithoutTarget {
                    stem: stem.clone(),
                    manifest: layer.layer.manifest_path.clone().unwrap_or_default(),
                    target: id.to_string(),
                });
            }
        }
    }

    let mut by_module: BTreeMap<String, ResolvedSource> = BTreeMap::new();
    for (stem, &index) in &winners {
        let layer = &layer_files[index];
        let path = layer.files[stem].clone();
        let module = layer
            .manifest
            .modules
            .get(stem)
            .cloned()
            .unwrap_or_else(|| stem.clone());
        if let Some(first) = by_module.get(&module) {
            return Err(LayoutError::DuplicateModule {
                module,
                first: first.path.clone(),
                second: path,
            });
        }
        by_module.insert(
            module.clone(),
            ResolvedSource {
                stem: stem.clone(),
                module,
                path,
                layer: index,
            },
        );
    }

    let own = &chain[0].1;
    let mut flags = own.build.flags.clone();
    for layer in layer_files.iter().rev() {
        flags.extend(layer.manifest.build.flags.iter().cloned());
    }
    let mut tuning: BTreeMap<String, String> = own
        .tuning
        .iter()
        .map(|(k, v)| (k.clone(), tuning_text(v)))
        .collect();
    for layer in layer_files.iter().rev() {
        for (k, v) in &layer.manifest.tuning {
            tuning.insert(k.clone(), tuning_text(v));
        }
    }
    let include_dirs = layer_files.iter().map(|l| l.layer.dir.clone()).collect();
    Ok(ResolvedTarget {
        id: id.clone(),
        hardware: own.clone(),
        model,
        layers: layer_files.into_iter().map(|l| l.layer).collect(),
        sources: by_module.into_values().collect(),
        flags,
        tuning,
        include_dirs,
        manifests,
    })
}

/// A `[tuning]` value as the engine's `key=value` parser takes it: strings bare, numbers and
/// booleans as written, arrays of strings joined by `+`.
pub fn tuning_text(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Array(items) => items.iter().map(tuning_text).collect::<Vec<_>>().join("+"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests;
