//! What one core of this machine issues per nanosecond of the instructions the kernels are
//! made of, each alone in a loop of 8 independent instructions, and a chain of dependent
//! scalar adds (one a cycle) for the clock.
use std::{arch::asm, time::Instant};

macro_rules! eight {
    ($name:ident, $op:literal) => {
        fn $name(n: u64) {
            // Safety: register-only instructions; the ymm registers written are declared.
            unsafe {
                asm!(
                    "2:",
                    concat!($op, " ymm0, ymm8, ymm9"), concat!($op, " ymm1, ymm8, ymm10"),
                    concat!($op, " ymm2, ymm8, ymm11"), concat!($op, " ymm3, ymm8, ymm12"),
                    concat!($op, " ymm4, ymm8, ymm9"), concat!($op, " ymm5, ymm8, ymm10"),
                    concat!($op, " ymm6, ymm8, ymm11"), concat!($op, " ymm7, ymm8, ymm12"),
                    "dec {n}", "jnz 2b",
                    n = inout(reg) n => _,
                    out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                    out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                )
            }
        }
    };
}
eight!(maddubs, "vpmaddubsw");
eight!(maddwd, "vpmaddwd");
eight!(paddw, "vpaddw");

fn scalar_chain(n: u64) {
    // Safety: register-only instructions.
    unsafe {
        asm!(
            "2:", "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
            "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
            "dec {n}", "jnz 2b",
            n = inout(reg) n => _, x = out(reg) _,
        )
    }
}

/// Nanoseconds per loop iteration of `f` (8 instructions).
fn per_iteration(f: fn(u64)) -> f64 {
    const N: u64 = 50_000_000;
    f(1000);
    let s = Instant::now();
    f(N);
    s.elapsed().as_secs_f64() / N as f64 * 1e9
}

pub fn print() {
    let cycle = per_iteration(scalar_chain) / 8.0;
    println!(
        "clock ≈ {:.2} GHz (a dependent scalar add per cycle)",
        1.0 / cycle
    );
    for (name, f) in [
        ("vpmaddubsw", maddubs as fn(u64)),
        ("vpmaddwd", maddwd),
        ("vpaddw", paddw),
    ] {
        let ns = per_iteration(f) / 8.0;
        println!("{name} ymm: {:.2} per cycle", cycle / ns);
    }
}
