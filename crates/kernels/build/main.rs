// SPDX-License-Identifier: MIT OR Apache-2.0
//! Compiles the kernel tree ahead of time and generates the registry.
//!
//! 1. Resolve every target of the tree (so a structural error fails every build, even a stub one)
//!    and collect the `extern "C"` entry points of every source into typed name constants.
//! 2. Select the targets matching `METRALE_TARGET_{HW,MODEL,QUANT}` (each a glob, default `*`).
//! 3. Unless `METRALE_SKIP_BUILD=1`: key every source by its include closure, flags, arch and
//!    compiler ([`metrale_closure::CompileKey`]), compile each distinct key once (in parallel, with
//!    a cache that survives `cargo clean` of this crate) into a fatbin holding SASS for the class's
//!    arch plus its PTX, and embed the fatbins.
//! 4. Write `$OUT_DIR/registry.rs`, which `src/registry.rs` includes.

mod compile;
mod emit;

use std::path::{Path, PathBuf};

use metrale_closure::{ResolvedTarget, TargetId, discover_targets, resolve_target, scan};

fn env(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn fail(message: &str) -> ! {
    eprintln!("\nerror: metrale-kernels: {message}\n");
    std::process::exit(1);
}

fn main() {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = env("METRALE_KERNEL_TREE")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir.join("../../kernels"));
    let root = root
        .canonicalize()
        .unwrap_or_else(|e| fail(&format!("kernel tree {}: {e}", root.display())));
    println!("cargo:rerun-if-changed={}", root.display());
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap());

    let all = resolve_all(&root, "*", "*", "*");
    let entry_points = collect_entry_points(&all);

    let hw = env("METRALE_TARGET_HW").unwrap_or_else(|| "*".into());
    let model = env("METRALE_TARGET_MODEL").unwrap_or_else(|| "*".into());
    let quant = env("METRALE_TARGET_QUANT").unwrap_or_else(|| "*".into());
    let selected: Vec<&ResolvedTarget> = all
        .iter()
        .filter(|t| {
            metrale_closure::layout::pattern_matches(&hw, &t.id.hardware)
                && metrale_closure::layout::pattern_matches(&model, &t.id.model)
                && metrale_closure::layout::pattern_matches(&quant, &t.id.quant)
        })
        .collect();

    let skip = env("METRALE_SKIP_BUILD").is_some_and(|v| v != "0");
    let compiled = if skip {
        println!("cargo:warning=METRALE_SKIP_BUILD is set: no kernels are compiled or embedded");
        Vec::new()
    } else {
        if selected.is_empty() {
            fail(&format!(
                "no kernel target matches METRALE_TARGET_HW={hw} METRALE_TARGET_MODEL={model} METRALE_TARGET_QUANT={quant}; the tree has: {}",
                all.iter()
                    .map(|t| t.id.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        compile::compile_targets(&selected, &out_dir).unwrap_or_else(|e| fail(&e))
    };
    let classes = all
        .iter()
        .map(|t| (t.id.hardware.clone(), t.hardware.clone()))
        .collect();
    let code = emit::registry(&root, &entry_points, &classes, &compiled);
    std::fs::write(out_dir.join("registry.rs"), code).unwrap();
}

fn resolve_all(root: &Path, hw: &str, model: &str, quant: &str) -> Vec<ResolvedTarget> {
    let ids: Vec<TargetId> =
        discover_targets(root, hw, model, quant).unwrap_or_else(|e| fail(&e.to_string()));
    ids.iter()
        .map(|id| resolve_target(root, id).unwrap_or_else(|e| fail(&e.to_string())))
        .collect()
}

/// module name -> sorted, deduplicated entry points, over every source any target compiles.
fn collect_entry_points(all: &[ResolvedTarget]) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut map: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        Default::default();
    for target in all {
        for source in &target.sources {
            let text = std::fs::read_to_string(&source.path)
                .unwrap_or_else(|e| fail(&format!("{}: {e}", source.path.display())));
            let functions = scan::kernel_functions(&text);
            if functions.is_empty() {
                fail(&format!(
                    "{} defines no `extern \"C\" __global__` kernel",
                    source.path.display()
                ));
            }
            map.entry(source.module.clone())
                .or_default()
                .extend(functions);
        }
    }
    map.into_iter()
        .map(|(k, v)| (k, v.into_iter().collect()))
        .collect()
}
