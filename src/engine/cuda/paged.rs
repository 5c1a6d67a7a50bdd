//! The CUDA engine's paged KV cache as data: per layer a pool of blocks of
//! `BLOCK` positions on the device, their bookkeeping (`engine::blocks`),
//! the sequence slots, and the scratch attention gathers a sequence's keys
//! into. Kept in the engine across requests; `serve` drives it.

use super::seam::DBuf;
use super::storage::Storage;
use crate::engine::blocks::{Blocks, Table};

/// Positions per block.
pub const BLOCK: usize = 16;

/// The serving state: the pools, their bookkeeping, the sequence slots.
#[derive(Default)]
pub struct ServeState<T: Storage> {
    pub(super) k_pool: Vec<DBuf<T>>,
    pub(super) v_pool: Vec<DBuf<T>>,
    /// Blocks each pool holds.
    pub(super) cap: usize,
    pub(super) book: Blocks,
    pub(super) slots: Vec<Table>,
    /// Contiguous keys and values attention reads, and their room (positions).
    pub(super) scratch: Option<(DBuf<T>, DBuf<T>, usize)>,
}
