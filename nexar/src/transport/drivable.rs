//! A background task whose future other tasks of the runtime may also poll, on the task's
//! behalf: a receive spinning on its mailbox polls its link's reading task once between its
//! polls, so a message the runtime has just seen arrive is read and delivered at once instead
//! of on the reading task's turn (a cycle of the runtime later: the receive, woken first, has
//! already polled the mailbox by then).
//!
//! The future is always polled with its own task's waker, whoever polls it, so every wake-up it
//! asks for (a socket's readiness, a timer) goes to its task as before: a receive that stops
//! polling leaves nothing behind. One poll at a time: a poll that finds another under way (on
//! another thread) does nothing.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

type Boxed = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// The future, while it runs, and its task's waker (once the task has polled it).
struct Slot {
    fut: Option<Boxed>,
    waker: Option<Waker>,
}

/// A spawned future that may also be polled from elsewhere ([`drive`](Self::drive)).
pub(crate) struct Drivable {
    slot: Mutex<Slot>,
}

/// Drops the future when its task is dropped (the runtime shutting down), as a plain task's
/// future would be.
struct DropsFuture(Arc<Drivable>);

impl Drop for DropsFuture {
    fn drop(&mut self) {
        let fut = crate::sync::lock(&self.0.slot).fut.take();
        drop(fut);
    }
}

impl Drivable {
    /// Spawns `fut` as a task on the current runtime; the handle polls it from other tasks.
    pub(crate) fn spawn(fut: impl Future<Output = ()> + Send + 'static) -> Arc<Drivable> {
        let drivable = Arc::new(Drivable { slot: Mutex::new(Slot { fut: Some(Box::pin(fut)), waker: None }) });
        let task = DropsFuture(drivable.clone());
        tokio::spawn(std::future::poll_fn(move |cx| task.0.poll_as_task(cx)));
        drivable
    }

    fn poll_as_task(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut slot = crate::sync::lock(&self.slot);
        if !slot.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            slot.waker = Some(cx.waker().clone());
        }
        let Some(fut) = slot.fut.as_mut() else { return Poll::Ready(()) };
        if fut.as_mut().poll(cx).is_ready() {
            slot.fut = None;
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Wakes the future's own task, which polls it on its next turn.
    pub(crate) fn wake(&self) {
        if let Some(waker) = crate::sync::lock(&self.slot).waker.clone() {
            waker.wake();
        }
    }

    /// Polls the future once on the calling task, with its own task's waker; `true` if it was
    /// polled. Does nothing while its task polls it (on another thread), before its task first
    /// did, or once it has finished. Never waits.
    pub(crate) fn drive(&self) -> bool {
        self.drive_around(|poll| poll())
    }

    /// [`drive`](Self::drive), with the poll made by `around` (which may poll it, or not):
    /// under the future's lock, so nothing else polls it meanwhile.
    pub(crate) fn drive_around(&self, around: impl FnOnce(&mut dyn FnMut() -> Poll<()>) -> Poll<()>) -> bool {
        let Ok(mut slot) = self.slot.try_lock() else { return false };
        let Some(waker) = slot.waker.clone() else { return false };
        let Some(fut) = slot.fut.as_mut() else { return false };
        let mut poll = || super::eager_read::driven(|| fut.as_mut().poll(&mut Context::from_waker(&waker)));
        if around(&mut poll).is_ready() {
            slot.fut = None;
            drop(slot);
            // Its task finds it finished and ends.
            waker.wake();
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A future driven from another task makes progress there, and its own task still gets
    /// every wake-up it asked for: the task alone finishes it once nobody else polls.
    #[tokio::test]
    async fn a_driven_future_still_wakes_its_own_task() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
        let seen = Arc::new(AtomicUsize::new(0));
        let counted = seen.clone();
        let reader = Drivable::spawn(async move {
            while let Some(n) = rx.recv().await {
                counted.fetch_add(n as usize, Ordering::SeqCst);
            }
        });
        // The task polls it first (and registers its waker).
        tokio::task::yield_now().await;
        tx.send(1).unwrap();
        assert!(reader.drive(), "polled here");
        assert_eq!(seen.load(Ordering::SeqCst), 1, "read on this task, at once");
        // Nobody drives it now: its own task is woken by the channel and reads on.
        tx.send(2).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(30), async {
            while seen.load(Ordering::SeqCst) != 3 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the task itself read the second value");
        // Finished while driven here: the task ends too, and later drives do nothing.
        drop(tx);
        reader.drive();
        assert!(!reader.drive());
    }
}
