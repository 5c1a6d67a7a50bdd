//! Planted kernel bugs (`planted_*` variants compiled only for the
//! emulator), each caught: by a comparison with the good kernel at exactly
//! the rows or heads it affects, or by the guarded memory.

use super::attention::{attn_inputs, compare_attention, run_attention, AttnCase};
use super::kernels::{cpu_rope, run_rope};
use super::*;

#[test]
fn planted_softmax_max_is_caught_at_the_rows_it_affects() {
    // The warp-only max differs from the block's only when a row's visible
    // keys span more than one warp (> 32 keys): exactly those rows mismatch.
    let c = AttnCase {
        t: 40,
        pos0: 0,
        heads: 2,
        kv: 1,
        d: 8,
        window: 0,
        sinks: false,
    };
    let [(q, qw), (k, kw), (v, vw)] = attn_inputs::<f32>(&c, 30);
    let good = run_attention::<f32>("attention_prefill_f32", &c, &q, &k, &v);
    assert!(compare_attention(&c, &qw, &kw, &vw, &good).is_empty());
    let bug = run_attention::<f32>("planted_softmax_max/attention_prefill_f32", &c, &q, &k, &v);
    let bad = compare_attention(&c, &qw, &kw, &vw, &bug);
    let want: Vec<(usize, usize)> = (0..c.heads).flat_map(|h| (32..c.t).map(move |t| (h, t))).collect();
    assert_eq!(
        bad, want,
        "mismatching (head, row): those with more than 32 visible keys"
    );
}

#[test]
fn planted_gqa_modulo_is_caught_at_the_heads_it_remaps() {
    // H = 4, KV = 2: h / 2 = (0, 0, 1, 1), h % 2 = (0, 1, 0, 1): heads 1 and 2.
    let c = AttnCase {
        t: 3,
        pos0: 2,
        heads: 4,
        kv: 2,
        d: 8,
        window: 0,
        sinks: false,
    };
    let [(q, qw), (k, kw), (v, vw)] = attn_inputs::<f32>(&c, 31);
    let bug = run_attention::<f32>("planted_gqa_modulo/attention_prefill_f32", &c, &q, &k, &v);
    let bad = compare_attention(&c, &qw, &kw, &vw, &bug);
    assert_eq!(bad, vec![(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]);
}

#[test]
fn planted_window_ignored_is_caught_at_the_rows_the_window_masks() {
    // Window 3 over positions 4..10: every row sees more than 3 keys, so
    // every (head, row) mismatches once the window is ignored; with no
    // window the planted kernel is the correct one.
    let c = AttnCase {
        t: 6,
        pos0: 4,
        heads: 2,
        kv: 1,
        d: 8,
        window: 3,
        sinks: false,
    };
    let [(q, qw), (k, kw), (v, vw)] = attn_inputs::<f32>(&c, 34);
    let good = run_attention::<f32>("attention_prefill_f32", &c, &q, &k, &v);
    assert!(compare_attention(&c, &qw, &kw, &vw, &good).is_empty());
    let bug = run_attention::<f32>("planted_window_ignored/attention_prefill_f32", &c, &q, &k, &v);
    let bad = compare_attention(&c, &qw, &kw, &vw, &bug);
    let want: Vec<(usize, usize)> = (0..c.heads).flat_map(|h| (0..c.t).map(move |t| (h, t))).collect();
    assert_eq!(bad, want, "every row sees keys older than the window");
    let global = AttnCase { window: 0, ..c };
    let bug = run_attention::<f32>("planted_window_ignored/attention_prefill_f32", &global, &q, &k, &v);
    assert!(compare_attention(&global, &qw, &kw, &vw, &bug).is_empty());
}

#[test]
fn planted_rope_pair_is_caught() {
    let (rows, heads, d, pos0) = (3, 2, 8, 0);
    let (x, xw) = stored::<f32>(&data(rows * heads * d, 32, 2.0));
    let want = cpu_rope::<f32>(&xw, rows, heads, d, pos0);
    let got = run_rope::<f32>("planted_rope_pair/rope_neox_f32", &x, rows, heads, d, pos0);
    let bad: Vec<usize> = (0..x.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    // Position 0 rotates by angle 0 (the identity whatever the pairing), so
    // row 0 matches; every later row mismatches.
    assert!(!bad.is_empty());
    assert!(
        bad.iter().all(|&i| i >= heads * d),
        "row 0 (position 0) is the identity: {bad:?}"
    );
    for r in 1..rows {
        assert!(bad.iter().any(|&i| i / (heads * d) == r), "row {r} mismatches");
    }
}

#[test]
fn planted_oob_store_is_reported_with_kernel_thread_and_offset() {
    let (v, e, t) = (5, 24, 19); // 456 elements: the last thread is block 1, thread 199
    let emu = Emu::new();
    let table = emu.upload("table", &data(v * e, 33, 1.0));
    let tokens = emu.upload("tokens", &(0..t as u32).map(|i| i % v as u32).collect::<Vec<_>>());
    let out = emu.alloc::<f32>("embed_out", t * e);
    let args = [
        table.arg(),
        tokens.arg(),
        out.arg(),
        (t as i32).into(),
        (e as i32).into(),
    ];
    // The production kernel is clean.
    emu.launch("embedding_f32", launch::elementwise(t * e).into(), &args)
        .unwrap();
    let err = emu
        .launch(
            "planted_oob_store/embedding_f32",
            launch::elementwise(t * e).into(),
            &args,
        )
        .unwrap_err();
    eprintln!("{err}");
    let n = t * e;
    assert_eq!(
        err,
        EmuError::Fault {
            kernel: "planted_oob_store/embedding_f32".into(),
            block: ((n - 1) as u32 / 256, 0, 0),
            thread: ((n - 1) as u32 % 256, 0, 0),
            access: Access::Write,
            location: Location::Buffer {
                buffer: "embed_out".into(),
                bytes: n * 4,
                offset: (n * 4) as i64
            },
        }
    );
    assert_eq!(
        err.to_string(),
        "kernel `planted_oob_store/embedding_f32`: block (1,0,0) thread (199,0,0) wrote out of bounds at byte offset \
         1824 of buffer `embed_out` (1824 bytes; the first byte past its end)"
    );
}

#[test]
fn planted_underflow_store_is_found_in_the_canary() {
    // out[i - 1]: thread 0 writes 4 bytes before the buffer, into the canary
    // (no fault there, so the check after the launch names kernel, buffer, offset).
    let (v, e, t) = (5, 8, 4);
    let emu = Emu::new();
    let table = emu.upload("table", &data(v * e, 34, 1.0));
    let tokens = emu.upload("tokens", &[1u32, 2, 3, 4]);
    let out = emu.alloc::<f32>("embed_out", t * e);
    let args = [
        table.arg(),
        tokens.arg(),
        out.arg(),
        (t as i32).into(),
        (e as i32).into(),
    ];
    let err = emu
        .launch(
            "planted_oob_underflow/embedding_f32",
            launch::elementwise(t * e).into(),
            &args,
        )
        .unwrap_err();
    eprintln!("{err}");
    assert_eq!(
        err,
        EmuError::Guard {
            kernel: "planted_oob_underflow/embedding_f32".into(),
            location: Location::Buffer {
                buffer: "embed_out".into(),
                bytes: t * e * 4,
                offset: -4
            },
        }
    );
}
