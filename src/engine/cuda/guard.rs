//! Guard regions around device outputs. Every activation buffer is allocated
//! with `GUARD` extra elements on each side, and the whole allocation is filled
//! with a sentinel NaN payload before the kernels run. When a stage is tapped,
//! its buffer is copied back whole (guards included, in the same one copy) and
//! checked: a guard element that changed is an out-of-bounds write, and an
//! interior element still holding the sentinel was never written. Both are
//! reported as engine errors naming the step and stage.
//!
//! Pure host-side arithmetic, so it is tested without a GPU.

use super::storage::Storage;

/// Elements of guard on each side of a buffer (256 bytes of f32: wider than
/// one warp's worth of a row-off-by-one write).
pub const GUARD: usize = 64;

/// The f32 sentinel: a signalling-NaN payload no kernel computes (arithmetic
/// yields the canonical quiet NaN 0x7fffffff), so finding it means "not
/// written". Each storage type has its own (`Storage::SENTINEL_BITS`).
pub const SENTINEL_BITS: u32 = <f32 as Storage>::SENTINEL_BITS;

/// Layout of one guarded buffer of `len` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Guarded {
    pub len: usize,
}

impl Guarded {
    /// Elements to allocate.
    pub fn total(self) -> usize {
        self.len + 2 * GUARD
    }
    /// Where the payload lives inside the allocation.
    pub fn interior(self) -> std::ops::Range<usize> {
        GUARD..GUARD + self.len
    }

    /// Checks a whole buffer copied back from the device.
    pub fn check<S: Storage>(self, full: &[S]) -> Result<(), GuardViolation> {
        assert_eq!(
            full.len(),
            self.total(),
            "guarded buffer copied back with the wrong length"
        );
        let bad = |i: usize| full[i].bits() != S::SENTINEL_BITS;
        if let Some(i) = (0..GUARD).rev().find(|&i| bad(i)) {
            return Err(GuardViolation::Before {
                offset: GUARD - i,
                bits: full[i].bits(),
                value: full[i].to_f32(),
            });
        }
        let end = GUARD + self.len;
        if let Some(i) = (end..self.total()).find(|&i| bad(i)) {
            return Err(GuardViolation::After {
                offset: i - end,
                bits: full[i].bits(),
                value: full[i].to_f32(),
            });
        }
        if let Some(i) = self.interior().find(|&i| !bad(i)) {
            return Err(GuardViolation::Unwritten { index: i - GUARD });
        }
        Ok(())
    }
}

/// What a guard check found.
#[derive(Clone, Debug, PartialEq)]
pub enum GuardViolation {
    /// Written `offset` elements before the start (1 = the element just before).
    Before { offset: usize, bits: u32, value: f32 },
    /// Written `offset` elements past the end (0 = the element just after).
    After { offset: usize, bits: u32, value: f32 },
    /// Element `index` of the output still holds the sentinel.
    Unwritten { index: usize },
}

impl std::fmt::Display for GuardViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GuardViolation::Before { offset, bits, value } => write!(
                f,
                "out-of-bounds write {offset} element(s) before the start of the output (guard now holds {value:e}, bits {bits:#x})"
            ),
            GuardViolation::After { offset, bits, value } => write!(
                f,
                "out-of-bounds write {} element(s) past the end of the output (guard now holds {value:e}, bits {bits:#x})",
                offset + 1
            ),
            GuardViolation::Unwritten { index } => {
                write!(f, "element {index} of the output was never written (still the guard sentinel)")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(len: usize) -> Vec<f32> {
        let g = Guarded { len };
        let mut v = vec![f32::from_bits(SENTINEL_BITS); g.total()];
        for (k, i) in g.interior().enumerate() {
            v[i] = k as f32;
        }
        v
    }

    #[test]
    fn sizes_and_interior() {
        let g = Guarded { len: 10 };
        assert_eq!(g.total(), 10 + 2 * GUARD);
        assert_eq!(g.interior(), GUARD..GUARD + 10);
        assert!(f32::from_bits(SENTINEL_BITS).is_nan());
        assert_ne!(SENTINEL_BITS, f32::NAN.to_bits());
    }

    #[test]
    fn clean_buffer_passes_even_when_empty() {
        assert_eq!(Guarded { len: 7 }.check(&filled(7)), Ok(()));
        assert_eq!(Guarded { len: 0 }.check(&filled(0)), Ok(()));
    }

    #[test]
    fn writes_outside_are_found_with_their_offset() {
        let g = Guarded { len: 5 };
        let mut v = filled(5);
        v[GUARD + 5] = 1.0; // one past the end
        assert_eq!(
            g.check(&v),
            Err(GuardViolation::After {
                offset: 0,
                bits: 1.0f32.to_bits(),
                value: 1.0
            })
        );
        assert!(g
            .check(&v)
            .unwrap_err()
            .to_string()
            .contains("1 element(s) past the end"));
        let mut v = filled(5);
        v[GUARD - 1] = 2.0; // one before the start
        assert_eq!(
            g.check(&v),
            Err(GuardViolation::Before {
                offset: 1,
                bits: 2.0f32.to_bits(),
                value: 2.0
            })
        );
        let mut v = filled(5);
        v[0] = 0.0; // far before: still found
        assert!(matches!(g.check(&v), Err(GuardViolation::Before { offset, .. }) if offset == GUARD));
    }

    #[test]
    fn unwritten_interior_is_found() {
        let g = Guarded { len: 5 };
        let mut v = filled(5);
        v[GUARD + 3] = f32::from_bits(SENTINEL_BITS);
        assert_eq!(g.check(&v), Err(GuardViolation::Unwritten { index: 3 }));
        // A computed NaN is a value, not a missing write (the finite check judges it).
        let mut v = filled(5);
        v[GUARD + 3] = f32::NAN;
        assert_eq!(g.check(&v), Ok(()));
    }

    #[test]
    fn sixteen_bit_buffers_are_checked_with_their_own_sentinel() {
        let g = Guarded { len: 3 };
        let sentinel = half::bf16::from_bits(<half::bf16 as Storage>::SENTINEL_BITS as u16);
        let mut v = vec![sentinel; g.total()];
        for i in g.interior() {
            v[i] = half::bf16::from_f32(0.5);
        }
        assert_eq!(g.check(&v), Ok(()));
        v[GUARD + 3] = half::bf16::from_f32(-3.0);
        let e = g.check(&v).unwrap_err();
        assert_eq!(
            e,
            GuardViolation::After {
                offset: 0,
                bits: 0xc040,
                value: -3.0
            }
        );
        assert!(e.to_string().contains("holds -3e0, bits 0xc040"), "{e}");
        v[GUARD + 3] = sentinel;
        v[GUARD + 1] = sentinel;
        assert_eq!(g.check(&v), Err(GuardViolation::Unwritten { index: 1 }));
    }
}
