// SPDX-License-Identifier: MIT OR Apache-2.0
//! Resolver tests on throwaway kernel trees.

use super::*;

/// A kernel tree in a temp dir, built file by file.
struct Tree(tempfile::TempDir);

impl Tree {
    fn new() -> Self {
        Tree(tempfile::tempdir().unwrap())
    }
    fn file(&self, rel: &str, text: &str) -> &Self {
        let path = self.0.path().join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
        self
    }
    fn hardware(&self, hw: &str, inherits: Option<&str>) -> &Self {
        let inherits = inherits
            .map(|p| format!("inherits = \"{p}\"\n"))
            .unwrap_or_default();
        self.file(
            &format!("{hw}/HARDWARE.toml"),
            &format!("[hardware]\nname = \"{hw}\"\nvendor = \"nvidia\"\narch = \"sm_90a\"\n{inherits}[build]\nflags = [\"-O3\"]\n"),
        )
    }
    fn leaf(&self, hw: &str, model: &str, quant: &str, kernel_toml: &str) -> &Self {
        self.file(
            &format!("{hw}/{model}/MODEL.toml"),
            &format!("[model]\nmodel_types = [\"{model}\"]\n"),
        )
        .file(&format!("{hw}/{model}/{quant}/KERNEL.toml"), kernel_toml)
    }
    fn root(&self) -> &Path {
        self.0.path()
    }
    fn resolve(&self, hw: &str, model: &str, quant: &str) -> Result<ResolvedTarget, LayoutError> {
        resolve_target(
            self.root(),
            &TargetId {
                hardware: hw.into(),
                model: model.into(),
                quant: quant.into(),
            },
        )
    }
}

/// (module, path relative to the tree root) of every resolved source.
fn modules(t: &ResolvedTarget) -> Vec<(String, String)> {
    let root = t.manifests[0].parent().unwrap().parent().unwrap();
    t.sources
        .iter()
        .map(|s| {
            (
                s.module.clone(),
                s.path.strip_prefix(root).unwrap().display().to_string(),
            )
        })
        .collect()
}

#[test]
fn leaf_plus_common() {
    let t = Tree::new();
    t.hardware("hw", None)
        .file(
            "hw/common/KERNEL.toml",
            "[build]\nflags = [\"-lineinfo\"]\n",
        )
        .file("hw/common/rmsnorm.cu", "")
        .file("hw/common/rope.cu", "")
        .leaf("hw", "m", "bf16", "[build]\nflags = [\"-DLEAF\"]\n")
        .file("hw/m/bf16/attention.cu", "");
    let r = t.resolve("hw", "m", "bf16").unwrap();
    assert_eq!(
        modules(&r),
        vec![
            ("attention".into(), "hw/m/bf16/attention.cu".into()),
            ("rmsnorm".into(), "hw/common/rmsnorm.cu".into()),
            ("rope".into(), "hw/common/rope.cu".into()),
        ]
    );
    assert_eq!(r.flags, vec!["-O3", "-lineinfo", "-DLEAF"]);
    assert_eq!(r.include_dirs.len(), 2);
}

#[test]
fn undeclared_shadow_fails() {
    let t = Tree::new();
    t.hardware("hw", None)
        .file("hw/common/rmsnorm.cu", "")
        .leaf("hw", "m", "bf16", "")
        .file("hw/m/bf16/rmsnorm.cu", "");
    let err = t.resolve("hw", "m", "bf16").unwrap_err();
    assert!(
        matches!(err, LayoutError::UndeclaredShadow { ref stem, .. } if stem == "rmsnorm"),
        "{err}"
    );
    assert!(err.to_string().contains("[shadow] rmsnorm"), "{err}");
}

#[test]
fn declared_shadow_wins() {
    let t = Tree::new();
    t.hardware("hw", None)
        .file("hw/common/rmsnorm.cu", "")
        .leaf(
            "hw",
            "m",
            "bf16",
            "[shadow]\nrmsnorm = \"wider rows for this model\"\n",
        )
        .file("hw/m/bf16/rmsnorm.cu", "");
    let r = t.resolve("hw", "m", "bf16").unwrap();
    assert_eq!(
        modules(&r),
        vec![("rmsnorm".into(), "hw/m/bf16/rmsnorm.cu".into())]
    );
}

#[test]
fn declared_shadow_with_nothing_to_shadow_fails() {
    let t = Tree::new();
    t.hardware("hw", None)
        .file("hw/common/rope.cu", "")
        .leaf("hw", "m", "bf16", "[shadow]\nrmsnorm = \"stale\"\n")
        .file("hw/m/bf16/rmsnorm.cu", "");
    let err = t.resolve("hw", "m", "bf16").unwrap_err();
    assert!(
        matches!(err, LayoutError::ShadowWithoutTarget { ref stem, .. } if stem == "rmsnorm"),
        "{err}"
    );

    let t = Tree::new();
    t.hardware("hw", None)
        .leaf("hw", "m", "bf16", "[shadow]\nghost = \"no file\"\n");
    let err = t.resolve("hw", "m", "bf16").unwrap_err();
    assert!(
        matches!(err, LayoutError::ShadowWithoutWinner { .. }),
        "{err}"
    );
}

