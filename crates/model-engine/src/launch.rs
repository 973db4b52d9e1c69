// SPDX-License-Identifier: MIT OR Apache-2.0
//! How the model's launches go out: on the default stream, labelled (for the profile and
//! `Model::set_skip`), with the tuning's grid caps and shared-memory carveouts.

use std::sync::Mutex;

use metrale_core::LaunchConfig;
use metrale_gpu_runtime::{GemmOp, GpuBackend, KernelHandle};
use metrale_kernels::Kernel;
use metrale_kernels::ops::gemv_launch_grid;

use crate::ModelError;
use crate::profile::Profiler;
use crate::tuning::{Carveout, Tuning};

/// Everything a block needs to launch its kernels during one step.
pub(crate) struct Launcher<'a> {
    pub(crate) gpu: &'a dyn GpuBackend,
    pub(crate) tuning: &'a Tuning,
    /// Labels left out, for timing experiments.
    pub(crate) skip: &'a [&'static str],
    pub(crate) profiler: Option<&'a Mutex<Profiler>>,
    /// Where MoE blocks copy their expert choices (routing capture on).
    pub(crate) routing: Option<&'a crate::instrument::RoutingCapture>,
}

impl Launcher<'_> {
    /// Whether launches of `label` go out (not left out by `Model::set_skip`). A left-out
    /// normalising launch writes no sum, so the residual stream stays where it was.
    pub(crate) fn runs(&self, label: &str) -> bool {
        !self.skip.contains(&label)
    }

    /// Launches one kernel with its own geometry and the label's carveout.
    pub(crate) fn launch<K: Kernel>(
        &self,
        handle: KernelHandle,
        label: &'static str,
        args: &K,
    ) -> Result<(), ModelError> {
        let carveout = self.carveout(label, false);
        self.launch_with(handle, label, args, &args.launch_config(), carveout)
    }

    /// A plain or staged GEMV of `m` rows over `n` output columns, its grid capped at the
    /// tuning's `gemv_grid_cap` where that leaves the kernel's columns per block as they were
    /// (`gemv_launch_grid`: the blocks then loop over the column groups, with the same sums).
    pub(crate) fn launch_gemv<K: Kernel>(
        &self,
        handle: KernelHandle,
        label: &'static str,
        args: &K,
        (m, n): (u32, u32),
        before_fold: bool,
    ) -> Result<(), ModelError> {
        let t = self.tuning;
        let mut config = args.launch_config();
        config.grid[0] = gemv_launch_grid(m, n, config.grid[0], t.gemv_grid_cap, t.gemv_grid_mode);
        let carveout = self.carveout(label, before_fold);
        self.launch_with(handle, label, args, &config, carveout)
    }

    /// A launch with its own geometry and the carveout of a product `before_fold` a launch that
    /// folds the residual add + RMSNorm (the bulk-copy streams: one block an SM whatever the
    /// product, no grid cap).
    pub(crate) fn launch_product<K: Kernel>(
        &self,
        handle: KernelHandle,
        label: &'static str,
        args: &K,
        before_fold: bool,
    ) -> Result<(), ModelError> {
        let carveout = self.carveout(label, before_fold);
        self.launch_with(handle, label, args, &args.launch_config(), carveout)
    }

    /// [`Launcher::launch`] with the given geometry and carveout.
    pub(crate) fn launch_with<K: Kernel>(
        &self,
        handle: KernelHandle,
        label: &'static str,
        args: &K,
        config: &LaunchConfig,
        carveout: Option<u8>,
    ) -> Result<(), ModelError> {
        if !self.runs(label) {
            return Ok(());
        }
        let g = self.gpu;
        let mut config = *config;
        if let Some(&(_, cap)) = self.tuning.grid_caps.iter().find(|(l, _)| *l == label) {
            config.grid[0] = config.grid[0].min(cap);
        }
        let s = g.default_stream();
        match carveout {
            Some(percent) => g.launch_with_carveout(handle, &config, &args.args(), s, percent)?,
            None => g.launch(handle, &config, &args.args(), s)?,
        }
        self.mark(label)
    }

    /// A product through the library GEMM (`GpuBackend::gemm`).
    pub(crate) fn gemm(
        &self,
        label: &'static str,
        op: &GemmOp,
        kernel: KernelHandle,
    ) -> Result<(), ModelError> {
        if !self.runs(label) {
            return Ok(());
        }
        self.gpu.gemm(op, kernel, self.gpu.default_stream())?;
        self.mark(label)
    }

    /// The shared-memory carveout (percent) a launch of `label` asks for; `None` leaves the
    /// split to the driver. `before_fold`: the launch is a product whose next launch folds the
    /// residual add + RMSNorm into a GEMV.
    pub(crate) fn carveout(&self, label: &str, before_fold: bool) -> Option<u8> {
        match &self.tuning.carveout {
            Carveout::Driver => None,
            Carveout::Rule => carveout_rule(label, before_fold),
            Carveout::Labels(labels) => labels.iter().find(|(l, _)| *l == label).map(|&(_, p)| p),
        }
    }

    /// When profiling, records the end of the work queued so far under `label`.
    pub(crate) fn mark(&self, label: &'static str) -> Result<(), ModelError> {
        if let Some(p) = self.profiler {
            p.lock().expect("profiler lock").mark(self.gpu, label)?;
        }
        Ok(())
    }
}

/// The measured carveout rule (docs/decisions.md, "Shared-memory carveout"). A kernel whose
/// blocks need another L1 / shared split than an SM holds becomes resident there only once the
/// kernel before has left, so the QKV product asks for the split the decode attention after it
/// needs (the most shared memory), and so does the o projection when the gate|up launch after it
/// folds the residual add + RMSNorm; every other launch leaves it to the driver.
pub(crate) fn carveout_rule(label: &str, before_fold: bool) -> Option<u8> {
    const MOST_SHARED: u8 = 100;
    match label {
        "qkv" => Some(MOST_SHARED),
        "o" if before_fold => Some(MOST_SHARED),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::carveout_rule;
    use crate::tuning::LAUNCH_LABELS;

    #[test]
    fn the_carveout_rule_names_qkv_and_o_before_a_folded_norm() {
        for folds in [false, true] {
            assert_eq!(carveout_rule("qkv", folds), Some(100));
            assert_eq!(carveout_rule("o", folds), folds.then_some(100));
            for label in LAUNCH_LABELS.iter().filter(|l| !["qkv", "o"].contains(l)) {
                assert_eq!(carveout_rule(label, folds), None, "{label}");
            }
        }
    }
}
