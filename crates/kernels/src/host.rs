// SPDX-License-Identifier: MIT OR Apache-2.0
//! The interface host references run against, the [`Kernel`] trait, and the reference table.

use bytemuck::Pod;
use half::bf16;
use metrale_core::{DevicePtr, KernelArg, KernelName, LaunchConfig};

/// What a host reference can go wrong on.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A pointer range is not inside one live allocation.
    #[error("memory access {ptr}..+{len} bytes is outside every allocation")]
    OutOfBounds {
        /// Start of the access.
        ptr: DevicePtr,
        /// Length in bytes.
        len: usize,
    },
    /// The argument list does not match the kernel's signature.
    #[error("kernel {kernel}: {message}")]
    BadArgs {
        /// The kernel.
        kernel: KernelName,
        /// What is wrong.
        message: String,
    },
}

/// Device memory as a host reference sees it: byte ranges of a backend's allocations.
pub trait HostMemory {
    /// `len` bytes at `ptr`, which must lie inside one allocation.
    fn bytes(&self, ptr: DevicePtr, len: usize) -> Result<&[u8], HostError>;
    /// The same range, writable.
    fn bytes_mut(&mut self, ptr: DevicePtr, len: usize) -> Result<&mut [u8], HostError>;
}

/// Copies `n` elements of `T` out of device memory.
pub fn load<T: Pod>(mem: &dyn HostMemory, ptr: DevicePtr, n: usize) -> Result<Vec<T>, HostError> {
    Ok(bytemuck::pod_collect_to_vec(
        mem.bytes(ptr, n * size_of::<T>())?,
    ))
}

/// Borrows `n` elements of `T` in place when the bytes are aligned for `T`, else copies them.
pub fn view<T: Pod>(
    mem: &dyn HostMemory,
    ptr: DevicePtr,
    n: usize,
) -> Result<std::borrow::Cow<'_, [T]>, HostError> {
    let bytes = mem.bytes(ptr, n * size_of::<T>())?;
    Ok(match bytemuck::try_cast_slice(bytes) {
        Ok(slice) => std::borrow::Cow::Borrowed(slice),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    })
}

/// Widens bf16 to f32 (exact).
pub fn widen(v: bf16) -> f32 {
    f32::from_bits(u32::from(v.to_bits()) << 16)
}

/// Copies `n` bf16 elements out of device memory, widened to f32.
pub fn load_bf16(mem: &dyn HostMemory, ptr: DevicePtr, n: usize) -> Result<Vec<f32>, HostError> {
    Ok(load::<bf16>(mem, ptr, n)?
        .into_iter()
        .map(f32::from)
        .collect())
}

/// Writes `data` into device memory at `ptr`.
pub fn store<T: Pod>(
    mem: &mut dyn HostMemory,
    ptr: DevicePtr,
    data: &[T],
) -> Result<(), HostError> {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    mem.bytes_mut(ptr, bytes.len())?.copy_from_slice(bytes);
    Ok(())
}

/// Rounds f32 values to bf16 and writes them.
pub fn store_bf16(mem: &mut dyn HostMemory, ptr: DevicePtr, data: &[f32]) -> Result<(), HostError> {
    let rounded: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
    store(mem, ptr, &rounded)
}

/// f32 -> bf16 -> f32, the rounding a bf16 store applies.
pub fn round_bf16(v: f32) -> f32 {
    f32::from(bf16::from_f32(v))
}

/// One kernel's ABI and reference: a typed argument struct, its entry point and launch geometry,
/// and a Rust implementation of what the CUDA kernel computes.
pub trait Kernel: Sized {
    /// The entry point (a generated constant from [`crate::names`]).
    const NAME: KernelName;
    /// Grid, block and shared memory for these arguments.
    fn launch_config(&self) -> LaunchConfig;
    /// The arguments in the order of the C signature.
    fn args(&self) -> Vec<KernelArg>;
    /// Rebuilds the struct from an argument list (the inverse of [`Kernel::args`]).
    fn from_args(args: &[KernelArg]) -> Result<Self, HostError>;
    /// The reference implementation, run against the host backend's memory.
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError>;
}

/// A host reference as the host backend calls it: decode the arguments, run the reference.
pub type HostKernelFn =
    fn(&mut dyn HostMemory, &LaunchConfig, &[KernelArg]) -> Result<(), HostError>;

