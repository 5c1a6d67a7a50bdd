//! Stages an engine split over several GPUs answers per rank: a shard (the
//! rank's slice of the canonical tensor along one axis: its heads of q, its
//! columns of the FFN) or a partial sum (a row-parallel projection's share,
//! which an all-reduce completes). touchstone joins them before any check,
//! so every check reads the stage as one engine would have computed it; a
//! set of shards that does not tile the stage exactly is refused, naming the
//! rank.
//!
//! In a run file (`engine::output`): `<step>/<stage>@rank<R>:axis=<A>:offset=<O>`
//! for a shard, `<step>/<stage>@rank<R>:partial` for a partial sum. Partial
//! sums are added in rank order (rank 0 first), in f32, as a ring all-reduce
//! of two ranks does.

use crate::tensor::Tensor;

/// How a rank's tensor covers its stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Shard { axis: usize, offset: usize },
    Partial,
}

/// One rank's tensor of a stage.
#[derive(Clone, Debug)]
pub struct Piece {
    pub rank: usize,
    pub part: Part,
    pub tensor: Tensor,
}

/// Splits a run-file name `BASE@rank…` into the base name and how the rank
/// covers it; None for a name without `@`. Err: a malformed suffix.
pub fn parse(name: &str) -> Option<Result<(&str, usize, Part), String>> {
    let (base, suffix) = name.split_once('@')?;
    let bad = || {
        format!(
            "`{name}`: a per-rank tensor is named `<step>/<stage>@rank<R>:axis=<A>:offset=<O>` (a shard) or \
             `<step>/<stage>@rank<R>:partial` (a partial sum)"
        )
    };
    let mut fields = suffix.split(':');
    let rank = fields
        .next()
        .and_then(|r| r.strip_prefix("rank"))
        .and_then(|r| r.parse().ok());
    let Some(rank) = rank else { return Some(Err(bad())) };
    let rest: Vec<&str> = fields.collect();
    let part = match rest.as_slice() {
        ["partial"] => Part::Partial,
        [a, o] => {
            let num = |s: &str, key: &str| s.strip_prefix(key).and_then(|v| v.parse::<usize>().ok());
            match (num(a, "axis="), num(o, "offset=")) {
                (Some(axis), Some(offset)) => Part::Shard { axis, offset },
                _ => return Some(Err(bad())),
            }
        }
        _ => return Some(Err(bad())),
    };
    Some(Ok((base, rank, part)))
}

/// Joins the pieces of the stage `what` into its canonical `shape`.
pub fn join(what: &str, shape: &[usize], mut pieces: Vec<Piece>) -> Result<Tensor, String> {
    pieces.sort_by_key(|p| p.rank);
    if let Some(w) = pieces.windows(2).find(|w| w[0].rank == w[1].rank) {
        return Err(format!("{what}: rank {} answered it twice", w[0].rank));
    }
    let dtype = pieces
        .iter()
        .map(|p| p.tensor.dtype())
        .reduce(|a, b| a.coarser(b))
        .ok_or_else(|| format!("{what}: no pieces"))?;
    let partial = pieces.iter().filter(|p| p.part == Part::Partial).count();
    if partial > 0 && partial < pieces.len() {
        return Err(format!("{what}: some ranks answered a shard and others a partial sum"));
    }
    if partial > 0 {
        let mut sum = vec![0.0f32; shape.iter().product()];
        for p in &pieces {
            if p.tensor.shape() != shape {
                return Err(format!(
                    "{what}: rank {}'s partial sum has shape {:?}, the stage's is {shape:?}",
                    p.rank,
                    p.tensor.shape()
                ));
            }
            sum.iter_mut().zip(p.tensor.data()).for_each(|(s, x)| *s += x);
        }
        return Ok(Tensor::new(shape.to_vec(), sum).with_dtype(dtype));
    }
    join_shards(what, shape, pieces).map(|t| t.with_dtype(dtype))
}

