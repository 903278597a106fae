//! Relay envelope bodies from arbitrary bytes: unpacking validates everything and never
//! panics; whatever unpacks packs back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nexar::proto::relay::{pack, unpack};

fuzz_target!(|data: &[u8]| {
    if let Ok((msg, range)) = unpack(data, 1 << 20) {
        let payload = nexar::__private::Bytes::copy_from_slice(&data[range]);
        let again = pack(&msg, Some(payload)).expect("an unpacked message packs").concat();
        let (back, _) = unpack(&again, 1 << 20).expect("a packed message unpacks");
        assert_eq!(back, msg);
    }
});