fn run<K: Kernel>(
    mem: &mut dyn HostMemory,
    _config: &LaunchConfig,
    args: &[KernelArg],
) -> Result<(), HostError> {
    K::from_args(args)?.reference(mem)
}

/// A Rust type that maps to one [`KernelArg`] variant.
pub trait ArgType: Sized {
    /// Wraps the value.
    fn into_arg(self) -> KernelArg;
    /// Unwraps the value, or names the mismatch.
    fn from_arg(arg: &KernelArg) -> Option<Self>;
}

macro_rules! arg_type {
    ($t:ty, $variant:ident) => {
        impl ArgType for $t {
            fn into_arg(self) -> KernelArg {
                KernelArg::$variant(self)
            }
            fn from_arg(arg: &KernelArg) -> Option<Self> {
                match arg {
                    KernelArg::$variant(v) => Some(*v),
                    _ => None,
                }
            }
        }
    };
}
arg_type!(DevicePtr, Ptr);
arg_type!(i32, I32);
arg_type!(u32, U32);
arg_type!(u64, U64);
arg_type!(f32, F32);

/// Takes the next argument of the expected type, or says which one is wrong.
pub fn take_arg<T: ArgType>(
    kernel: KernelName,
    args: &[KernelArg],
    index: usize,
    field: &str,
) -> Result<T, HostError> {
    let arg = args.get(index).ok_or_else(|| HostError::BadArgs {
        kernel,
        message: format!(
            "missing argument {index} (`{field}`), got {} arguments",
            args.len()
        ),
    })?;
    T::from_arg(arg).ok_or_else(|| HostError::BadArgs {
        kernel,
        message: format!(
            "argument {index} (`{field}`) has the wrong type: got {}",
            arg.kind()
        ),
    })
}

/// Declares a kernel's argument struct with `args` and `from_args` in C order:
/// `kernel_args!(Name => names::module::FUNCTION { field: Type, ... });`
macro_rules! kernel_args {
    ($(#[$meta:meta])* $name:ident => $entry:path { $($(#[$fmeta:meta])* $field:ident : $ty:ty),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
        }

        impl $name {
            fn encode(&self) -> Vec<metrale_core::KernelArg> {
                vec![$($crate::host::ArgType::into_arg(self.$field)),*]
            }

            fn decode(args: &[metrale_core::KernelArg]) -> Result<Self, $crate::host::HostError> {
                let expected = [$(stringify!($field)),*].len();
                if args.len() != expected {
                    return Err($crate::host::HostError::BadArgs {
                        kernel: $entry,
                        message: format!("expected {expected} arguments, got {}", args.len()),
                    });
                }
                let mut _index = 0usize;
                Ok($name {
                    $($field: {
                        let v = $crate::host::take_arg::<$ty>($entry, args, _index, stringify!($field))?;
                        _index += 1;
                        v
                    },)*
                })
            }
        }
    };
}
pub(crate) use kernel_args;

/// Every host reference, by entry point.
static HOST_KERNELS: &[(KernelName, HostKernelFn)] = {
    use crate::ops::*;
    &[
        (Embedding::NAME, run::<Embedding>),
        (RmsNorm::NAME, run::<RmsNorm>),
        (AddRmsNorm::NAME, run::<AddRmsNorm>),
        (RopeNeox::NAME, run::<RopeNeox>),
        (SiluMul::NAME, run::<SiluMul>),
        (Add::NAME, run::<Add>),
        (ArgmaxBf16::NAME, run::<ArgmaxBf16>),
        (ArgmaxF32::NAME, run::<ArgmaxF32>),
        (Gemm::NAME, run::<Gemm>),
        (GemmF32Out::NAME, run::<GemmF32Out>),
        (Gemv::NAME, run::<Gemv>),
        (PagedAttention::NAME, run::<PagedAttention>),
        (KvCacheWrite::NAME, run::<KvCacheWrite>),
    ]
};

/// The host reference of an entry point, if it has one.
pub fn host_reference(name: KernelName) -> Option<HostKernelFn> {
    HOST_KERNELS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, f)| *f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_has_a_host_reference() {
        let missing: Vec<String> = crate::ALL_KERNELS
            .iter()
            .filter(|k| host_reference(**k).is_none())
            .map(|k| k.to_string())
            .collect();
        assert!(
            missing.is_empty(),
            "kernels without a host reference: {missing:?}"
        );
        assert_eq!(HOST_KERNELS.len(), crate::ALL_KERNELS.len());
    }
}
