//! Tests of the lane's record protection: sealing, opening, records left sealed, key
//! changes and refused alterations.

use super::*;
use crate::config::LaneAes;
use crate::transport::tcp_lane::payload_records::Forged;

/// Both ends of a session export the same material; a fake one derives it from the context.
struct Fake(u8);

impl Exporter for Fake {
    fn export(&self, out: &mut [u8], context: &[u8]) -> Result<(), rustls::Error> {
        let mixed = context.iter().fold(17u8, |h, c| h.wrapping_mul(31).wrapping_add(*c));
        for (i, b) in out.iter_mut().enumerate() {
            *b = self.0 ^ mixed ^ i as u8;
        }
        Ok(())
    }
}

/// A sealer and an opener of one direction's records; the sealer uses ring's AES-GCM and
/// the opener aws-lc's, as two ranks whose CPUs differ may (the records are the same).
fn pair(limit: u64) -> (Sealer, Opener) {
    pair_of(limit, LaneAead::AesGcm(LaneAes::Ring), LaneAead::AesGcm(LaneAes::AwsLc))
}

/// A sealer with `seal` and an opener with `open` of one direction's records.
fn pair_of(limit: u64, seal: LaneAead, open: LaneAead) -> (Sealer, Opener) {
    let keys = |session: Session, engine| Keys::new(session, Direction::FromDialler, engine, limit).unwrap();
    let sealer = Sealer { keys: Protection::Aead(keys(Arc::new(Fake(7)), seal)) };
    let opener = Opener { keys: Protection::Aead(keys(Arc::new(Fake(7)), open)) };
    (sealer, opener)
}

/// One group as the lane reads it (records from the lead part on left sealed), then with
/// those records opened as a reader of the payload opens them.
fn receive(opener: &mut Opener, wire: &mut &[u8]) -> io::Result<Option<Vec<u8>>> {
    match opener.read_group_head(wire)? {
        None => Ok(None),
        Some(GroupHead { len: GOODBYE, .. }) => Ok(None),
        Some(GroupHead { len, lead }) => {
            let mut buf = vec![0u8; len as usize + TAG];
            let mut deferred = Vec::new();
            opener.read_group(wire, &mut buf, lead as usize, &mut deferred)?;
            buf.truncate(len as usize);
            for d in deferred {
                assert!(d.at >= lead as usize && d.len >= DEFER_MIN);
                let mut plain = vec![0u8; d.len];
                let Kept::Sealed(sealed) = &d.kept else { continue };
                sealed.open_into(&buf[d.at..d.at + d.len], &mut plain).map_err(|_| crypto_err("forged"))?;
                buf[d.at..d.at + d.len].copy_from_slice(&plain);
            }
            Ok(Some(buf))
        }
    }
}

/// The lane's one connection carries records both ways: what one side seals opens only with
/// the keys of its own direction, so neither end can be made to accept its own records back
/// (nor do both ends ever use one nonce under one key).
#[test]
fn each_direction_has_keys_of_its_own() {
    let session: Session = Arc::new(Fake(7));
    let group = |direction: Direction| {
        let mut sealer = Sealer::new(&session, direction, Some(LaneAead::AesGcm(LaneAes::AwsLc))).unwrap();
        let mut wire = Vec::new();
        sealer
            .seal_group(&[b"a group's bytes"], Vec::new, |c, _| {
                wire.extend_from_slice(&c);
                true
            })
            .unwrap();
        wire
    };
    for direction in [Direction::FromDialler, Direction::FromAnswerer] {
        let wire = group(direction);
        let mut own = Opener::new(&session, direction, Some(LaneAead::AesGcm(LaneAes::Ring))).unwrap();
        assert_eq!(receive(&mut own, &mut &wire[..]).unwrap().unwrap(), b"a group's bytes");
        let mut reverse = Opener::new(&session, direction.reverse(), Some(LaneAead::AesGcm(LaneAes::Auto))).unwrap();
        assert!(receive(&mut reverse, &mut &wire[..]).is_err(), "{direction:?} opened with the other way's keys");
    }
    assert_ne!(group(Direction::FromDialler), group(Direction::FromAnswerer));
}

