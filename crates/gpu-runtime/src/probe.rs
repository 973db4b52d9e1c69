// SPDX-License-Identifier: MIT OR Apache-2.0
//! What the machine has: the driver, its devices, and the GPU libraries the engine loads at run
//! time. Used by `met doctor` and before choosing a backend; never panics when nothing is there.

use std::ffi::c_char;

use cudarc::driver::sys;

use crate::GpuError;
use crate::cuda::{check, driver};

/// One CUDA device.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: usize,
    /// Marketing name (`NVIDIA H200`).
    pub name: String,
    /// Device memory, bytes.
    pub total_memory: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
}

impl DeviceInfo {
    /// `sm_90`-style arch of the device.
    pub fn sm(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// The driver and its devices.
#[derive(Clone, Debug, PartialEq)]
pub struct DriverInfo {
    /// CUDA version the driver supports, (major, minor).
    pub cuda_version: (u32, u32),
    /// Devices, by ordinal.
    pub devices: Vec<DeviceInfo>,
}

/// Loads the driver and lists its devices. No driver library is [`GpuError::NoDriver`]; a driver
/// that reports no device is [`GpuError::NoDevice`].
pub fn probe_driver() -> Result<DriverInfo, GpuError> {
    driver()?;
    let mut version = 0i32;
    // SAFETY: out-pointer to a local; the driver is initialised.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut version)
    })?;
    let count = device_count()?;
    if count == 0 {
        return Err(GpuError::NoDevice("0 devices".into()));
    }
    let devices = (0..count).map(device_info).collect::<Result<_, _>>()?;
    Ok(DriverInfo {
        cuda_version: ((version / 1000) as u32, ((version % 1000) / 10) as u32),
        devices,
    })
}

fn device_count() -> Result<usize, GpuError> {
    let mut count = 0i32;
    // SAFETY: out-pointer to a local; the driver is initialised.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    Ok(count.max(0) as usize)
}

/// Facts of device `ordinal`.
pub fn device_info(ordinal: usize) -> Result<DeviceInfo, GpuError> {
    driver()?;
    let count = device_count()?;
    if ordinal >= count {
        return Err(GpuError::BadOrdinal { ordinal, count });
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: out-pointer to a local; ordinal < count.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal as i32)
    })?;
    let mut name = [0 as c_char; 256];
    // SAFETY: the buffer holds 256 bytes and the driver writes at most `len` including the NUL.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev)
    })?;
    let name: Vec<u8> = name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let mut total = 0usize;
    // SAFETY: out-pointer to a local.
    check("cuDeviceTotalMem", unsafe {
        sys::cuDeviceTotalMem_v2(&mut total, dev)
    })?;
    let attr = |a: sys::CUdevice_attribute| -> Result<u32, GpuError> {
        let mut v = 0i32;
        // SAFETY: out-pointer to a local.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(&mut v, a, dev)
        })?;
        Ok(v.max(0) as u32)
    };
    use sys::CUdevice_attribute as A;
    Ok(DeviceInfo {
        ordinal,
        name: String::from_utf8_lossy(&name).into_owned(),
        total_memory: total as u64,
        compute_capability: (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        sm_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
    })
}

/// Whether a shared library could be opened, and from where.
#[derive(Clone, Debug, PartialEq)]
pub struct LibraryStatus {
    /// The library (`cuBLASLt`).
    pub name: &'static str,
    /// The file name or path that opened, if one did.
    pub loaded_from: Option<String>,
    /// Every name and path tried.
    pub tried: Vec<String>,
}

fn cuda_lib_dirs() -> Vec<String> {
    let mut dirs = Vec::new();
    if let Ok(home) = std::env::var("CUDA_HOME") {
        dirs.push(format!("{home}/lib64"));
        dirs.push(format!("{home}/targets/x86_64-linux/lib"));
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    dirs
}

fn probe_library(name: &'static str, files: &[&str]) -> LibraryStatus {
    let mut tried: Vec<String> = files.iter().map(|f| f.to_string()).collect();
    for dir in cuda_lib_dirs() {
        tried.extend(files.iter().map(|f| format!("{dir}/{f}")));
    }
    let loaded_from = tried.iter().find(|candidate| {
        // SAFETY: opening NVIDIA's own libraries runs their initialisers, which have no
        // preconditions; the handle is dropped (dlclose) at once and nothing from it is called.
        unsafe { libloading::Library::new(candidate.as_str()) }.is_ok()
    });
    LibraryStatus {
        name,
        loaded_from: loaded_from.cloned(),
        tried,
    }
}

/// Can cuBLASLt be loaded (the GEMM library the engine may use for prefill)?
pub fn probe_cublaslt() -> LibraryStatus {
    probe_library("cuBLASLt", &["libcublasLt.so.13", "libcublasLt.so"])
}

/// Can NCCL be loaded (collectives for multi-GPU serving)?
pub fn probe_nccl() -> LibraryStatus {
    probe_library("NCCL", &["libnccl.so.2", "libnccl.so"])
}
