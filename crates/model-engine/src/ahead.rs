// SPDX-License-Identifier: MIT OR Apache-2.0
//! Greedy decode of one sequence with steps queued ahead of the host: each step's argmax feeds
//! the next on the device, and ids come back on a side stream a few steps late.

use metrale_cache::BlockTable;
use metrale_gpu_runtime::{Event, launch_kernel};
use metrale_kernels::ops::ArgmaxF32;

use crate::model::{Model, ModelError, StepInput};

impl Model {
    /// How many steps [`Model::decode_ahead`] keeps queued ahead of the id it reads back
    /// (the tuning's `decode_ahead`; 0: the caller steps with [`Model::forward_argmax`]).
    pub fn decode_ahead_steps(&self) -> u32 {
        self.tuning.decode_ahead
    }

    /// Greedy decode of one sequence without a host round trip per step: step `i` feeds
    /// `first` (for `i` = 0) or step `i - 1`'s argmax, taken on the device, at position
    /// `first_position + i`, for up to `steps` steps. Every step's integer inputs go up in one
    /// copy before the first (the block table is fixed: `table` must already reach the last
    /// position; the table row goes with the first step only, 32 bytes with each later one);
    /// then each step is queued as two device copies (its inputs, the previous id),
    /// its graph and its argmax, and each id comes back on a side stream once
    /// [`decode_ahead_steps`](Self::decode_ahead_steps) more steps are queued behind it (at least
    /// none), so the device has that many steps in hand while the host reads. `on_id` sees every id in
    /// order and returns whether to go on; the steps queued past the last one it accepts run
    /// and are discarded (their cache rows lie past the sequence's end). Returns once nothing
    /// is queued.
    pub fn decode_ahead(
        &mut self,
        table: &BlockTable,
        first: u32,
        first_position: usize,
        steps: usize,
        on_id: &mut dyn FnMut(u32) -> bool,
    ) -> Result<(), ModelError> {
        if steps == 0 {
            return Ok(());
        }
        // Step i's id is read once step i + ahead is queued.
        let lag = (self.tuning.decode_ahead as usize + 1).min(steps);
        // Every step's inputs as `upload` packs them (the id a placeholder past step 0): the
        // first step's whole, then only each later step's first 8 values (id, position,
        // sequence, slot, its one tile), since the block table row after them does not change.
        const HEAD: usize = 8;
        let mut plan = Vec::new();
        let mut buffers = None;
        for i in 0..steps {
            let position = [(first_position + i) as u32];
            let step = StepInput {
                tokens: &[if i == 0 { first } else { 0 }],
                positions: &position,
                token_seq: &[0],
                block_tables: &[table],
                logit_rows: &[0],
                state_slots: self.solo_state_slot(),
            };
            self.validate(&step)?;
            let (packed, places) = self.pack(&step, i == 0);
            if i == 0 {
                buffers = Some(places);
            } else {
                debug_assert_eq!(packed.len(), HEAD);
            }
            plan.extend(packed);
        }
        let first_len = plan.len() - (steps - 1) * HEAD;
        // The table row, the sequence's run (start, end) and its state slot follow the head.
        debug_assert_eq!(first_len, HEAD + self.options.max_blocks_per_seq() + 3);
        let g = self.gpu.clone();
        let g = g.as_ref();
        let s = g.default_stream();
        let readback = match self.readback {
            Some(r) => r,
            None => *self.readback.insert(g.create_stream()?),
        };
        let plan_dev = g.alloc(plan.len() * 4)?;
        let ids = g.alloc(steps * 4)?;
        while self.ahead_events.len() <= lag {
            self.ahead_events.push(g.create_event()?);
        }
        let events: Vec<Event> = self.ahead_events[..=lag].to_vec();
        let result = (|| -> Result<(), ModelError> {
            g.copy_h2d(bytemuck::cast_slice(&plan), plan_dev)?;
            let read = |j: usize| -> Result<u32, ModelError> {
                g.stream_wait_event(readback, events[j % events.len()])?;
                let mut id = [0u8; 4];
                g.copy_d2h_on(ids.offset(j * 4), &mut id, readback)?;
                Ok(i32::from_ne_bytes(id) as u32)
            };
            let mut next_read = 0;
            for i in 0..steps {
                let (at, len) = match i {
                    0 => (0, first_len),
                    _ => (first_len + (i - 1) * HEAD, HEAD),
                };
                g.copy_d2d(
                    plan_dev.offset(at * 4),
                    self.scratch.step_inputs,
                    len * 4,
                    s,
                )?;
                if i > 0 {
                    g.copy_d2d(ids.offset((i - 1) * 4), self.scratch.step_inputs, 4, s)?;
                }
                let position = [(first_position + i) as u32];
                let step = StepInput {
                    tokens: &[0],
                    positions: &position,
                    token_seq: &[0],
                    block_tables: &[table],
                    logit_rows: &[0],
                    state_slots: self.solo_state_slot(),
                };
                self.run_with(&step, buffers)?;
                let argmax = ArgmaxF32 {
                    out: ids.offset(i * 4),
                    logits: self.scratch.logits,
                    rows: 1,
                    cols: self.config.vocab_size as u32,
                    scratch: self.scratch.argmax_scratch,
                };
                launch_kernel(g, self.kernels.argmax, &argmax, s)?;
                g.record_event(events[i % events.len()], s)?;
                if i + 1 >= lag {
                    let go_on = on_id(read(next_read)?);
                    next_read += 1;
                    if !go_on {
                        return Ok(());
                    }
                }
            }
            while next_read < steps {
                let go_on = on_id(read(next_read)?);
                next_read += 1;
                if !go_on {
                    break;
                }
            }
            Ok(())
        })();
        // Nothing queued may outlive the buffers it reads; the first error is the one to report.
        let drained = g.synchronize(s);
        let freed = g.free(plan_dev).and(g.free(ids));
        result?;
        drained?;
        Ok(freed?)
    }
}
