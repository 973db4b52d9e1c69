// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met doctor` as a user runs it: a real process, its exit code and its JSON.

use std::process::Command;

fn met(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_met"))
        .args(args)
        .output()
        .expect("met runs")
}

#[test]
fn doctor_json_lists_targets_and_reports_the_gpu() {
    let out = met(&["doctor", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "doctor panicked: {stderr}");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("doctor --json prints JSON");

    let targets = report["targets"].as_array().unwrap();
    if metrale_kernels::TARGETS.is_empty() {
        // Built with METRALE_SKIP_BUILD=1: no kernels, and doctor must say so by failing.
        assert!(targets.is_empty());
        assert!(!out.status.success());
    } else {
        let hopper: Vec<_> = targets
            .iter()
            .filter(|t| t["target"].as_str().unwrap().starts_with("hopper/"))
            .collect();
        assert!(!hopper.is_empty(), "no hopper targets: {targets:?}");
        for t in hopper {
            assert!(t["modules"].as_u64().unwrap() > 0, "{t}");
            assert_eq!(t["arch"], "sm_90a");
        }
    }

    match metrale_gpu_runtime::probe::probe_driver() {
        Err(_) => {
            // No GPU (CI): reported, non-zero exit, no panic.
            assert!(report["gpu_error"].is_string(), "{report}");
            assert_eq!(report["ok"], false);
            assert!(!out.status.success());
            let gpu = report["checks"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["name"] == "gpu")
                .unwrap();
            assert_eq!(gpu["status"], "fail");
        }
        Ok(info) => {
            assert_eq!(
                report["driver"]["devices"].as_array().unwrap().len(),
                info.devices.len()
            );
        }
    }
}

#[test]
fn version_and_help_tell_the_truth() {
    let out = met(&["--version"]);
    assert!(out.status.success());
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(version.contains(env!("CARGO_PKG_VERSION")), "{version}");
    assert!(
        version.contains(&format!(
            "{} embedded kernel targets",
            metrale_kernels::TARGETS.len()
        )),
        "{version}"
    );
    let help = String::from_utf8_lossy(&met(&["--help"]).stdout).to_string();
    for command in ["doctor", "check-kernels"] {
        assert!(help.contains(command), "{help}");
    }
    let bad = met(&["frobnicate"]);
    assert!(!bad.status.success());
}
