//! Compile-time behaviour of `#[distributed_lock]`: what it accepts, and the error (with its
//! span) for every misuse. Regenerate the expected output with `TRYBUILD=overwrite` and read
//! the diff before committing it.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("pass/*.rs");
    cases.compile_fail("fail/*.rs");
}
