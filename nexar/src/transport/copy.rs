//! A byte copy that stays fast whatever the two buffers' addresses.
//!
//! glibc copies more than a few KiB with `rep movsb` on CPUs that report fast short string
//! moves (FSRM). On AMD Zen 3 (the 2-core EPYC machines CI also draws) that instruction runs
//! about 20 times slower, 1.7–2.0 GB/s instead of 35–50, when the destination starts 1 to 31
//! bytes after the source modulo 4 KiB (a load then aliases a store just made; measured with
//! 4 KiB to 256 KiB copies, glibc 2.36). Which copies hit it depends on where allocations
//! happen to fall, so a run could be slow for no reason anyone can see. [`copy_bytes`] copies
//! such a pair 1 KiB at a time, which glibc does with vector loads and stores (30 GB/s here),
//! and every other pair in one call.

/// Copies of at most this many bytes never use `rep movsb` (glibc's threshold is 2 KiB or
/// more), so they are safe from the aliasing stall.
const PIECE: usize = 1 << 10;
/// How far, modulo 4 KiB, a destination may start after its source and stall `rep movsb`
/// (31 bytes measured; a cache line to be safe).
const STALL_WITHIN: usize = 64;

/// Copies `src` into `dst`, which must be as long (as [`slice::copy_from_slice`]).
///
/// ```ignore
/// let mut dst = [0u8; 8];
/// copy_bytes(&mut dst, b"nexar!!!");
/// ```
pub(crate) fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    if dst.len() > PIECE && stalls(dst.as_ptr() as usize, src.as_ptr() as usize) {
        assert_eq!(dst.len(), src.len(), "copy_bytes: destination and source lengths differ");
        for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
            d.copy_from_slice(s);
        }
    } else {
        dst.copy_from_slice(src);
    }
}

/// Whether a destination at `dst` starts 1 to [`STALL_WITHIN`]` - 1` bytes after a source
/// at `src`, modulo 4 KiB.
fn stalls(dst: usize, src: usize) -> bool {
    let ahead = dst.wrapping_sub(src) % 4096;
    ahead != 0 && ahead < STALL_WITHIN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_relative_placement_copies_every_byte() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 13 % 251) as u8).collect();
        let mut dst = vec![0u8; 24_000];
        for off in 0..80 {
            for len in [0, 1, 1023, 1024, 1025, 4096, 9_999] {
                dst.fill(0);
                copy_bytes(&mut dst[off..off + len], &src[3..3 + len]);
                assert!(dst[off..off + len] == src[3..3 + len], "offset {off}, {len} bytes");
                assert!(dst[..off].iter().chain(&dst[off + len..]).all(|&b| b == 0), "nothing outside");
            }
        }
    }

    #[test]
    fn only_a_destination_just_after_its_source_modulo_4_kib_is_copied_in_pieces() {
        assert!(stalls(0x1010, 0x0000));
        assert!(stalls(0x5004, 0x1000));
        assert!(!stalls(0x1000, 0x1000), "same offset");
        assert!(!stalls(0x1040, 0x1000), "a cache line or more ahead");
        assert!(!stalls(0x1000, 0x1010), "behind");
    }

    #[test]
    #[should_panic]
    fn lengths_that_differ_panic_as_copy_from_slice_does() {
        let src = vec![1u8; 5000];
        let mut dst = vec![0u8; 6000];
        copy_bytes(&mut dst[16..], &src[..]);
    }
}
