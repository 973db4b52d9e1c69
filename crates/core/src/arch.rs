// SPDX-License-Identifier: MIT OR Apache-2.0
//! SM architectures and the arch preflight: can binaries built for one arch run on a device?
//!
//! The rules are NVIDIA's compatibility rules for what `met` embeds (SASS for the class's arch plus
//! PTX of the same virtual arch):
//! - a plain arch (`sm_90`): SASS runs on the same major with an equal or higher minor, and the PTX
//!   can be JIT-compiled for any later device;
//! - an arch-specific arch (`sm_90a`): both SASS and PTX use features only that exact compute
//!   capability has (wgmma, setmaxnreg), so only that capability runs them;
//! - a family arch (`sm_100f`): runs on the same major with an equal or higher minor.

use std::fmt;
use std::str::FromStr;

/// Which devices an arch's binaries are allowed to run on, beyond the base compute capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArchSuffix {
    /// No suffix: forward compatible.
    None,
    /// `a`: arch-specific features; exactly this compute capability.
    ArchSpecific,
    /// `f`: family-specific features; this major, equal or higher minor.
    Family,
}

/// An SM architecture such as `sm_90a`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SmArch {
    /// Compute capability major (9 for Hopper).
    pub major: u32,
    /// Compute capability minor.
    pub minor: u32,
    /// The feature suffix.
    pub suffix: ArchSuffix,
}

/// An arch string that does not parse.
#[derive(Debug, thiserror::Error)]
#[error(
    "invalid SM arch `{0}`: expected `sm_<major><minor>` with an optional `a` or `f` suffix, e.g. `sm_90a`"
)]
pub struct ArchError(pub String);

impl FromStr for SmArch {
    type Err = ArchError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ArchError(s.to_string());
        let digits = s.strip_prefix("sm_").ok_or_else(err)?;
        let (digits, suffix) = match digits.as_bytes().last() {
            Some(b'a') => (&digits[..digits.len() - 1], ArchSuffix::ArchSpecific),
            Some(b'f') => (&digits[..digits.len() - 1], ArchSuffix::Family),
            _ => (digits, ArchSuffix::None),
        };
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        Ok(SmArch {
            major: major.parse().map_err(|_| err())?,
            minor: minor.parse().map_err(|_| err())?,
            suffix,
        })
    }
}

impl fmt::Display for SmArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let suffix = match self.suffix {
            ArchSuffix::None => "",
            ArchSuffix::ArchSpecific => "a",
            ArchSuffix::Family => "f",
        };
        write!(f, "sm_{}{}{}", self.major, self.minor, suffix)
    }
}

/// The outcome of the arch preflight for one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preflight {
    /// Whether the binaries can run on the device.
    pub passes: bool,
    /// One sentence an operator can act on.
    pub reason: String,
}

impl SmArch {
    /// Can binaries built for `self` run on a device of compute capability `major.minor`?
    pub fn preflight(&self, major: u32, minor: u32) -> Preflight {
        let device = format!("compute capability {major}.{minor}");
        let passes = match self.suffix {
            ArchSuffix::ArchSpecific => major == self.major && minor == self.minor,
            ArchSuffix::Family => major == self.major && minor >= self.minor,
            ArchSuffix::None => (major, minor) >= (self.major, self.minor),
        };
        let reason = if passes {
            format!("{self} binaries run on {device}")
        } else {
            let needs = match self.suffix {
                ArchSuffix::ArchSpecific => format!("exactly {}.{}", self.major, self.minor),
                ArchSuffix::Family => format!("{}.x with x >= {}", self.major, self.minor),
                ArchSuffix::None => format!("{}.{} or newer", self.major, self.minor),
            };
            format!("{self} binaries need compute capability {needs}, this GPU has {major}.{minor}")
        };
        Preflight { passes, reason }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for s in ["sm_90a", "sm_90", "sm_121f", "sm_100a"] {
            assert_eq!(s.parse::<SmArch>().unwrap().to_string(), s);
        }
        let a: SmArch = "sm_121f".parse().unwrap();
        assert_eq!((a.major, a.minor, a.suffix), (12, 1, ArchSuffix::Family));
        for bad in ["90a", "sm_", "sm_9", "sm_9x", "sm_90aa"] {
            assert!(bad.parse::<SmArch>().is_err(), "{bad}");
        }
    }

    #[test]
    fn arch_specific_runs_only_on_its_capability() {
        let hopper: SmArch = "sm_90a".parse().unwrap();
        assert!(hopper.preflight(9, 0).passes);
        let no = hopper.preflight(10, 0);
        assert!(!no.passes);
        assert!(
            no.reason.contains("exactly 9.0") && no.reason.contains("10.0"),
            "{}",
            no.reason
        );
        assert!(!hopper.preflight(8, 9).passes);
    }

    #[test]
    fn plain_and_family_are_forward_compatible() {
        let plain: SmArch = "sm_80".parse().unwrap();
        assert!(plain.preflight(9, 0).passes);
        assert!(!plain.preflight(7, 5).passes);
        let fam: SmArch = "sm_100f".parse().unwrap();
        assert!(fam.preflight(10, 3).passes);
        assert!(!fam.preflight(12, 0).passes);
    }
}
