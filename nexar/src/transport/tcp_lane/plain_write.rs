//! Plaintext groups written straight from the caller's buffers (`NEXAR_BULK_ENCRYPTION=off`).
//!
//! A plaintext record is its length, the caller's bytes and a zero tag, so there is nothing to
//! compute: a group's records can go to the kernel as a gather list (`sendmsg`) pointing into
//! the caller's parts ([`PlainGroup::write_ready`]) instead of being copied into the writer's
//! buffers first; on these machines a user-space copy runs no faster than the kernel's own.
//! The wire bytes are exactly those the [`Sealer`](super::records::Sealer) frames without
//! encrypting (same records, same places). The lane
//! (`TcpLane::write_plain`) alternates buffer-sized pieces written straight away with pieces
//! copied for its writer ([`PlainGroup::copy_range`]), so the copies pace the writes as
//! sealing does.

use std::io::{self, IoSlice};
use std::net::TcpStream;

use super::records::{GroupHead, HEAD, HEADER, RECORD, Sealed, TAG};
use super::sealed::{Cut, NextRecord, Parts};

/// The tag of a plaintext record.
const ZERO_TAG: [u8; TAG] = [0; TAG];
/// Slices one `sendmsg` is given at most (the kernel's `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// One record of a group: its length word and where its body lies.
struct Record {
    len: [u8; HEADER],
    /// Range of the record's body slices in [`PlainGroup::bodies`].
    bodies: std::ops::Range<usize>,
}

/// A group's plaintext records, as slices of the caller's parts.
pub(super) struct PlainGroup<'p> {
    head: [u8; HEAD],
    records: Vec<Record>,
    bodies: Vec<&'p [u8]>,
}

