//! Join tokens from arbitrary text: parsing fails cleanly or round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nexar::JoinToken;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(token) = text.parse::<JoinToken>()
    {
        let again: JoinToken = token.to_string().parse().expect("a printed token parses");
        assert_eq!(again.to_string(), token.to_string());
    }
});