#[test]
fn records_left_sealed_open_only_unaltered_and_at_their_place() {
    // aws-lc's AES-GCM and AEGIS open out of place: both leave the payload's records sealed.
    let aegis = LaneAead::Aegis128X2;
    for (mut sealer, mut opener) in [pair(KEY_LIMIT), pair_of(KEY_LIMIT, aegis, aegis)] {
        let payload: Vec<u8> = (0..RECORD + DEFER_MIN).map(|i| (i % 241) as u8).collect();
        let wire = sealed_group(&mut sealer, &[b"frames", &payload]);
        let mut r = &wire[..];
        let GroupHead { len, lead } = opener.read_group_head(&mut r).unwrap().unwrap();
        assert_eq!(lead, 6, "the payload leads");
        let mut buf = vec![0u8; len as usize + TAG];
        let mut deferred = Vec::new();
        opener.read_group(&mut r, &mut buf, lead as usize, &mut deferred).unwrap();
        assert_eq!(&buf[..6], b"frames", "the frames' record was opened");
        let places: Vec<(usize, usize)> = deferred.iter().map(|d| (d.at, d.len)).collect();
        assert_eq!(places, [(6, RECORD), (6 + RECORD, DEFER_MIN)]);
        let d = &deferred[1];
        let Kept::Sealed(sealed) = &d.kept else { panic!("aws-lc and AEGIS leave records sealed") };
        let mut plain = vec![0u8; d.len];
        sealed.open_into(&buf[d.at..d.at + d.len], &mut plain).unwrap();
        assert_eq!(plain, payload[RECORD..]);
        // Altered ciphertext, or another record's bytes, fail to open.
        let mut altered = buf[d.at..d.at + d.len].to_vec();
        altered[100] ^= 1;
        assert_eq!(sealed.open_into(&altered, &mut plain), Err(Forged));
        let Kept::Sealed(first) = &deferred[0].kept else { panic!("left sealed") };
        assert_eq!(first.open_into(&buf[d.at..d.at + d.len], &mut plain), Err(Forged));
    }
}

/// ring opens in place only: the records aws-lc would leave sealed it opens where they land,
/// listing them as opened, so the group's frames must still lie before the first.
#[test]
fn an_opener_that_works_in_place_opens_the_payload_as_it_arrives() {
    let (mut sealer, _) = pair(KEY_LIMIT);
    let keys =
        Keys::new(Arc::new(Fake(7)), Direction::FromDialler, LaneAead::AesGcm(LaneAes::Ring), KEY_LIMIT).unwrap();
    let mut opener = Opener { keys: Protection::Aead(keys) };
    let payload: Vec<u8> = (0..RECORD + DEFER_MIN).map(|i| (i % 239) as u8).collect();
    let wire = sealed_group(&mut sealer, &[b"frames", &payload]);
    let mut r = &wire[..];
    let GroupHead { len, lead } = opener.read_group_head(&mut r).unwrap().unwrap();
    let mut buf = vec![0u8; len as usize + TAG];
    let mut deferred = Vec::new();
    opener.read_group(&mut r, &mut buf, lead as usize, &mut deferred).unwrap();
    let places: Vec<(usize, usize, bool)> =
        deferred.iter().map(|d| (d.at, d.len, matches!(d.kept, Kept::Opened))).collect();
    assert_eq!(places, [(6, RECORD, true), (6 + RECORD, DEFER_MIN, true)]);
    assert_eq!(&buf[..6], b"frames");
    assert!(buf[6..6 + payload.len()] == payload[..], "opened where it landed");
    // A payload is its plaintext, in one piece.
    let group = bytes::Bytes::from(buf[..len as usize].to_vec());
    let read = crate::transport::framed::Payload::from_group(&group, 6..len as usize, &deferred).unwrap();
    assert!(read.to_vec().unwrap() == payload);

    // An altered record fails as it arrives: it is zeroed and listed as forged, the records
    // after it still open (the lane carries on), and whoever reads the payload fails.
    let mut altered = wire.clone();
    altered[wire.len() - DEFER_MIN - TAG - HEADER - 100] ^= 1;
    let keys =
        Keys::new(Arc::new(Fake(7)), Direction::FromDialler, LaneAead::AesGcm(LaneAes::Ring), KEY_LIMIT).unwrap();
    let mut opener = Opener { keys: Protection::Aead(keys) };
    let mut r = &altered[..];
    opener.read_group_head(&mut r).unwrap().unwrap();
    let mut deferred = Vec::new();
    opener.read_group(&mut r, &mut buf, lead as usize, &mut deferred).unwrap();
    let kept: Vec<bool> = deferred.iter().map(|d| matches!(d.kept, Kept::Forged)).collect();
    assert_eq!(kept, [true, false], "the first payload record was altered");
    assert!(buf[6..6 + RECORD].iter().all(|&b| b == 0), "a forged record is zeros");
    assert!(buf[6 + RECORD..6 + payload.len()] == payload[RECORD..], "the next record opened");
    let group = bytes::Bytes::from(buf[..len as usize].to_vec());
    let read = crate::transport::framed::Payload::from_group(&group, 6..len as usize, &deferred).unwrap();
    assert!(read.to_vec().is_err(), "reading a forged record fails");
    let mut out = vec![7u8; payload.len()];
    assert!(read.copy_to(&mut out).is_err());
    assert!(out[..RECORD].iter().all(|&b| b == 0), "and leaves zeros where it goes");
}