impl<'p> PlainGroup<'p> {
    /// The records of the group `parts` (whose largest part starts at `lead`), cut as the
    /// sealer cuts them ([`Parts::next_record`]).
    pub fn new(parts: &[&'p [u8]], lead: u64) -> PlainGroup<'p> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let mut group = PlainGroup {
            head: GroupHead { len: len as u64, lead }.encode(),
            records: Vec::with_capacity(len / RECORD + 2),
            bodies: Vec::with_capacity(len / RECORD + parts.len() + 1),
        };
        let mut parts = Parts { parts, part: 0, offset: 0 };
        let mut left = len;
        while left > 0 {
            let start = group.bodies.len();
            let n = match parts.next_record(left.min(RECORD), Cut::of(left == len)) {
                NextRecord::Direct(here) => {
                    group.bodies.push(here);
                    here.len()
                }
                NextRecord::Gathered(n) => {
                    parts.take(n, |slice| group.bodies.push(slice));
                    n
                }
            };
            group.records.push(Record { len: (n as u32).to_le_bytes(), bodies: start..group.bodies.len() });
            left -= n;
        }
        group
    }

    /// The group's wire bytes, in order, as slices.
    fn slices(&self) -> impl Iterator<Item = &[u8]> {
        [&HEAD_LEN[..], &self.head[..], &ZERO_TAG[..]].into_iter().chain(self.records.iter().flat_map(move |r| {
            std::iter::once(&r.len[..])
                .chain(self.bodies[r.bodies.clone()].iter().copied())
                .chain(std::iter::once(&ZERO_TAG[..]))
        }))
    }

    /// Bytes on the wire.
    pub fn wire_len(&self) -> usize {
        HEADER
            + HEAD
            + TAG
            + self.records.iter().map(|r| HEADER + u32::from_le_bytes(r.len) as usize + TAG).sum::<usize>()
    }

    /// Writes as much of the group's bytes `from..to` as `socket` takes without waiting; the
    /// bytes written.
    pub fn write_ready(&self, socket: &TcpStream, from: usize, to: usize) -> io::Result<usize> {
        use rustix::net::{SendAncillaryBuffer, SendFlags};
        let to = to.min(self.wire_len());
        let mut at = from;
        while at < to {
            let mut batch: Vec<IoSlice<'_>> =
                Vec::with_capacity(IOV_MAX.min(self.bodies.len() + 2 * self.records.len() + 3));
            let mut left = to - at;
            for slice in self.slices_from(at) {
                if batch.len() == IOV_MAX || left == 0 {
                    break;
                }
                let take = slice.len().min(left);
                batch.push(IoSlice::new(&slice[..take]));
                left -= take;
            }
            let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
            match rustix::net::sendmsg(socket, &batch, &mut SendAncillaryBuffer::default(), flags) {
                Ok(0) => break,
                Ok(n) => at += n,
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(at - from)
    }

    /// The wire bytes from byte `from` on, as slices (the first cut where `from` falls).
    fn slices_from(&self, from: usize) -> impl Iterator<Item = &[u8]> {
        let mut skip = from;
        self.slices().filter_map(move |slice| {
            if skip >= slice.len() {
                skip -= slice.len();
                return None;
            }
            let rest = &slice[skip..];
            skip = 0;
            Some(rest)
        })
    }

    /// Wire bytes `from..to`, copied into `out` (whose old contents are dropped).
    pub fn copy_range(&self, from: usize, to: usize, mut out: Vec<u8>) -> Sealed {
        out.clear();
        let mut left = to.saturating_sub(from);
        // One allocation, not a doubling series (a buffer new from the pool is empty).
        out.reserve(left);
        for slice in self.slices_from(from) {
            if left == 0 {
                break;
            }
            let take = slice.len().min(left);
            out.extend_from_slice(&slice[..take]);
            left -= take;
        }
        Sealed::from(out)
    }
}

/// The length word of a group's header record.
const HEAD_LEN: [u8; HEADER] = (HEAD as u32).to_le_bytes();

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::tcp_lane::records::{CHUNK, Sealer, lead_of};

    /// Layouts a collective sends: a message's frames and its payload, a plan's bucket of
    /// several buffers, small parts gathered, one byte, exact record multiples.
    fn layouts(payload: &[u8]) -> Vec<Vec<&[u8]>> {
        vec![
            vec![&b"frames"[..], payload],
            vec![&payload[..7], &payload[7..]],
            vec![&payload[..1]],
            vec![&payload[..RECORD]],
            vec![&payload[..100], &payload[100..200], &payload[200..20_000], &payload[20_000..]],
            (0..40).map(|i| &payload[i * 1000..(i + 1) * 1000]).collect(),
            // A bucket of long buffers: records run across them.
            std::iter::once(&b"frames"[..]).chain((0..12).map(|i| &payload[i * 40_000..(i + 1) * 40_000])).collect(),
        ]
    }

    /// The wire bytes from `from` on, copied in buffers of at most [`CHUNK`] bytes as the
    /// lane copies what it does not write straight away.
    fn copy_rest(group: &PlainGroup<'_>, from: usize, mut emit: impl FnMut(Sealed, bool)) {
        let total = group.wire_len();
        let mut at = from;
        while at < total {
            let end = (at + CHUNK).min(total);
            emit(group.copy_range(at, end, vec![0xfd; 7]), end == total);
            at = end;
        }
    }

    /// What the sealer puts on the wire for `parts` without encrypting.
    fn sealed(parts: &[&[u8]]) -> Vec<u8> {
        let mut wire = Vec::new();
        Sealer::plain_for_tests()
            .seal_group(parts, Vec::new, |c, _| {
                wire.extend_from_slice(&c);
                true
            })
            .unwrap();
        wire
    }

    #[test]
    fn the_gather_list_is_what_the_sealer_writes_in_plaintext() {
        let payload: Vec<u8> = (0..2 * RECORD + 40_003).map(|i| (i % 251) as u8).collect();
        for parts in layouts(&payload) {
            let group = PlainGroup::new(&parts, lead_of(&parts) as u64);
            let wire: Vec<u8> = group.slices().flatten().copied().collect();
            assert_eq!(wire.len(), group.wire_len());
            assert_eq!(wire, sealed(&parts), "{} parts", parts.len());
            // The rest after any point is copied exactly, in buffers of at most CHUNK, the
            // last one flagged.
            for from in [0, 1, 37, wire.len() / 2, wire.len() - 1, wire.len()] {
                let (mut rest, mut lasts) = (Vec::new(), 0);
                copy_rest(&group, from, |c, last| {
                    assert!(c.len() <= CHUNK);
                    rest.extend_from_slice(&c);
                    lasts += usize::from(last);
                });
                assert_eq!(rest, wire[from..], "from {from}");
                assert_eq!(lasts, usize::from(from < wire.len()));
            }
        }
    }

    #[test]
    fn a_socket_that_takes_part_of_a_group_leaves_the_rest_to_copy() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut inbound, _) = listener.accept().unwrap();
        out.set_nonblocking(true).unwrap();
        let payload: Vec<u8> = (0..64 * RECORD).map(|i| (i % 253) as u8).collect();
        let parts = [&b"frames"[..], &payload[..]];
        let group = PlainGroup::new(&parts, lead_of(&parts) as u64);
        // Nobody reads yet: the socket takes what its buffers hold (a few MiB) and no more.
        let written = group.write_ready(&out, 0, usize::MAX).unwrap();
        assert!(written > 0, "the socket took nothing");
        let mut rest = Vec::new();
        copy_rest(&group, written, |c, _| rest.extend_from_slice(&c));
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            std::io::Read::read_to_end(&mut inbound, &mut got).unwrap();
            got
        });
        out.set_nonblocking(false).unwrap();
        std::io::Write::write_all(&mut &out, &rest).unwrap();
        out.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(reader.join().unwrap(), sealed(&parts));
    }
}
