//! Blocks in parallel: a launch split over several OS threads computes the
//! serial order's bits (attention with dynamic shared memory, block
//! reductions, elementwise grids), and a fault or deadlock in several blocks
//! is reported for the lowest block, with the serial report, every time.

use super::attention::{attn_inputs, run_attention_on, AttnCase};
use super::*;

/// Four workers whatever the machine, so that the split really happens.
fn four() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap()
}

/// `f` on a serial device, then on one that splits every launch over the
/// 4-worker pool.
fn both<R: Send>(f: impl Fn(&Emu) -> R + Sync) -> (R, R) {
    let serial = f(&Emu::serial());
    let parallel = four().install(|| {
        assert_eq!(rayon::current_num_threads(), 4);
        f(&Emu::split_always())
    });
    (serial, parallel)
}

fn rmsnorm(emu: &Emu, kernel: &str, rows: usize, width: usize) -> Result<Vec<f32>, EmuError> {
    let x = emu.upload("x", &data(rows * width, 50, 2.0));
    let w = emu.upload("w", &data(width, 51, 1.0));
    let out = emu.alloc::<f32>("out", rows * width);
    let args = [
        x.arg(),
        w.arg(),
        out.arg(),
        (width as i32).into(),
        1e-6f32.into(),
        0i32.into(),
    ];
    emu.launch(kernel, launch::per_row(rows, width).into(), &args)?;
    Ok(out.to_vec())
}

#[test]
fn parallel_launches_equal_serial_ones_bit_for_bit() {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // Attention: grid (T, H) = 160 blocks of 128 threads, dynamic shared
    // memory, probabilities and scores written.
    let c = AttnCase {
        t: 40,
        pos0: 3,
        heads: 4,
        kv: 2,
        d: 16,
        window: 0,
        sinks: false,
    };
    let [(q, _), (k, _), (v, _)] = attn_inputs::<f32>(&c, 40);
    let (s, p) = both(|emu| run_attention_on::<f32>(emu, "attention_prefill_f32", &c, &q, &k, &v));
    assert_eq!(bits(&s.ctx), bits(&p.ctx), "attention ctx");
    assert_eq!(bits(&s.probs), bits(&p.probs), "attention probs");
    assert_eq!(bits(&s.scores), bits(&p.scores), "attention scores");

    // RMSNorm: 300 rows, one block each, block reductions of 256 threads.
    let (s, p) = both(|emu| rmsnorm(emu, "rmsnorm_f32", 300, 1000).unwrap());
    assert_eq!(bits(&s), bits(&p), "rmsnorm");

    // Elementwise: 65536 elements, 256 blocks.
    let n = 1 << 16;
    let (s, p) = both(|emu| {
        let (a, b) = (emu.upload("a", &data(n, 52, 3.0)), emu.upload("b", &data(n, 53, 3.0)));
        let out = emu.alloc::<f32>("out", n);
        let args = [a.arg(), b.arg(), out.arg(), (n as i64).into()];
        emu.launch("silu_mul_f32", launch::elementwise(n).into(), &args)
            .unwrap();
        out.to_vec()
    });
    assert_eq!(bits(&s), bits(&p), "silu_mul");
}

#[test]
fn a_fault_in_several_parallel_blocks_names_the_lowest() {
    // out holds 300 elements, the grid writes 1200 (5 blocks of 256): every
    // thread from element 300 on (block 1 thread 44, then all of blocks 2-4)
    // writes past the end, into the guard page (1024 elements wide).
    let (t, e) = (50, 24);
    let run = |emu: &Emu| {
        let table = emu.upload("table", &data(t * e, 54, 1.0));
        let tokens = emu.upload("tokens", &(0..t as u32).collect::<Vec<_>>());
        let out = emu.alloc::<f32>("short_out", 300);
        let args = [
            table.arg(),
            tokens.arg(),
            out.arg(),
            (t as i32).into(),
            (e as i32).into(),
        ];
        emu.launch("embedding_f32", launch::elementwise(t * e).into(), &args)
            .unwrap_err()
    };
    let want = EmuError::Fault {
        kernel: "embedding_f32".into(),
        block: (1, 0, 0),
        thread: (44, 0, 0),
        access: Access::Write,
        location: Location::Buffer {
            buffer: "short_out".into(),
            bytes: 1200,
            offset: 1200,
        },
    };
    for _ in 0..8 {
        let (s, p) = both(run);
        assert_eq!(s, want, "serial");
        assert_eq!(p, want, "parallel");
    }
}

#[test]
fn a_deadlock_in_several_parallel_blocks_names_the_lowest() {
    // planted_deadlock: in blocks 5 and up thread 40 returns before the
    // reductions, so warp 1's shuffle never completes (31 of 32 lanes).
    let want = EmuError::Kernel {
        kernel: "planted_deadlock/rmsnorm_f32".into(),
        msg: "block (5,0,0) deadlocks: 224 threads at __syncthreads, 31 at a warp shuffle, 1 exited (a barrier or \
              shuffle not reached by every thread)"
            .into(),
    };
    for _ in 0..8 {
        let (s, p) = both(|emu| rmsnorm(emu, "planted_deadlock/rmsnorm_f32", 64, 1000).unwrap_err());
        assert_eq!(s, want, "serial");
        assert_eq!(p, want, "parallel");
    }
    // The production kernel is clean on the same rows.
    let (s, p) = both(|emu| rmsnorm(emu, "rmsnorm_f32", 64, 1000).unwrap());
    assert_eq!(s, p);
}