#[test]
fn plain_records_carry_groups_as_they_are_and_leave_nothing_sealed() {
    let (mut sealer, mut opener) = (Sealer { keys: Protection::Plain }, Opener { keys: Protection::Plain });
    let payload: Vec<u8> = (0..2 * RECORD + DEFER_MIN + 3).map(|i| (i % 251) as u8).collect();
    for parts in [vec![&b"frames"[..], &payload[..]], vec![&payload[..7], &payload[7..]], vec![&payload[..1]]] {
        let mut wire = Vec::new();
        // Reused buffers with old bytes in them: nothing of them may reach the wire.
        sealer
            .seal_group(
                &parts,
                || vec![0xfd; 4 * RECORD],
                |c, _| {
                    wire.extend_from_slice(&c);
                    true
                },
            )
            .unwrap();
        let whole: Vec<u8> = parts.concat();
        // The largest part's first bytes travel as they are (it starts a record).
        let largest = parts.iter().max_by_key(|p| p.len()).unwrap();
        let probe = &largest[..largest.len().min(64)];
        assert!(wire.windows(probe.len()).any(|w| w == probe), "plaintext on the wire");
        assert!(!wire.contains(&0xfd), "stale buffer bytes on the wire"); // the payload is below 251
        let mut r = &wire[..];
        let GroupHead { len, lead } = opener.read_group_head(&mut r).unwrap().unwrap();
        let mut buf = vec![0u8; len as usize + TAG];
        let mut deferred = Vec::new();
        opener.read_group(&mut r, &mut buf, lead as usize, &mut deferred).unwrap();
        assert!(deferred.is_empty(), "plain records are never left sealed");
        assert_eq!(&buf[..len as usize], &whole[..]);
        assert!(r.is_empty());
    }
    // A record length past the group's end is still refused.
    let mut wire = Vec::new();
    sealer
        .seal_group(&[&payload[..100]], Vec::new, |c, _| {
            wire.extend_from_slice(&c);
            true
        })
        .unwrap();
    let mut r = &wire[..];
    opener.read_group_head(&mut r).unwrap().unwrap();
    let mut short = vec![0u8; 50 + TAG];
    assert!(opener.read_group(&mut r, &mut short, 0, &mut Vec::new()).is_err());
}