#[test]
fn inheritance_reads_the_parent_pair_and_own_tier_wins() {
    let t = Tree::new();
    t.hardware("base", None)
        .file("base/common/rmsnorm.cu", "")
        .file("base/common/argmax.cu", "")
        .leaf("base", "m", "bf16", "")
        .file("base/m/bf16/attention.cu", "")
        .hardware("child", Some("base"))
        .file(
            "child/common/KERNEL.toml",
            "[shadow]\nrmsnorm = \"child has its own\"\n",
        )
        .file("child/common/rmsnorm.cu", "");
    // The child serves the parent's leaf.
    let targets = discover_targets(t.root(), "child", "*", "*").unwrap();
    assert_eq!(
        targets,
        vec![TargetId {
            hardware: "child".into(),
            model: "m".into(),
            quant: "bf16".into()
        }]
    );
    let r = t.resolve("child", "m", "bf16").unwrap();
    assert_eq!(
        modules(&r),
        vec![
            ("argmax".into(), "base/common/argmax.cu".into()),
            ("attention".into(), "base/m/bf16/attention.cu".into()),
            ("rmsnorm".into(), "child/common/rmsnorm.cu".into()),
        ]
    );
    assert_eq!(r.hardware.hardware.name, "child");
    // Without the declaration the child's override is an undeclared shadow.
    t.file("child/common/KERNEL.toml", "");
    assert!(matches!(
        t.resolve("child", "m", "bf16"),
        Err(LayoutError::UndeclaredShadow { .. })
    ));
}

#[test]
fn inheritance_cycle_fails() {
    let t = Tree::new();
    t.hardware("a", Some("b"))
        .hardware("b", Some("a"))
        .leaf("a", "m", "bf16", "");
    let err = t.resolve("a", "m", "bf16").unwrap_err();
    assert!(err.to_string().contains("cycle"), "{err}");
}

#[test]
fn sources_use_joins_the_layer_and_module_override_renames() {
    let t = Tree::new();
    t.hardware("hw", None)
        .file("hw/common/rope.cu", "")
        .leaf("hw", "other", "bf16", "")
        .file("hw/other/bf16/fast_attention.cu", "")
        .leaf(
            "hw",
            "m",
            "bf16",
            "[sources]\nuse = [\"hw/other/bf16/fast_attention.cu\"]\n[modules]\nfast_attention = \"attention\"\n",
        );
    let r = t.resolve("hw", "m", "bf16").unwrap();
    assert_eq!(
        modules(&r),
        vec![
            ("attention".into(), "hw/other/bf16/fast_attention.cu".into()),
            ("rope".into(), "hw/common/rope.cu".into()),
        ]
    );
    t.file(
        "hw/m/bf16/KERNEL.toml",
        "[sources]\nuse = [\"hw/missing.cu\"]\n",
    );
    assert!(matches!(
        t.resolve("hw", "m", "bf16"),
        Err(LayoutError::BadUse { .. })
    ));
    t.file(
        "hw/m/bf16/KERNEL.toml",
        "[sources]\nuse = [\"../outside.cu\"]\n",
    );
    t.file("../outside.cu", "");
    assert!(matches!(
        t.resolve("hw", "m", "bf16"),
        Err(LayoutError::BadUse { .. })
    ));
}

#[test]
fn wildcard_selection() {
    let t = Tree::new();
    t.hardware("hw", None)
        .leaf("hw", "qwen3", "bf16", "")
        .leaf("hw", "qwen3", "fp8", "")
        .leaf("hw", "llama", "bf16", "")
        .hardware("other", None)
        .leaf("other", "qwen3", "bf16", "");
    let names = |hw, m, q| -> Vec<String> {
        discover_targets(t.root(), hw, m, q)
            .unwrap()
            .iter()
            .map(|t| t.to_string())
            .collect()
    };
    assert_eq!(
        names("hw", "*", "*"),
        vec!["hw/llama/bf16", "hw/qwen3/bf16", "hw/qwen3/fp8"]
    );
    assert_eq!(
        names("*", "qwen3", "bf16"),
        vec!["hw/qwen3/bf16", "other/qwen3/bf16"]
    );
    assert_eq!(
        names("hw", "qw*", "fp8,bf16"),
        vec!["hw/qwen3/bf16", "hw/qwen3/fp8"]
    );
    assert!(names("nope", "*", "*").is_empty());
}

#[test]
fn unknown_manifest_key_is_an_error() {
    let t = Tree::new();
    t.hardware("hw", None)
        .leaf("hw", "m", "bf16", "[shadows]\nx = \"typo\"\n");
    let err = t.resolve("hw", "m", "bf16").unwrap_err();
    assert!(matches!(err, LayoutError::Manifest { .. }), "{err}");
}

#[test]
fn globs() {
    assert!(pattern_matches("*", "anything"));
    assert!(pattern_matches("qwen*", "qwen3"));
    assert!(pattern_matches("*-8b", "qwen3-8b"));
    assert!(!pattern_matches("qwen*", "llama"));
    assert!(pattern_matches("a,b", "b"));
}
