//! Compile-time checks of nexar's typed surface. Each `fail/*.rs` must fail to compile with
//! exactly the message in its `.stderr` snapshot; each `pass/*.rs` must compile.
//!
//! After an intended change to a message, regenerate with `TRYBUILD=overwrite cargo test -p
//! nexar-ui-tests` and review the new `.stderr` files.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/fail/*.rs");
    t.pass("tests/pass/*.rs");
}
