//! `impl Trait` in arguments and inside the return type, and patterns in parameters.
use std::fmt::Display;

use distlock::{LockError, LockManager, distributed_lock};

#[distributed_lock(key = "show:{name}", manager = locks)]
pub async fn show(locks: &LockManager, name: impl Display) -> Result<impl Display, LockError> {
    Ok(format!("<{name}>"))
}

#[distributed_lock(key = "pair:{a}:{b}", manager = locks)]
pub async fn pair(locks: &LockManager, (a, b): (u32, u32)) -> Result<Vec<impl Display>, LockError> {
    Ok(vec![a + b])
}

pub struct Point {
    pub x: i64,
    pub y: i64,
}

#[distributed_lock(key = "point:{x}:{y}", manager = locks)]
pub async fn point(locks: &LockManager, Point { x, y }: Point) -> Result<i64, LockError> {
    Ok(x * y)
}

fn main() {}
