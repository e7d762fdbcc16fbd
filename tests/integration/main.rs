//! The integration tests, against real `redis-server` processes: one test binary, a module per
//! behaviour (`cargo test --test integration <module>::` runs one module's tests).
//!
//! The tests of every module run side by side in this one process. What is global to it:
//!
//! * the environment: no test sets a variable. One that needs an environment of its own runs a
//!   child of this binary with it (`env`, `fair`; see `support::test_name`);
//! * the manager `install()`ed for annotated functions without `manager = …`: only
//!   `attribute::the_installed_manager_is_the_default` installs one or calls such a function;
//! * the `metrics` recorder, installed by the `metrics` tests, which read only the metrics
//!   labelled with their own templates;
//! * the global `tracing` subscriber, installed by the `secrets` tests: it captures what every
//!   test logs, and no test logs their secrets. The other tests that read logs capture them on
//!   their own thread (`support::logs::Logs::capture_here`);
//! * the panic hook, which the `history` tests wrap to quiet their own planned panics only;
//! * the server of `support::shared_server()`: its users work under prefixes of their own
//!   (`support::unique_prefix`); a test that faults a server, reconfigures it or counts its
//!   commands starts its own.

#[path = "../support/mod.rs"]
mod support;

mod acl;
mod attribute;
mod cancellation;
mod cli;
mod cluster;
mod cohorts;
mod elections;
mod env;
mod eviction;
mod examples;
mod exclusive;
mod fair;
mod faults;
mod fencing;
mod handoff;
mod history;
mod kinds;
mod layout;
mod leases;
mod lifecycle;
mod liveness;
mod metrics;
mod migration;
mod nesting;
mod partitions;
mod redlock;
mod replication;
mod seams;
mod secrets;
mod sentinel;
mod sets;
mod shards;
mod shared;
mod spans;
mod tls;
mod topology_seams;
mod waiting;
