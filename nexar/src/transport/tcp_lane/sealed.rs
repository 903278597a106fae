//! The buffers a lane's sealer fills and its writer sends: [`Chunk`], a buffer being filled
//! with records, [`Sealed`], its records ready for the wire, and [`Parts`], the read position
//! in a group's parts that sealing walks. Buffers are reused from group to group, so none is
//! zeroed again.

use super::records::{CHUNK, DIRECT_MIN, HEADER, RECORD, TAG};

/// The most bytes one buffer holds: it is handed on once it reaches [`CHUNK`], so it takes at
/// most one more record, besides the group's header record.
const CHUNK_CAPACITY: usize = CHUNK + 2 * (HEADER + TAG) + RECORD + 8;

/// A buffer being filled with records. `buf[..used]` is sealed output; bytes past `used` are
/// left from the buffer's last use and are overwritten before they are sent, so a reused
/// buffer is not zeroed again.
pub(super) struct Chunk {
    pub buf: Vec<u8>,
    pub used: usize,
}

impl Chunk {
    /// `buf` (a buffer back from the wire, or a new one) to fill from its start.
    pub fn new(mut buf: Vec<u8>) -> Chunk {
        buf.reserve(CHUNK_CAPACITY.saturating_sub(buf.len()));
        Chunk { buf, used: 0 }
    }

    /// The next record's header, body and tag, `len` bytes of body, for the caller to fill.
    pub fn record(&mut self, len: usize) -> (&mut [u8], &mut [u8], &mut [u8]) {
        let (start, end) = (self.used, self.used + HEADER + len + TAG);
        if self.buf.len() < end {
            self.buf.resize(end, 0);
        }
        self.used = end;
        let (head, rest) = self.buf[start..end].split_at_mut(HEADER);
        let (body, tag) = rest.split_at_mut(len);
        (head, body, tag)
    }

    /// The records filled so far, for the wire.
    pub fn finish(self) -> Sealed {
        Sealed { buf: self.buf, start: 0, len: self.used }
    }
}

/// Sealed records ready for the wire: bytes `start..len` of a buffer (`start` moves on as a
/// first part is written). The buffer keeps its full length, so when it is reused no part of
/// it is zeroed again.
pub(crate) struct Sealed {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl Sealed {
    /// Drops the first `n` bytes (written already).
    pub fn advance(&mut self, n: usize) {
        self.start = (self.start + n).min(self.len);
    }

    /// The buffer, for sealing into again.
    pub fn into_buffer(self) -> Vec<u8> {
        self.buf
    }

    /// The sealed bytes, to alter (a hostile member's lane).
    #[cfg(feature = "hostile-member")]
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.len]
    }
}

impl From<Vec<u8>> for Sealed {
    fn from(buf: Vec<u8>) -> Sealed {
        Sealed { start: 0, len: buf.len(), buf }
    }
}

impl std::ops::Deref for Sealed {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf[self.start..self.len]
    }
}

/// A read position in a group's parts.
pub(super) struct Parts<'p, 'b> {
    pub parts: &'p [&'b [u8]],
    pub part: usize,
    pub offset: usize,
}

impl<'b> Parts<'_, 'b> {
    /// What is left of the current part (empty at the end).
    pub fn current(&mut self) -> &'b [u8] {
        while self.part < self.parts.len() && self.offset == self.parts[self.part].len() {
            (self.part, self.offset) = (self.part + 1, 0);
        }
        self.parts.get(self.part).map_or(&[], |p| &p[self.offset..])
    }

    /// How many of the next bytes (at most `max`) lie in small parts: a gathered record stops
    /// where a part of [`DIRECT_MIN`] bytes or more starts, so that part's bytes are sealed
    /// where they lie. Across parts ([`Cut::Across`]) it stops only at `max` or the end.
    pub fn small_run(&mut self, max: usize, cut: Cut) -> usize {
        let mut run = self.current().len().min(max);
        for part in &self.parts[self.part + 1..] {
            if run == max || cut == Cut::AtLongParts && part.len() >= DIRECT_MIN {
                break;
            }
            run += part.len().min(max - run);
        }
        run
    }

    /// Where the group's next record of at most `max` bytes comes from: the current part's
    /// own bytes where it holds `max` of them, or, cutting at long parts, where it is long
    /// ([`DIRECT_MIN`]), so that a large part's records end where it ends; else a run of
    /// parts to gather.
    pub fn next_record(&mut self, max: usize, cut: Cut) -> NextRecord<'b> {
        let here = self.current();
        if here.len() >= max || cut == Cut::AtLongParts && here.len() >= DIRECT_MIN {
            let n = max.min(here.len());
            self.offset += n;
            NextRecord::Direct(&here[..n])
        } else {
            NextRecord::Gathered(self.small_run(max, cut))
        }
    }

    /// Hands the next `n` bytes to `each`, a slice of a part at a time, and steps past them.
    pub fn take(&mut self, n: usize, mut each: impl FnMut(&'b [u8])) {
        let mut taken = 0;
        while taken < n {
            let here = self.current();
            let take = here.len().min(n - taken);
            each(&here[..take]);
            (self.offset, taken) = (self.offset + take, taken + take);
        }
    }

    /// Copies the next `dst.len()` bytes into `dst`.
    pub fn copy_into(&mut self, dst: &mut [u8]) {
        let mut at = 0;
        self.take(dst.len(), |slice| {
            crate::transport::copy::copy_bytes(&mut dst[at..at + slice.len()], slice);
            at += slice.len();
        });
    }
}

/// Where a group's records end ([`Parts::next_record`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cut {
    /// A long part's records end where it ends: the group's first record, so that a
    /// message's frames come alone ahead of a long payload (the receiver reads no payload
    /// before it has admitted the message).
    AtLongParts,
    /// Records of the largest size run across parts, which costs fewer records, so fewer
    /// reads and AES-GCM calls on the receiver's side. A bucket of 100 buffers of 40 KB went
    /// in 40 KB records, five times the `recv` calls of one 4 MB buffer: in plaintext its
    /// allreduce took 10-20 % longer; sealed, a plan of that bucket took 30 % longer with
    /// ring's AES-GCM (which opens each record where it arrived, whatever its destination)
    /// and 4 % longer with aws-lc's (which opens a record that spans two buffers into a
    /// cached one first, but each record straight into its one buffer).
    Across,
}

impl Cut {
    /// How a group's records are cut: at long parts for its first record, across parts after
    /// that.
    pub fn of(first: bool) -> Cut {
        if first { Cut::AtLongParts } else { Cut::Across }
    }
}

/// Where a group's next record comes from ([`Parts::next_record`]).
pub(super) enum NextRecord<'b> {
    /// Bytes of one part, where they lie (stepped past already).
    Direct(&'b [u8]),
    /// The next this many bytes, from small parts to gather ([`Parts::take`]).
    Gathered(usize),
}
