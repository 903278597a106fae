//! An in-memory simulator: runs the schedules of N virtual ranks against each other with the
//! same matching rules as the network (per-pair FIFO), so every algorithm can be checked for
//! every world size and count without a socket.

use std::collections::VecDeque;

use nexar_types::{Element, ReduceOp, reduce_slice};

use super::schedule::{Schedule, Slot, Span, Step};

/// The buffers of one virtual rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimRank<T> {
    /// The buffer the operation writes.
    pub data: Vec<T>,
    /// The read-only send buffer.
    pub input: Vec<T>,
}

/// Why a simulation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// No rank can make progress and some have steps left.
    #[error("deadlock: ranks stuck at (rank, step) {0:?}")]
    Deadlock(Vec<(usize, usize)>),
    /// A message's length differs from the receiving span.
    #[error("rank {rank} step {step}: received {got} elements into a span of {expected}")]
    LengthMismatch {
        /// The receiving rank.
        rank: usize,
        /// Its step.
        step: usize,
        /// Span length.
        expected: usize,
        /// Message length.
        got: usize,
    },
    /// A span lies outside its buffer or a peer is out of range.
    #[error("rank {rank} step {step}: {what}")]
    Invalid {
        /// The rank.
        rank: usize,
        /// Its step.
        step: usize,
        /// What is wrong.
        what: String,
    },
    /// Messages were sent that nobody received.
    #[error("{count} message(s) from rank {from} to rank {to} were never received")]
    Leftover {
        /// Sender.
        from: usize,
        /// Receiver.
        to: usize,
        /// How many.
        count: usize,
    },
}

fn slice<'a, T>(bufs: &'a SimRank<T>, scratch: &'a [T], span: Span) -> Option<&'a [T]> {
    let buf: &[T] = match span.slot {
        Slot::Data => &bufs.data,
        Slot::Input => &bufs.input,
        Slot::Scratch => scratch,
    };
    buf.get(span.offset..span.end())
}

fn slice_mut<'a, T>(bufs: &'a mut SimRank<T>, scratch: &'a mut [T], span: Span) -> Option<&'a mut [T]> {
    let buf: &mut [T] = match span.slot {
        Slot::Data => &mut bufs.data,
        Slot::Input => return None,
        Slot::Scratch => scratch,
    };
    buf.get_mut(span.offset..span.end())
}

/// Runs `schedules[r]` for every virtual rank `r` over `ranks[r]`, reducing with `op`.
pub fn simulate<T: Element>(schedules: &[Schedule], ranks: &mut [SimRank<T>], op: ReduceOp) -> Result<(), SimError> {
    let w = schedules.len();
    let mut queues: Vec<VecDeque<Vec<T>>> = vec![VecDeque::new(); w * w];
    let mut pcs = vec![0usize; w];
    let mut scratch: Vec<Vec<T>> = schedules.iter().map(|s| vec![T::zeroed(); s.scratch_len]).collect();
    loop {
        let mut progress = false;
        for r in 0..w {
            let steps = &schedules[r].steps;
            while pcs[r] < steps.len() {
                let at = pcs[r];
                let invalid = |what: String| SimError::Invalid { rank: r, step: at, what };
                let oob = || invalid("span outside its buffer".into());
                match steps[at] {
                    Step::Send { to, src } => {
                        if to >= w {
                            return Err(invalid(format!("send to rank {to} of {w}")));
                        }
                        let msg = slice(&ranks[r], &scratch[r], src).ok_or_else(oob)?.to_vec();
                        queues[r * w + to].push_back(msg);
                    }
                    Step::Recv { from, dst, reduce } => {
                        if from >= w {
                            return Err(invalid(format!("receive from rank {from} of {w}")));
                        }
                        let Some(msg) = queues[from * w + r].pop_front() else {
                            break;
                        };
                        let out = slice_mut(&mut ranks[r], &mut scratch[r], dst).ok_or_else(oob)?;
                        if msg.len() != out.len() {
                            return Err(SimError::LengthMismatch {
                                rank: r,
                                step: at,
                                expected: out.len(),
                                got: msg.len(),
                            });
                        }
                        if reduce {
                            reduce_slice(op, out, &msg).map_err(|e| invalid(e.to_string()))?;
                        } else {
                            out.copy_from_slice(&msg);
                        }
                    }
                    Step::Copy { src, dst } | Step::Reduce { src, dst } => {
                        let operand = slice(&ranks[r], &scratch[r], src).ok_or_else(oob)?.to_vec();
                        let out = slice_mut(&mut ranks[r], &mut scratch[r], dst).ok_or_else(oob)?;
                        if operand.len() != out.len() {
                            return Err(invalid("local step with spans of different lengths".into()));
                        }
                        if matches!(steps[at], Step::Copy { .. }) {
                            out.copy_from_slice(&operand);
                        } else {
                            reduce_slice(op, out, &operand).map_err(|e| invalid(e.to_string()))?;
                        }
                    }
                }
                pcs[r] += 1;
                progress = true;
            }
        }
        let stuck: Vec<(usize, usize)> =
            (0..w).filter(|r| pcs[*r] < schedules[*r].steps.len()).map(|r| (r, pcs[r])).collect();
        if stuck.is_empty() {
            break;
        }
        if !progress {
            return Err(SimError::Deadlock(stuck));
        }
    }
    for from in 0..w {
        for to in 0..w {
            let count = queues[from * w + to].len();
            if count > 0 {
                return Err(SimError::Leftover { from, to, count });
            }
        }
    }
    Ok(())
}
