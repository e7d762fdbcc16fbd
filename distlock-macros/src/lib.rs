//! The `#[distributed_lock]` attribute of [distlock](https://docs.rs/distlock).
//!
//! Use it through the `distlock` crate, which re-exports it with the runtime it expands to.
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]

mod args;
mod check;
mod duration;
mod expand;
mod fallback;
mod key;

/// Runs an `async fn` while holding a distributed lock.
///
/// See the `distlock` crate for the full documentation of every argument.
#[proc_macro_attribute]
pub fn distributed_lock(
    args: proc_macro::TokenStream,
    item: proc_macro::TokenStream,
) -> proc_macro::TokenStream {
    expand::distributed_lock(args.into(), item.into()).into()
}
