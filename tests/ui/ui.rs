//! Compile-time behaviour of `#[distributed_lock]`: the error (with its span) for every misuse.
//! Regenerate the expected output with `TRYBUILD=overwrite` and read the diff before committing
//! it. What it accepts, `pass/*.rs`, are test targets of this package (see its Cargo.toml):
//! they pass by compiling.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("fail/*.rs");
}
