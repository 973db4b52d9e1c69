// SPDX-License-Identifier: MIT OR Apache-2.0
//! Graph capture for the backends that simulate it (host and mock): while a stream captures, its
//! device-side operations are recorded instead of run, and a finished capture becomes a graph
//! that can be replayed.

use crate::backend::{GpuError, Graph, Stream};

/// The capture in progress (at most one) and the finished graphs, of operations `T`.
#[derive(Debug)]
pub(crate) struct Recorder<T> {
    active: Option<(Stream, Vec<T>)>,
    graphs: Vec<Vec<T>>,
}

impl<T> Default for Recorder<T> {
    fn default() -> Self {
        Recorder {
            active: None,
            graphs: Vec::new(),
        }
    }
}

impl<T: Clone> Recorder<T> {
    /// Whether some stream is capturing.
    pub(crate) fn is_capturing(&self) -> bool {
        self.active.is_some()
    }

    /// Starts capturing `stream`; one capture at a time.
    pub(crate) fn begin(&mut self, stream: Stream) -> Result<(), GpuError> {
        if self.active.is_some() {
            return Err(GpuError::Capture("a capture is already in progress".into()));
        }
        self.active = Some((stream, Vec::new()));
        Ok(())
    }

    /// Records `op` if `stream` is capturing; otherwise hands it back to be run.
    pub(crate) fn record(&mut self, op: T, stream: Stream) -> Option<T> {
        match &mut self.active {
            Some((capturing, ops)) if *capturing == stream => {
                ops.push(op);
                None
            }
            _ => Some(op),
        }
    }

    /// Ends the capture of `stream` and returns its graph.
    pub(crate) fn end(&mut self, stream: Stream) -> Result<Graph, GpuError> {
        match self.active.take() {
            Some((capturing, ops)) if capturing == stream => {
                self.graphs.push(ops);
                Ok(Graph(self.graphs.len() as u32 - 1))
            }
            other => {
                self.active = other;
                Err(GpuError::Capture(format!(
                    "end_capture on stream {} which is not capturing",
                    stream.0
                )))
            }
        }
    }

    /// The operations of a graph, to replay.
    pub(crate) fn graph(&self, graph: Graph) -> Result<Vec<T>, GpuError> {
        self.graphs
            .get(graph.0 as usize)
            .cloned()
            .ok_or(GpuError::InvalidHandle {
                kind: "graph",
                id: graph.0.into(),
            })
    }
}
