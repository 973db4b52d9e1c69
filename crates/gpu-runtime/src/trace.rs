// SPDX-License-Identifier: MIT OR Apache-2.0
//! A trace build's in-step timeline ([`crate::GpuBackend::set_kernel_trace`]): what block 0 of
//! every launch records at its programmatic-launch wait, and how a step's records read.
//!
//! The buffer is u64 words: the records written, the capacity in records, then four words a
//! record (kernels/hopper/common/common.cuh: the %globaltimer at the wait and after it, the grid's
//! block count and block size, the SM).

/// One launch's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRecord {
    /// When block 0 reached the wait (after any work the kernel does before it), ns.
    pub entered_ns: u64,
    /// When the wait returned: the launch before had finished and its writes were visible, ns.
    pub released_ns: u64,
    /// Blocks in the grid.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
    /// The SM block 0 ran on.
    pub sm: u32,
}

/// Records a trace buffer has room for: the kernels' bound (`TRACE_CAPACITY` in common.cuh, a
/// constant so that recording needs no load of the buffer's header).
pub const TRACE_CAPACITY: usize = 1 << 16;

/// Words of a trace buffer of `capacity` records.
pub fn trace_words(capacity: usize) -> usize {
    2 + 4 * capacity
}

/// A zeroed trace buffer's header for `capacity` records, as the bytes to upload (the records
/// need not be cleared: only those counted are read).
pub fn trace_header(capacity: usize) -> Vec<u8> {
    [0u64, capacity as u64]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()
}

/// The records of a trace buffer read back as words, in the order they were written; at most
/// the capacity, even where more launches tried to record.
pub fn parse_trace(words: &[u64]) -> Vec<TraceRecord> {
    let (Some(&count), Some(&capacity)) = (words.first(), words.get(1)) else {
        return Vec::new();
    };
    let n = count.min(capacity) as usize;
    words[2..]
        .chunks_exact(4)
        .take(n)
        .map(|r| TraceRecord {
            entered_ns: r[0],
            released_ns: r[1],
            blocks: (r[2] >> 32) as u32,
            threads: r[2] as u32,
            sm: r[3] as u32,
        })
        .collect()
}

/// Per launch, in order: how long block 0 waited at the wait (`released - entered`, the launch's
/// start that programmatic dependent launch hid), and the span from its release to the next
/// launch's release (the launch's own time on the step's critical path; the last launch has
/// none), both in µs.
pub fn spans_us(records: &[TraceRecord]) -> Vec<(f64, Option<f64>)> {
    records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let waited = r.released_ns.saturating_sub(r.entered_ns) as f64 / 1e3;
            let span = records
                .get(i + 1)
                .map(|next| next.released_ns.saturating_sub(r.released_ns) as f64 / 1e3);
            (waited, span)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_up_to_the_capacity() {
        let header = trace_header(2);
        assert_eq!(header.len(), 16);
        // Three launches tried to record into two slots.
        let words = [
            3u64,
            2,
            100,
            150,
            (264 << 32) | 256,
            7,
            140,
            400,
            (8 << 32) | 128,
            3,
        ];
        let records = parse_trace(&words);
        assert_eq!(records.len(), 2);
        assert_eq!(
            records[0],
            TraceRecord {
                entered_ns: 100,
                released_ns: 150,
                blocks: 264,
                threads: 256,
                sm: 7
            }
        );
        assert_eq!((records[1].blocks, records[1].threads), (8, 128));
        assert!(parse_trace(&[]).is_empty());
        assert_eq!(trace_words(2), 10);
    }

    #[test]
    fn spans_run_from_release_to_release() {
        let r = |entered_ns, released_ns| TraceRecord {
            entered_ns,
            released_ns,
            blocks: 1,
            threads: 32,
            sm: 0,
        };
        let spans = spans_us(&[r(0, 2_000), r(1_000, 5_000), r(6_000, 6_500)]);
        assert_eq!(spans[0], (2.0, Some(3.0)));
        assert_eq!(spans[1], (4.0, Some(1.5)));
        assert_eq!(spans[2], (0.5, None));
    }
}
