// The guide's chapters are markdown files beside this one, each the documentation of an empty
// module, so that `cargo test --doc` compiles and runs their examples, and docs.rs shows them.
#![doc = include_str!("index.md")]

#[doc = include_str!("getting_started.md")]
pub mod getting_started {}

#[doc = include_str!("configuration.md")]
pub mod configuration {}

#[doc = include_str!("attribute.md")]
pub mod attribute {}

#[doc = include_str!("long_sections.md")]
pub mod long_sections {}

#[doc = include_str!("shared_locks.md")]
pub mod shared_locks {}

#[doc = include_str!("waiting.md")]
pub mod waiting {}

#[doc = include_str!("by_hand.md")]
pub mod by_hand {}

#[doc = include_str!("sets.md")]
pub mod sets {}

#[doc = include_str!("elections.md")]
pub mod elections {}

#[doc = include_str!("guarantees.md")]
pub mod guarantees {}

#[doc = include_str!("topologies.md")]
pub mod topologies {}

#[doc = include_str!("server_setup.md")]
pub mod server_setup {}

#[doc = include_str!("observability.md")]
pub mod observability {}

#[doc = include_str!("cli.md")]
pub mod cli {}

#[doc = include_str!("testing.md")]
pub mod testing {}

#[doc = include_str!("data_model.md")]
pub mod data_model {}

#[doc = include_str!("benchmarks.md")]
pub mod benchmarks {}

#[doc = include_str!("scale.md")]
pub mod scale {}

#[doc = include_str!("how_it_is_tested.md")]
pub mod how_it_is_tested {}

#[doc = include_str!("layout.md")]
pub mod layout {}
