//! Compile-time behaviour of `#[distributed_lock]`: what it accepts, and the error (with its
//! span) for every misuse. Regenerate the expected output with `TRYBUILD=overwrite` and read
//! the diff before committing it.

#[test]
fn ui() {
    // trybuild builds the cases in a project of its own, outside this workspace and its
    // profile: without debug info, as the workspace builds its dependencies, the build takes
    // a third less time and no diagnostic changes.
    // SAFETY: this is the only test of this binary, and nothing else runs yet.
    unsafe { std::env::set_var("CARGO_PROFILE_DEV_DEBUG", "false") };
    let cases = trybuild::TestCases::new();
    cases.pass("pass/*.rs");
    cases.compile_fail("fail/*.rs");
}
