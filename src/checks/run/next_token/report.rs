//! How `next_token` words its verdict: the per-position breaches of a
//! prompt with their context (step, preceding text, the oracle's top-1 and
//! the engine's probability of it), and the rates over the set.

use super::judge::{Allowance, Breach, Measured};
use super::set::PromptRec;

/// Position t as the step that computed it.
pub fn step_of(t: usize, split: usize) -> String {
    if t < split {
        format!("position {t} (prefill row {t})")
    } else {
        format!("position {t} (decode{})", t - split + 1)
    }
}

pub fn explain(
    o: &PromptRec,
    e: &Measured,
    a: &Allowance,
    b: &[Breach],
    step: &dyn Fn(usize) -> String,
    show: &dyn Fn(&[u32]) -> String,
    k: usize,
) -> String {
    let ctx = |t: usize| {
        format!(
            "{}, after {}: the oracle's top-1 {} {} p {:.4}, the engine's p {:.4}",
            step(t),
            show(&o.tokens[..=t]),
            o.top_ids[t][0],
            show(&o.top_ids[t][..1]),
            o.top_logprobs[t][0].exp(),
            e.lp_oracle_top1[t].exp()
        )
    };
    let mut lines = vec![format!("prompt `{}`:", o.name)];
    for x in b.iter().take(6) {
        lines.push(match x {
            Breach::Kl { t, kl } => format!(
                "  KL(oracle ‖ engine) {} > allowed {} at {}",
                sci(*kl),
                sci(a.kl),
                ctx(*t)
            ),
            Breach::Margin { t, e: m } => format!(
                "  a logit margin among the oracle's top {} is off by {} > allowed {} at {}",
                o.top_ids[*t].len(),
                sci(*m),
                sci(a.margin),
                ctx(*t)
            ),
            Breach::Top1 { t, got, want, margin, bound } => format!(
                "  top-1 {got} {} instead of the oracle's {want} {}, which leads it by {}{} in the oracle, more than \
                 the allowed margin error {} (not a near-tie) at {}",
                show(&[*got]),
                show(&[*want]),
                if *bound { "at least " } else { "" },
                sci(*margin),
                sci(a.margin),
                step(*t)
            ),
            Breach::TopK { t, missing, lead } => format!(
                "  the oracle's top-{k} token {missing} {} (clear of its {}-th by {} > {}) is not in the engine's \
                 top {k} at {}",
                show(&[*missing]),
                k + 1,
                sci(*lead),
                sci(a.margin),
                step(*t)
            ),
        });
    }
    if b.len() > 6 {
        lines.push(format!("  … and {} more breaches on this prompt", b.len() - 6));
    }
    lines.join("\n")
}

/// Rates over every prompt, for the engine and each peer.
#[derive(Default)]
pub struct Totals {
    positions: usize,
    top1: f64,
    overlap: f64,
    pub worst_kl: (f64, String),
    /// peer name -> (top-1 sum, overlap sum)
    peers: Vec<(String, (f64, f64))>,
}

impl Totals {
    pub fn add(&mut self, e: &Measured, o: &PromptRec, k: usize, peers: &[(&str, &Measured)]) {
        let n = e.top.len() as f64;
        self.positions += e.top.len();
        self.top1 += e.top1_rate(o) * n;
        self.overlap += e.overlap(o, k) * n;
        let (kl, _) = Measured::worst(&e.kl);
        if kl > self.worst_kl.0 || self.worst_kl.1.is_empty() {
            self.worst_kl = (kl, o.name.clone());
        }
        for (name, m) in peers {
            let add = (m.top1_rate(o) * n, m.overlap(o, k) * n);
            match self.peers.iter_mut().find(|(p, _)| p == name) {
                Some((_, s)) => {
                    s.0 += add.0;
                    s.1 += add.1;
                }
                None => self.peers.push((name.to_string(), add)),
            }
        }
    }
    pub fn top1(&self) -> f64 {
        self.top1 / self.positions.max(1) as f64
    }
    pub fn overlap(&self) -> f64 {
        self.overlap / self.positions.max(1) as f64
    }
    pub fn peer_rates(&self, pick: impl Fn(&(f64, f64)) -> f64) -> String {
        let n = self.positions.max(1) as f64;
        let v: Vec<String> = self.peers.iter().map(|(p, s)| format!("{p} {}", pct(pick(s) / n))).collect();
        v.join(", ")
    }
}

pub fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

pub fn sci(x: f64) -> String {
    format!("{x:.2e}")
}

/// The last `n` characters of `s`, with `…` where cut.
pub fn clip_front(s: &str, n: usize) -> String {
    let c: Vec<char> = s.chars().collect();
    if c.len() <= n {
        s.to_string()
    } else {
        format!("…{}", c[c.len() - n..].iter().collect::<String>())
    }
}
