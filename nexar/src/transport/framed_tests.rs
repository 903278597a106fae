//! Tests of [`super`]: payloads copied, checked and visited.

use super::*;

#[test]
fn a_payload_partly_received_into_a_buffer_is_read_only_into_that_one() {
    let mut dst = vec![0u8; 10];
    dst[..4].copy_from_slice(b"abcd");
    let landed = Landed { at: dst.as_ptr() as usize, bytes: 4, forged: None };
    let payload = Payload::from_landed(landed, Payload::from_bytes(Bytes::from_static(b"efghij")));
    assert_eq!(payload.len(), 10);
    payload.copy_to(&mut dst).unwrap();
    assert_eq!(&dst, b"abcdefghij");
    // Anywhere else its first bytes are missing: an error, never a copy without them.
    let elsewhere = PayloadError::Elsewhere { bytes: 4 };
    assert_eq!(payload.to_vec(), Err(elsewhere.clone()));
    assert_eq!(payload.copy_to_parts(&mut [&mut [0u8; 10][..]]), Err(elsewhere.clone()));
    assert_eq!(payload.to_chunks(), Err(elsewhere));
    assert!(matches!(payload.for_each_block::<u8, ()>(|_| Ok(())), Err(BlockError::Payload(_))));
    // All of it landed: nothing left to copy.
    let whole = Payload::from_landed(Landed { at: dst.as_ptr() as usize, bytes: 10, forged: None }, Payload::default());
    whole.copy_to(&mut dst).unwrap();
    assert_eq!(&dst, b"abcdefghij");
    // A record that failed authentication where it landed fails the copy.
    let forged =
        Payload::from_landed(Landed { at: dst.as_ptr() as usize, bytes: 10, forged: Some(6) }, Payload::default());
    assert_eq!(forged.copy_to(&mut dst), Err(PayloadError::Forged { len: 6 }));
}

#[test]
fn a_payload_is_copied_into_parts_one_after_the_other() {
    use crate::transport::framed::Payload;
    use bytes::Bytes;
    let payload = Payload::from_bytes(Bytes::from_static(&[1, 2, 3, 4, 5]));
    let (mut a, mut b) = ([0u8; 2], [0u8; 3]);
    payload.copy_to_parts(&mut [&mut a, &mut b]).unwrap();
    assert_eq!((a, b), ([1, 2], [3, 4, 5]));
}

#[test]
fn a_payload_is_copied_checked_and_visited_by_block() {
    use crate::transport::framed::{BlockError, Payload, PayloadError};
    use bytes::Bytes;

    let payload = Payload::from_bytes(Bytes::from_static(&[1, 0, 2, 0]));
    assert_eq!(payload.to_vec().unwrap(), [1, 0, 2, 0]);
    assert_eq!(payload.copy_to(&mut [0u8; 3]), Err(PayloadError::Length { len: 4, dst: 3 }));
    let mut sum = 0u16;
    payload
        .for_each_block::<u16, ()>(|block| {
            sum += block.iter().sum::<u16>();
            Ok(())
        })
        .unwrap();
    assert_eq!(sum, 3);
    let stopped = payload.for_each_block::<u16, &str>(|_| Err("enough"));
    assert!(matches!(stopped, Err(BlockError::Visit("enough"))));
}

#[test]
fn blocks_cover_payloads_split_at_odd_chunk_boundaries() {
    let values: Vec<u32> = (0..5000).collect();
    let bytes: &[u8] = bytemuck::cast_slice(&values);
    // Chunks that split elements in the middle.
    let pieces = bytes.chunks(1001).map(|c| Piece::Plain(Bytes::copy_from_slice(c))).collect();
    let payload = Payload { len: bytes.len(), pieces, landed: None };
    let mut seen = Vec::new();
    payload
        .for_each_block::<u32, ()>(|b| {
            seen.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
    assert_eq!(seen, values);
    let mut copied = vec![0u8; bytes.len()];
    payload.copy_to(&mut copied).unwrap();
    assert_eq!(copied, bytes);
}

#[test]
fn aligned_runs_pass_unstaged_and_misaligned_ones_are_staged() {
    let values: Vec<u32> = (0..20_000).collect();
    let whole = Bytes::copy_from_slice(bytemuck::cast_slice(&values));
    // An aligned chunk, one that starts mid-element, one that starts misaligned by an
    // element's width, and a short tail.
    let cuts = [0, 24_000, 24_002, 50_001, 79_990, whole.len()];
    let pieces = cuts.windows(2).map(|w| Piece::Plain(whole.slice(w[0]..w[1]))).collect();
    let payload = Payload { len: whole.len(), pieces, landed: None };
    let (mut seen, mut direct) = (Vec::new(), 0);
    payload
        .for_each_block::<u32, ()>(|b| {
            if b.len() > STAGE_WORDS * 2 {
                direct += 1;
            }
            seen.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
    assert_eq!(seen, values);
    assert!(direct >= 1, "the aligned first chunk went unstaged");
}
