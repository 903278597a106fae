//! The one place nexar maps memory: a sealed memfd segment shared with one peer process.
//!
//! Everything here treats the segment's bytes as written by an untrusted process at any
//! moment. Nothing hands out a Rust reference to its bytes: they are copied in and out with
//! bounds checked here, and the words both sides coordinate through are atomics. The segment's
//! size is sealed (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) before it is shared, and a
//! received one is refused unless it is sealed so: a peer cannot shrink it under the mapping
//! (which would make reads fault), nor grow it.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// The seals a shared segment must carry.
fn required_seals() -> SealFlags {
    SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL
}

/// A shared, read-write mapping of a whole sealed memfd segment.
pub(crate) struct SharedMap {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory; every access through `SharedMap` goes through
// atomics or bounds-checked raw copies, which are sound from any thread.
unsafe impl Send for SharedMap {}
// SAFETY: as above: `&SharedMap` only offers atomic loads/stores and copies by raw pointer.
unsafe impl Sync for SharedMap {}

impl std::fmt::Debug for SharedMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMap").field("len", &self.len).finish_non_exhaustive()
    }
}

impl SharedMap {
    /// A fresh zeroed segment of `len` bytes (a multiple of the page size), sealed at that
    /// size. Only this process holds it until its descriptor is passed on.
    pub fn create(name: &str, len: usize) -> io::Result<SharedMap> {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        rustix::fs::fcntl_add_seals(&fd, required_seals())?;
        SharedMap::map(fd, len)
    }

    /// Maps a segment a peer passed, after checking that it is exactly `len` bytes and sealed
    /// at that size.
    pub fn open(fd: OwnedFd, len: usize) -> io::Result<SharedMap> {
        let seals = rustix::fs::fcntl_get_seals(&fd)?;
        if !seals.contains(required_seals()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the shared segment is not sealed at its size (seals {seals:?})"),
            ));
        }
        let size = rustix::fs::fstat(&fd)?.st_size;
        if u64::try_from(size).ok() != Some(len as u64) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the shared segment has {size} bytes, expected {len}"),
            ));
        }
        SharedMap::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<SharedMap> {
        if len == 0 || !len.is_multiple_of(4096) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("a {len}-byte segment")));
        }
        // SAFETY: a new mapping at an address the kernel picks, of a descriptor we own whose
        // size is `len` and sealed so (checked by the callers); nothing else in this process
        // refers to that address range, and `Drop` unmaps exactly it. The pages are faulted
        // in as bytes first pass through them: a ring that carries little holds little.
        let ptr = unsafe {
            rustix::mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0)
        }?;
        Ok(SharedMap { ptr: ptr.cast(), len, fd })
    }

    /// The segment's descriptor, to pass to the peer.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The segment's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The 8-byte-aligned word at byte `offset`, as an atomic; `None` out of bounds or
    /// unaligned.
    pub fn word(&self, offset: usize) -> Option<&AtomicU64> {
        if !offset.is_multiple_of(8) || offset.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY: in bounds and 8-aligned (the mapping is page-aligned); the memory lives as
        // long as `self`. Another process may write the word at any time, which is what an
        // atomic allows: its value is untrusted, never its access.
        Some(unsafe { AtomicU64::from_ptr(self.ptr.add(offset).cast()) })
    }

    /// The 4-byte-aligned word at byte `offset`, as an atomic a futex can wait on; `None` out
    /// of bounds or unaligned.
    pub fn word32(&self, offset: usize) -> Option<&AtomicU32> {
        if !offset.is_multiple_of(4) || offset.checked_add(4)? > self.len {
            return None;
        }
        // SAFETY: in bounds and 4-aligned (the mapping is page-aligned); the memory lives as
        // long as `self`. Its value is untrusted, never its access (as for `word`).
        Some(unsafe { AtomicU32::from_ptr(self.ptr.add(offset).cast()) })
    }

    /// Copies `src` into the segment at `offset`; `false` (nothing copied) out of bounds.
    pub fn copy_in(&self, offset: usize, src: &[u8]) -> bool {
        if offset.checked_add(src.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: the destination range is inside the mapping (checked above) and cannot
        // overlap `src`, which is this process's own memory and not part of the mapping
        // (nothing hands out references into it). A peer writing the same bytes at the same
        // time only garbles bytes it could have garbled anyway.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
        true
    }

    /// Copies the segment's bytes at `offset` into `dst`; `false` (nothing copied) out of
    /// bounds. The bytes are whatever the peer wrote: the caller checks them.
    pub fn copy_out(&self, offset: usize, dst: &mut [u8]) -> bool {
        if offset.checked_add(dst.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: the source range is inside the mapping (checked above); `dst` is this
        // process's own exclusive memory, outside the mapping. The copy reads bytes another
        // process may be writing: they are plain bytes (every pattern is valid for `u8`), and
        // the caller validates them after the copy, never before.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        true
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: exactly the range `map` mapped; no reference into it outlives `self`
        // (`word` borrows `self`).
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_is_shared_sealed_and_bounds_checked() {
        let a = SharedMap::create("nexar-test", 8192).unwrap();
        let fd = a.fd().try_clone_to_owned().unwrap();
        let b = SharedMap::open(fd, 8192).unwrap();
        assert!(a.copy_in(4096, b"hello"));
        let mut got = [0u8; 5];
        assert!(b.copy_out(4096, &mut got));
        assert_eq!(&got, b"hello");
        a.word(64).unwrap().store(7, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(b.word(64).unwrap().load(std::sync::atomic::Ordering::SeqCst), 7);
        assert!(a.word(8190).is_none() && a.word(3).is_none());
        assert!(!a.copy_in(8190, b"abc") && !b.copy_out(usize::MAX, &mut got));
        // A segment of another size, or one left unsealed, is refused.
        let fd = a.fd().try_clone_to_owned().unwrap();
        assert!(SharedMap::open(fd, 4096).unwrap_err().to_string().contains("8192 bytes"));
        let loose = rustix::fs::memfd_create("loose", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&loose, 4096).unwrap();
        assert!(SharedMap::open(loose, 4096).unwrap_err().to_string().contains("not sealed"));
        // The size cannot change under the mapping.
        assert!(rustix::fs::ftruncate(a.fd(), 4096).is_err());
    }
}