/// Concatenates shards along their axis, after checking they tile it.
fn join_shards(what: &str, shape: &[usize], pieces: Vec<Piece>) -> Result<Tensor, String> {
    let axis = match pieces[0].part {
        Part::Shard { axis, .. } => axis,
        Part::Partial => unreachable!("shards only"),
    };
    if axis >= shape.len() {
        return Err(format!(
            "{what}: rank {}'s shard is along axis {axis}; the stage {shape:?} has {} axes",
            pieces[0].rank,
            shape.len()
        ));
    }
    let mut spans = Vec::new();
    for p in &pieces {
        let Part::Shard { axis: a, offset } = p.part else {
            unreachable!()
        };
        if a != axis {
            return Err(format!(
                "{what}: rank {}'s shard is along axis {a}, rank {}'s along axis {axis}",
                p.rank, pieces[0].rank
            ));
        }
        let s = p.tensor.shape();
        let others_match = s.len() == shape.len() && (0..shape.len()).all(|i| i == axis || s[i] == shape[i]);
        if !others_match {
            return Err(format!(
                "{what}: rank {}'s shard has shape {s:?}; a shard of {shape:?} along axis {axis} keeps every other \
                 axis whole",
                p.rank
            ));
        }
        spans.push((offset, s[axis], p.rank));
    }
    spans.sort();
    let mut at = 0;
    for &(offset, len, rank) in &spans {
        if offset != at {
            let prev = spans
                .iter()
                .find(|s| s.0 + s.1 == at && s.0 < offset || (s.0 < offset + len && s.0 + s.1 > offset && s.2 != rank));
            let why = if offset < at {
                let other = prev.map_or(String::new(), |p| format!(" rank {}'s {}..{}", p.2, p.0, p.0 + p.1));
                format!("overlaps{other}")
            } else {
                format!("leaves {at}..{offset} uncovered")
            };
            return Err(format!(
                "{what}: rank {rank}'s shard covers {offset}..{} of axis {axis} and {why}: the shards must tile \
                 0..{} exactly",
                offset + len,
                shape[axis]
            ));
        }
        at += len;
    }
    if at != shape[axis] {
        let last = spans.last().map_or(0, |s| s.2);
        return Err(format!(
            "{what}: the shards cover 0..{at} of axis {axis} (the last is rank {last}'s); the stage has {}",
            shape[axis]
        ));
    }
    // Concatenate: for each index of the axes before `axis`, each shard's block.
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let mut by_offset: Vec<&Piece> = pieces.iter().collect();
    by_offset.sort_by_key(|p| match p.part {
        Part::Shard { offset, .. } => offset,
        Part::Partial => 0,
    });
    let mut data = Vec::with_capacity(shape.iter().product());
    for o in 0..outer {
        for p in &by_offset {
            let block = p.tensor.shape()[axis] * inner;
            data.extend_from_slice(&p.tensor.data()[o * block..(o + 1) * block]);
        }
    }
    Ok(Tensor::new(shape.to_vec(), data))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(rank: usize, offset: usize, shape: Vec<usize>, data: Vec<f32>) -> Piece {
        Piece {
            rank,
            part: Part::Shard { axis: 1, offset },
            tensor: Tensor::new(shape, data),
        }
    }

    #[test]
    fn names_parse_into_rank_and_part() {
        assert_eq!(parse("prefill/blk.0.q"), None);
        assert_eq!(
            parse("prefill/blk.0.q@rank1:axis=1:offset=2").unwrap().unwrap(),
            ("prefill/blk.0.q", 1, Part::Shard { axis: 1, offset: 2 })
        );
        assert_eq!(
            parse("decode1/blk.0.attn_out@rank0:partial").unwrap().unwrap(),
            ("decode1/blk.0.attn_out", 0, Part::Partial)
        );
        for bad in ["x@r1:partial", "x@rank1", "x@rank1:axis=1", "x@rank1:axis=a:offset=0"] {
            assert!(parse(bad).unwrap().is_err(), "{bad}");
        }
    }

    #[test]
    fn shards_join_along_their_axis_and_partials_add_in_rank_order() {
        // [2 rows, 4 heads]: rank 0 heads 0..2, rank 1 heads 2..4.
        let a = shard(0, 0, vec![2, 2], vec![1.0, 2.0, 5.0, 6.0]);
        let b = shard(1, 2, vec![2, 2], vec![3.0, 4.0, 7.0, 8.0]);
        let j = join("q", &[2, 4], vec![b, a]).unwrap();
        assert_eq!(j.data(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        let p = |rank, v: f32| Piece {
            rank,
            part: Part::Partial,
            tensor: Tensor::new(vec![1, 2], vec![v, v]),
        };
        assert_eq!(
            join("o", &[1, 2], vec![p(1, 0.5), p(0, 1.0)]).unwrap().data(),
            &[1.5, 1.5]
        );
    }

    #[test]
    fn a_rank_at_the_wrong_offset_is_refused_by_name() {
        // The planted bug: rank 1's shard one head early (offset 1 for 2).
        let a = shard(0, 0, vec![2, 2], vec![0.0; 4]);
        let b = shard(1, 1, vec![2, 2], vec![0.0; 4]);
        let e = join("prefill/blk.0.q", &[2, 4], vec![a.clone(), b]).unwrap_err();
        assert!(
            e.contains("rank 1's shard covers 1..3 of axis 1") && e.contains("overlaps"),
            "{e}"
        );
        let gap = shard(1, 3, vec![2, 1], vec![0.0; 2]);
        let e = join("q", &[2, 4], vec![a.clone(), gap]).unwrap_err();
        assert!(e.contains("rank 1's") && e.contains("leaves 2..3 uncovered"), "{e}");
        let short = join("q", &[2, 4], vec![a.clone()]).unwrap_err();
        assert!(short.contains("cover 0..2"), "{short}");
        let twice = join("q", &[2, 4], vec![a.clone(), a]).unwrap_err();
        assert!(twice.contains("rank 0 answered it twice"), "{twice}");
    }
}