#[test]
fn payloads_with_sealed_records_read_back_exactly_and_refuse_altered_bytes() {
    use crate::transport::framed::{BlockError, Payload, PayloadError};
    let (mut sealer, mut opener) = pair(3 * RECORD as u64);
    let frames = [7u8; 21];
    let values: Vec<u32> = (0..(2 * RECORD + 3 * DEFER_MIN) as u32 / 4 + 5).collect();
    let payload: &[u8] = bytemuck::cast_slice(&values);
    for group_at in [0usize, 3] {
        let mut wire = Vec::new();
        sealer
            .seal_group(&[&frames, payload], Vec::new, |c, _| {
                wire.extend_from_slice(&c);
                true
            })
            .unwrap();
        let mut r = &wire[..];
        let GroupHead { len, lead } = opener.read_group_head(&mut r).unwrap().unwrap();
        // The group at an odd place: the payload is misaligned for the first pass.
        let mut buf = vec![0u8; group_at + len as usize + TAG];
        let mut deferred = Vec::new();
        opener.read_group(&mut r, &mut buf[group_at..], lead as usize, &mut deferred).unwrap();
        assert!(deferred.len() >= 3, "{} records left sealed", deferred.len());
        let group = bytes::Bytes::from(buf[group_at..group_at + len as usize].to_vec());
        let body = frames.len()..len as usize;
        let read = Payload::from_group(&group, body.clone(), &deferred).unwrap();
        assert_eq!(read.to_vec().unwrap(), payload);
        assert_eq!(read.to_chunks().unwrap().concat(), payload);
        let mut seen = Vec::new();
        read.for_each_block::<u32, ()>(|b| {
            seen.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, values);
        // Into several destinations: cut inside records (opened, then spread) and at
        // their edges (decrypted in place), with an empty one between.
        for cuts in [vec![1usize, 5000, 5000, RECORD + 3], vec![RECORD, RECORD + 1, 2 * RECORD - 4]] {
            let mut out = vec![0u8; payload.len()];
            let mut dsts: Vec<&mut [u8]> = Vec::new();
            let mut rest = &mut out[..];
            let mut at = 0;
            for cut in cuts {
                let (head, tail) = rest.split_at_mut(cut - at);
                dsts.push(head);
                (rest, at) = (tail, cut);
            }
            dsts.push(rest);
            read.copy_to_parts(&mut dsts).unwrap();
            assert_eq!(out, payload);
        }
        let mut short = [0u8; 4];
        assert!(matches!(read.copy_to_parts(&mut [&mut short]), Err(PayloadError::Length { dst: 4, .. })));
        // A sealed record outside the payload is refused.
        assert!(Payload::from_group(&group, body.start + 1..body.end, &deferred).is_err());
        assert!(Payload::from_group(&group, body.start..body.end - 1, &deferred).is_err());
        // Altered ciphertext is refused however it is read.
        let mut altered = group.to_vec();
        altered[deferred[1].at + 9] ^= 0x40;
        let altered = Payload::from_group(&bytes::Bytes::from(altered), body.clone(), &deferred).unwrap();
        assert!(matches!(altered.to_vec(), Err(PayloadError::Forged { len }) if len == deferred[1].len));
        let visited = altered.for_each_block::<u32, ()>(|_| Ok(()));
        assert!(matches!(visited, Err(BlockError::Payload(PayloadError::Forged { .. }))));
        assert!(altered.to_chunks().is_err());
        let mut whole = vec![0u8; payload.len()];
        let (x, y) = whole.split_at_mut(deferred[1].at - body.start + 7);
        assert!(matches!(altered.copy_to_parts(&mut [x, y]), Err(PayloadError::Forged { .. })));
        // Decrypted straight into the caller's buffer, the altered record leaves no byte
        // there but old values, authenticated bytes and zeros where it failed.
        const OLD: u8 = 0xA5;
        for parts in [1usize, 2] {
            let mut dst = vec![OLD; payload.len()];
            let failed = deferred[1].at - body.start..deferred[1].at - body.start + deferred[1].len;
            let copied = if parts == 1 {
                altered.copy_to(&mut dst)
            } else {
                let (x, y) = dst.split_at_mut(failed.start);
                altered.copy_to_parts(&mut [x, y])
            };
            assert!(matches!(copied, Err(PayloadError::Forged { .. })));
            assert!(dst[failed.clone()].iter().all(|&b| b == 0), "the failed record's bytes are cleared");
            for (i, &b) in dst.iter().enumerate().filter(|(i, _)| !failed.contains(i)) {
                assert!(b == OLD || b == payload[i], "byte {i}: {b:#x} is neither old nor the payload's");
            }
        }
    }
}

#[test]
fn frames_are_parsed_only_from_opened_records_whatever_the_senders_placement_hint() {
    use crate::proto::frame::{message_frame, raw_header};
    use crate::proto::message::encode;
    use crate::transport::bulk::decode_sealed_group;
    let payload = vec![9u8; 4 * DEFER_MIN];
    let len = payload.len() as u64 / 4; // f32 elements
    let msg = crate::transport::bulk::tests::coll(len);
    let (message, raw) = (message_frame(&encode(&msg).unwrap()), raw_header(payload.len() as u64));
    let (mut sealer, mut opener) = pair(1 << 30);
    let whole = [&message[..], &raw[..], &payload[..]].concat();
    // An honest sender's parts; then a hostile one's: one part, so its hint says that the
    // payload starts at byte 0 and the record holding the frames is left sealed.
    for (parts, hostile) in [(vec![&message[..], &raw[..], &payload[..]], false), (vec![&whole[..]], true)] {
        let wire = sealed_group(&mut sealer, &parts);
        let mut r = &wire[..];
        let head = opener.read_group_head(&mut r).unwrap().unwrap();
        let mut buf = vec![0u8; head.len as usize + TAG];
        let mut deferred = Vec::new();
        opener.read_group(&mut r, &mut buf, head.lead as usize, &mut deferred).unwrap();
        buf.truncate(head.len as usize);
        let decoded = decode_sealed_group(&bytes::Bytes::from(buf), &deferred, 1 << 30);
        if hostile {
            assert_eq!(deferred.first().map(|d| d.at), Some(0), "the frames were left sealed");
            let err = decoded.unwrap_err().to_string();
            assert!(err.contains("group ends inside a frame header at byte 0"), "{err}");
        } else {
            let (got, read) = decoded.unwrap();
            assert_eq!((got, read.to_vec().unwrap()), (msg.clone(), payload.clone()));
        }
    }
}

#[test]
fn groups_of_many_records_round_trip_across_key_changes() {
    // A key limit of two records' worth forces several key changes.
    let (mut sealer, mut opener) = pair(2 * RECORD as u64);
    let big: Vec<u8> = (0..RECORD * 3 + 17).map(|i| (i % 251) as u8).collect();
    let groups: Vec<Vec<&[u8]>> = vec![vec![b"head", &big[..]], vec![], vec![&big[..5], &big[5..RECORD + 9]]];
    let mut wire = Vec::new();
    for g in &groups {
        let mut chunks = Vec::new();
        assert!(
            sealer
                .seal_group(g, Vec::new, |c, _| {
                    chunks.push(c);
                    true
                })
                .unwrap()
        );
        assert!(chunks.iter().all(|c| c.len() <= CHUNK + RECORD + HEADER + TAG));
        wire.extend(chunks.iter().flat_map(|c| c.iter()));
    }
    sealer.seal_goodbye(&mut wire).unwrap();
    let mut r = &wire[..];
    for g in &groups {
        assert_eq!(receive(&mut opener, &mut r).unwrap().unwrap(), g.concat());
    }
    assert!(receive(&mut opener, &mut r).unwrap().is_none(), "goodbye");
    assert!(r.is_empty());
    let Protection::Aead(keys) = &opener.keys else { panic!("the lane encrypts") };
    assert!(keys.epoch >= 2, "the keys changed ({} epochs)", keys.epoch);
}

/// Reads one group off `wire` as the lane and the executor do: the head, the records (the
/// payload's left sealed), then the payload through [`Payload`]. `frames` bytes of frames
/// lead the group.
fn read_as_the_lane_does(wire: &[u8], frames: usize) -> Result<Vec<u8>, String> {
    use crate::transport::framed::Payload;
    let (_, mut opener) = pair(KEY_LIMIT);
    let mut r = wire;
    let head = opener.read_group_head(&mut r).map_err(|e| e.to_string())?;
    let Some(GroupHead { len, lead }) = head else { return Err("no group".into()) };
    if len > 4 * RECORD as u64 {
        return Err(format!("a {len}-byte group is over the limit"));
    }
    let mut buf = vec![0u8; len as usize + TAG];
    let mut deferred = Vec::new();
    opener.read_group(&mut r, &mut buf, lead as usize, &mut deferred).map_err(|e| e.to_string())?;
    let group = bytes::Bytes::from(buf[..len as usize].to_vec());
    let payload =
        Payload::from_group(&group, frames.min(len as usize)..len as usize, &deferred).map_err(|e| e.to_string())?;
    let mut out = group[..frames.min(len as usize)].to_vec();
    out.extend(payload.to_vec().map_err(|e| e.to_string())?);
    Ok(out)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    #[test]
    fn an_altered_byte_anywhere_is_refused_and_never_read_as_data(
        payload_len in 0usize..(2 * RECORD + 3 * DEFER_MIN),
        at in proptest::prelude::any::<proptest::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let frames = [9u8; 40];
        let payload: Vec<u8> = (0..payload_len).map(|i| (i * 13 % 251) as u8).collect();
        let (mut sealer, _) = pair(KEY_LIMIT);
        let mut wire = Vec::new();
        sealer
            .seal_group(&[&frames, &payload], Vec::new, |c, _| {
                wire.extend_from_slice(&c);
                true
            })
            .unwrap();
        let whole = [&frames[..], &payload].concat();
        proptest::prop_assert_eq!(read_as_the_lane_does(&wire, frames.len()), Ok(whole));
        let i = at.index(wire.len());
        wire[i] ^= flip;
        let read = read_as_the_lane_does(&wire, frames.len());
        proptest::prop_assert!(read.is_err(), "byte {} altered, yet the group read back", i);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
    #[test]
    fn any_parts_round_trip_through_dirty_buffers(
        lens in proptest::collection::vec(0usize..(3 * RECORD / 2), 0..6),
        junk in 0usize..(CHUNK + RECORD),
    ) {
        let data: Vec<u8> = (0..lens.iter().sum::<usize>()).map(|i| (i * 31 % 251) as u8).collect();
        let mut parts: Vec<&[u8]> = Vec::new();
        let mut at = 0;
        for len in &lens {
            parts.push(&data[at..at + len]);
            at += len;
        }
        let (mut sealer, mut opener) = pair(RECORD as u64 * 2);
        let mut wire = Vec::new();
        for _ in 0..2 {
            sealer
                .seal_group(&parts, || vec![0xAA; junk], |c, _| {
                    wire.extend_from_slice(&c);
                    true
                })
                .unwrap();
        }
        let mut r = &wire[..];
        for _ in 0..2 {
            proptest::prop_assert_eq!(receive(&mut opener, &mut r).unwrap().unwrap(), data.clone());
        }
        proptest::prop_assert!(r.is_empty());
    }
}

/// The plaintext lengths of the records of one group on `wire`, its header record first.
fn record_lengths(wire: &[u8]) -> Vec<usize> {
    let mut at = 0;
    let mut lengths = Vec::new();
    while at < wire.len() {
        let n = u32::from_le_bytes(wire[at..at + HEADER].try_into().unwrap()) as usize;
        lengths.push(n);
        at += HEADER + n + TAG;
    }
    assert_eq!(at, wire.len(), "records end with the wire");
    lengths
}

#[test]
fn records_run_across_a_buckets_buffers_sealed_or_not() {
    let piece: Vec<u8> = (0..40_000).map(|i| (i % 241) as u8).collect();
    let mut parts: Vec<&[u8]> = vec![b"frames"];
    parts.extend(std::iter::repeat_n(&piece[..], 10));
    // The frames alone, then records of the largest size across the buffers.
    let plain = || (Sealer { keys: Protection::Plain }, Opener { keys: Protection::Plain });
    for (mut sealer, mut opener) in [pair(KEY_LIMIT), plain()] {
        let wire = sealed_group(&mut sealer, &parts);
        assert_eq!(record_lengths(&wire), [HEAD, 6, RECORD, 400_000 - RECORD]);
        assert_eq!(receive(&mut opener, &mut &wire[..]).unwrap().unwrap(), parts.concat());
    }
}

#[test]
fn reused_buffers_and_mixed_parts_round_trip() {
    let (mut sealer, mut opener) = pair(KEY_LIMIT);
    let big: Vec<u8> = (0..RECORD * 2 + 3).map(|i| (i * 7 % 253) as u8).collect();
    let small: Vec<u8> = (0..DIRECT_MIN - 1).map(|i| (i % 13) as u8).collect();
    // Small parts between large ones, parts that end inside a record, empty parts.
    let group: Vec<&[u8]> =
        vec![b"h", &small, &[], &big[..DIRECT_MIN], &small[..10], &big, &small, b"tail", &big[..RECORD + 1]];
    // Buffers come back dirty and of any length, as the writer hands them back.
    let mut junk = 0u8;
    let mut dirty = || {
        junk = junk.wrapping_add(41);
        vec![junk; (junk as usize) * 4099]
    };
    let mut wire = Vec::new();
    for _ in 0..2 {
        sealer
            .seal_group(&group, &mut dirty, |c, _| {
                wire.extend_from_slice(&c);
                true
            })
            .unwrap();
    }
    let mut r = &wire[..];
    for _ in 0..2 {
        assert_eq!(receive(&mut opener, &mut r).unwrap().unwrap(), group.concat());
    }
    assert!(r.is_empty(), "{} bytes left over", r.len());
}

#[test]
fn tampering_reordering_and_bad_lengths_are_refused() {
    let (mut sealer, _) = pair(KEY_LIMIT);
    let mut wire = Vec::new();
    sealer
        .seal_group(&[b"payload bytes"], Vec::new, |c, _| {
            wire.extend_from_slice(&c);
            true
        })
        .unwrap();
    sealer
        .seal_group(&[b"second"], Vec::new, |c, _| {
            wire.extend_from_slice(&c);
            true
        })
        .unwrap();
    let first_len = sealed_len(13);
    // A flipped bit anywhere fails authentication (or the length checks).
    for i in [0, 5, HEADER + 3, first_len - 1] {
        let mut bad = wire.clone();
        bad[i] ^= 0x10;
        let (_, mut opener) = pair(KEY_LIMIT);
        assert!(receive(&mut opener, &mut &bad[..]).is_err(), "flip at {i}");
    }
    // The second group replayed first fails: the counter says where a record belongs.
    let (_, mut opener) = pair(KEY_LIMIT);
    assert!(receive(&mut opener, &mut &wire[first_len..]).is_err());
    // A record longer than what is left of its group is refused before it is read.
    let (mut sealer, mut opener) = pair(KEY_LIMIT);
    let mut wire = Vec::new();
    sealer.seal_record(&mut wire, &GroupHead { len: 4, lead: 0 }.encode()).unwrap();
    sealer.seal_record(&mut wire, b"too long").unwrap();
    let err = receive(&mut opener, &mut &wire[..]).unwrap_err();
    assert!(err.to_string().contains("8-byte record with 4 bytes"), "{err}");
    // A stream that ends inside a group is an error, not a goodbye.
    let (mut sealer, mut opener) = pair(KEY_LIMIT);
    let mut wire = Vec::new();
    sealer
        .seal_group(&[&[1u8; 100][..]], Vec::new, |c, _| {
            wire.extend_from_slice(&c);
            true
        })
        .unwrap();
    assert!(receive(&mut opener, &mut &wire[..wire.len() - 1]).is_err());
    assert!(receive(&mut pair(KEY_LIMIT).1, &mut &[][..]).unwrap().is_none());
}
