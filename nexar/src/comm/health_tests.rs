//! Tests of failure detection.

use super::*;

#[test]
fn long_reasons_are_cut_on_a_character_boundary() {
    assert_eq!(bounded("short".into()), "short");
    let long = "é".repeat(2000);
    let cut = bounded(long);
    assert!(cut.len() <= MAX_REASON + '…'.len_utf8());
    assert!(cut.ends_with('…'));
}
