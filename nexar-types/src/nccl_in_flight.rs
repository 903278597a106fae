//! An NCCL operation on its way, from enqueue until the device says it is done: polled
//! without blocking, and stopped (the communicator aborted, the stream waited for) when it
//! is dropped early, so nothing writes into the borrowed buffer afterwards.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream};

use crate::buf::DeviceError;
use crate::cuda::driver;
use crate::nccl::NcclComm;

/// An NCCL operation on its way: [`poll`](Self::poll) it until it says done. It borrows the
/// operand; dropping it before the operation is done aborts the communicator and waits for
/// the stream, so nothing writes into the buffer afterwards.
pub struct NcclInFlight<'a> {
    comm: &'a NcclComm,
    stream: Arc<CudaStream>,
    pending: bool,
    done: CudaEvent,
    what: &'static str,
    _buf: PhantomData<&'a mut ()>,
}

impl fmt::Debug for NcclInFlight<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclInFlight").field("what", &self.what).field("comm", self.comm).finish()
    }
}

impl<'a> NcclInFlight<'a> {
    /// An operation of `comm` enqueued on `stream`, done once `done` has completed.
    pub(crate) fn new(comm: &'a NcclComm, stream: Arc<CudaStream>, done: CudaEvent, what: &'static str) -> Self {
        NcclInFlight { comm, stream, pending: true, done, what, _buf: PhantomData }
    }

    /// `Ok(true)` once the operation has completed on the device; an error if the device or
    /// the communicator failed (the communicator is then aborted).
    pub fn poll(&mut self) -> Result<bool, DeviceError> {
        if !self.pending {
            return Ok(true);
        }
        match self.done.try_is_complete() {
            Ok(true) => {
                self.pending = false;
                Ok(true)
            }
            Ok(false) => match self.comm.async_error() {
                Ok(()) => Ok(false),
                Err(e) => {
                    self.stop();
                    Err(e)
                }
            },
            Err(e) => {
                self.stop();
                Err(driver(self.what, self.comm.device())(e))
            }
        }
    }

    /// Aborts the communicator and waits until the buffer's stream has stopped.
    fn stop(&mut self) {
        if std::mem::take(&mut self.pending) {
            self.comm.abort();
            let _ = self.stream.synchronize();
        }
    }
}

impl Drop for NcclInFlight<'_> {
    fn drop(&mut self) {
        if self.pending && !matches!(self.done.try_is_complete(), Ok(true)) {
            self.stop();
        }
    }
}
