//! A receive's destination lent, for the length of one synchronous call, to the reader that
//! call polls on the same thread: a TCP lane's reader then reads the payload of the message
//! that receive waits for straight into the caller's buffer (one copy, as MPI's TCP transport
//! makes), instead of into a pooled buffer that the receive copies out of afterwards.
//!
//! The buffer is never held anywhere once the call that lends it returns: [`lend`] puts it in
//! a thread-local slot for the duration of its closure and takes it out again on the way out
//! (also when the closure panics), and [`with_lent`] shows it to a closure of its own, from
//! which it cannot escape. So only the receive's own `poll`, on its own thread, ever writes
//! into its buffer; a reader polled anywhere else sees no buffer, and a receive that is
//! dropped has lent nothing. With the shared-memory mapping, this is one of nexar's two
//! `unsafe` modules.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::ptr::NonNull;

use crate::transport::bulk::Awaited;

/// What [`lend`] puts in the slot: where the buffer starts, its length, and the message it
/// waits for.
#[derive(Clone, Copy)]
struct Slot {
    start: NonNull<u8>,
    len: usize,
    awaited: Awaited,
}

thread_local! {
    static LENT: Cell<Option<Slot>> = const { Cell::new(None) };
}

/// A buffer lent by a receive ([`with_lent`]): the message it waits for and the bytes its
/// payload is to fill.
pub(crate) struct Lent<'a> {
    /// The message whose payload belongs in `dst`.
    pub awaited: Awaited,
    /// Exactly as long as that payload.
    pub dst: &'a mut [u8],
}

/// Runs `f` with `dst`, the destination of the receive that waits for `awaited`, lent to
/// whatever `f` polls on this thread ([`with_lent`]).
pub(crate) fn lend<R>(dst: &mut [u8], awaited: Awaited, f: impl FnOnce() -> R) -> R {
    /// Puts back what the slot held before (an outer lend, or nothing), also on unwinding.
    struct Restore(Option<Slot>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LENT.with(|slot| slot.set(self.0));
        }
    }
    let lent = Slot { start: NonNull::from(&mut *dst).cast(), len: dst.len(), awaited };
    let _restore = Restore(LENT.with(|slot| slot.replace(Some(lent))));
    f()
}

/// Ends the loan on this thread (for the rest of its lend) if it is for `msg`'s receive: a
/// reader that delivers `msg` the usual way calls this, since that receive takes `msg` and
/// its buffer is then no place for the next message of the same kind.
pub(crate) fn forfeit_for(msg: &crate::proto::message::PeerMsg) {
    LENT.with(|slot| {
        if slot.get().is_some_and(|lent| lent.awaited.is(msg)) {
            slot.set(None);
        }
    });
}

/// Runs `f` with the buffer lent on this thread, if any. The buffer is taken out of the slot
/// while `f` runs (a nested call sees none), and put back afterwards.
pub(crate) fn with_lent<R>(f: impl FnOnce(Option<Lent<'_>>) -> R) -> R {
    struct PutBack(Option<Slot>);
    impl Drop for PutBack {
        fn drop(&mut self) {
            if self.0.is_some() {
                LENT.with(|slot| slot.set(self.0));
            }
        }
    }
    let back = PutBack(LENT.with(Cell::take));
    let lent = back.0.map(|s| Lent {
        awaited: s.awaited,
        // SAFETY: the slot holds a buffer only while `lend` runs on this thread, and `lend`
        // holds the `&mut [u8]` it was made from for all that time, so the pointer and length
        // describe live memory nobody else touches meanwhile. The slot is emptied while this
        // slice exists (a nested `with_lent` finds nothing), so it is the only reference to
        // that memory, and its lifetime ends with `f`, before `lend` can return.
        dst: unsafe { std::slice::from_raw_parts_mut(s.start.as_ptr(), s.len) },
    });
    f(lent)
}

#[cfg(test)]
mod tests {
    use super::*;

    const AWAITED: Awaited = Awaited::Collective { comm: 1, seq: 2, part: 0 };

    #[test]
    fn a_buffer_is_lent_only_while_its_lender_runs_and_once_at_a_time() {
        let mut dst = vec![0u8; 8];
        assert!(with_lent(|lent| lent.is_none()), "nothing lent outside a lend");
        lend(&mut dst, AWAITED, || {
            with_lent(|lent| {
                let lent = lent.expect("lent inside");
                assert_eq!(lent.awaited, AWAITED);
                lent.dst.copy_from_slice(b"received");
                // The buffer is out of the slot while it is shown.
                assert!(with_lent(|inner| inner.is_none()));
            });
            // And back in it afterwards.
            assert!(with_lent(|lent| lent.is_some()));
        });
        assert_eq!(&dst, b"received");
        assert!(with_lent(|lent| lent.is_none()), "nothing lent once the lender returned");
    }

    #[test]
    fn a_lend_that_panics_leaves_nothing_lent() {
        let mut dst = vec![0u8; 4];
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            lend(&mut dst, AWAITED, || with_lent(|_| panic!("a reader failed")))
        }));
        assert!(unwound.is_err());
        assert!(with_lent(|lent| lent.is_none()));
        // Another thread never sees this thread's buffer.
        lend(&mut dst, AWAITED, || {
            std::thread::scope(|s| s.spawn(|| assert!(with_lent(|lent| lent.is_none()))).join().unwrap());
        });
    }
}
