//! The patched candle-core's weight-stationary quantized matmul returns, for every type of the
//! default GGUFs and every number of rows 1..=17, what candle's stock row-by-row loop returns, on
//! odd shapes and on blocks holding extreme values: bit for bit, except for the panel kernels
//! (m > 1: Q4K and Q6K on CPUs with AVX2, with AVX-512 VNNI or not), whose exact integer block
//! sums are added up in another f32 order, so they agree to within 1e-5 of the magnitude sum
//! Σ|w·x|. Every instruction set of the kernels that the CPU runs is checked in turn, and on a
//! CPU that runs both, the two sets are checked against each other bit for bit.

use std::sync::Mutex;

use candle_core::{
    quantized::{ggml_file::qtensor_from_ggml, set_kernel_isa, GgmlDType, KernelIsa, QMatMul, QTensor},
    Device, Module, Tensor,
};
use verdict::kernels::QuantKernel;

/// The kernel switch is process-wide: tests that flip it take turns.
static KERNEL: Mutex<()> = Mutex::new(());

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Values with rows of zeros and rows spanning six decades with an outlier, which drive the
/// quantizers to their extreme codes.
fn values(rng: &mut XorShift, rows: usize, cols: usize) -> Vec<f32> {
    let mut v: Vec<f32> = (0..rows * cols).map(|_| rng.unit()).collect();
    for (i, row) in v.chunks_mut(cols).enumerate() {
        match i % 5 {
            3 => row.fill(0.0),
            4 => {
                for (j, x) in row.iter_mut().enumerate() {
                    *x *= 10f32.powi((j % 7) as i32 - 3);
                }
                row[cols / 2] = -1000.0;
            }
            _ => {}
        }
    }
    v
}

/// Byte range of each block that holds quantized values and sub-block scales (not the f16
/// super-scales, which random bytes could turn into NaN), per the ggml block layouts.
fn scramblable(dtype: GgmlDType) -> std::ops::Range<usize> {
    match dtype {
        GgmlDType::Q4K => 4..144, // d, dmin | scales[12], qs[128]
        GgmlDType::Q6K => 0..208, // ql[128], qh[64], scales[16] | d
        GgmlDType::Q8_0 => 2..34, // d | qs[32]
        GgmlDType::Q5_0 => 2..22, // d | qh[4], qs[16]
        GgmlDType::Q4_1 => 4..20, // d, m | qs[16]
        other => panic!("no layout for {other:?}"),
    }
}

/// Quantizes random weights, then overwrites every third block's codes with random bytes.
fn weights(rng: &mut XorShift, dtype: GgmlDType, n: usize, k: usize) -> QMatMul {
    let dev = Device::Cpu;
    let w = Tensor::from_vec(values(rng, n, k), (n, k), &dev).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let mut raw = q.data().unwrap().into_owned();
    let block_bytes = dtype.type_size();
    assert_eq!(raw.len(), n * k / dtype.block_size() * block_bytes);
    let range = scramblable(dtype);
    assert!(range.end <= block_bytes);
    for block in raw.chunks_mut(block_bytes).step_by(3) {
        for b in &mut block[range.clone()] {
            *b = rng.next() as u8;
        }
    }
    QMatMul::from_qtensor(qtensor_from_ggml(dtype, &raw, vec![n, k], &dev).unwrap()).unwrap()
}

fn forward_bits(kernel: QuantKernel, w: &QMatMul, x: &Tensor) -> Vec<u32> {
    kernel.select();
    let y = w.forward(x).unwrap();
    y.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// (k, n) pairs: odd weight-row counts (not multiples of any chunk), odd block counts where
/// the type's `vec_dot` allows them, and one case large enough to be split across threads.
fn shapes(dtype: GgmlDType) -> Vec<(usize, usize)> {
    if dtype.block_size() == 256 {
        return vec![(256, 1), (256, 37), (768, 3), (1280, 131), (2304, 1031)];
    }
    let mut shapes = vec![(64, 1), (64, 37), (256, 3), (544, 131), (1536, 1031)];
    // Q5_0 / Q4_1 `vec_dot` debug-assert an even number of blocks (stock candle too).
    if !cfg!(debug_assertions) {
        shapes.extend([(32, 5), (96, 7), (288, 33)]);
    }
    shapes
}

/// Runs `f(name)` with each instruction set of the kernels that this CPU runs selected in turn
/// (once, as "no kernels", on a build without them), leaving the fastest selected: the default.
fn for_each_isa(mut f: impl FnMut(&str)) {
    let isas = KernelIsa::available();
    if isas.is_empty() {
        return f("no kernels");
    }
    for isa in isas {
        set_kernel_isa(isa).unwrap();
        f(isa.name());
    }
}

fn check(dtype: GgmlDType, seed: u64) {
    let _turn = KERNEL.lock().unwrap_or_else(|e| e.into_inner());
    for_each_isa(|isa| check_on(dtype, seed, isa));
    QuantKernel::WeightStationary.select();
}

fn check_on(dtype: GgmlDType, seed: u64, isa: &str) {
    let mut rng = XorShift(seed);
    let dev = Device::Cpu;
    for (k, n) in shapes(dtype) {
        let w = weights(&mut rng, dtype, n, k);
        let xs = values(&mut rng, 17, k);
        for m in 1..=17 {
            let x = Tensor::from_slice(&xs[..m * k], (1, m, k), &dev).unwrap();
            let stock = forward_bits(QuantKernel::Stock, &w, &x);
            let new = forward_bits(QuantKernel::WeightStationary, &w, &x);
            assert!(stock.iter().any(|&b| f32::from_bits(b) != 0.0));
            // None: bit for bit; Some: per-output bound of the f32 rounding difference.
            let bounds: Option<Vec<f32>> = (panel_kernel(dtype) && m > 1).then(|| {
                magnitude_sums(&w, &x)
                    .iter()
                    .map(|s| 1e-5 * s + 1e-6)
                    .collect()
            });
            let differs = |i: usize| match &bounds {
                None => stock[i] != new[i],
                Some(b) => (f32::from_bits(stock[i]) - f32::from_bits(new[i])).abs() > b[i],
            };
            if let Some(i) = (0..stock.len()).find(|&i| differs(i)) {
                panic!(
                    "{isa} {dtype:?} k={k} n={n} m={m}: row {} col {}: weight-stationary {} vs stock {}",
                    i / n,
                    i % n,
                    f32::from_bits(new[i]),
                    f32::from_bits(stock[i])
                );
            }
        }
    }
}

/// True where the patch runs this type through its panel kernels (m > 1): Q4K and Q6K on
/// CPUs with AVX2 (AVX-512 VNNI or AVX2 kernels).
fn panel_kernel(dtype: GgmlDType) -> bool {
    cfg!(target_feature = "avx2") && matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K)
}

/// Σ_j |w_ij · x_rj| for every output (r, i): the scale of f32 rounding differences.
fn magnitude_sums(w: &QMatMul, x: &Tensor) -> Vec<f32> {
    let QMatMul::QTensor(q) = w else {
        panic!("expected a quantized weight")
    };
    let w = q.dequantize(&Device::Cpu).unwrap().abs().unwrap();
    let x = x.squeeze(0).unwrap().abs().unwrap();
    x.matmul(&w.t().unwrap())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn q4k_equals_stock() {
    check(GgmlDType::Q4K, 1);
}

#[test]
fn q6k_equals_stock() {
    check(GgmlDType::Q6K, 2);
}

#[test]
fn q8_0_equals_stock() {
    check(GgmlDType::Q8_0, 3);
}

#[test]
fn q5_0_equals_stock() {
    check(GgmlDType::Q5_0, 4);
}

#[test]
fn q4_1_equals_stock() {
    check(GgmlDType::Q4_1, 5);
}

/// A batched 3-D input gives each row exactly what a forward of that row alone gives it.
#[test]
fn batched_rows_equal_single_rows() {
    let _turn = KERNEL.lock().unwrap_or_else(|e| e.into_inner());
    QuantKernel::WeightStationary.select();
    let mut rng = XorShift(6);
    let dev = Device::Cpu;
    let (n, k) = (67, 512);
    let w = weights(&mut rng, GgmlDType::Q4K, n, k);
    let x = Tensor::from_vec(values(&mut rng, 14, k), (2, 7, k), &dev).unwrap();
    let batched = w
        .forward(&x)
        .unwrap()
        .flatten_to(1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let rows = x.flatten_to(1).unwrap();
    for (i, row) in batched.iter().enumerate() {
        // The row twice, so that it takes the multi-row kernel too (one row keeps candle's
        // stock loop, which the panel kernels match only to f32 rounding).
        let one = rows.narrow(0, i, 1).unwrap();
        let single = w
            .forward(&Tensor::cat(&[&one, &one], 0).unwrap())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let same = row
            .iter()
            .zip(&single[0])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "row {i} of a batched forward differs from its single-row forward"
        );
    }
}

/// With the row-invariant kernels a row multiplied alone gets, bit for bit, what it gets among
/// 9 rows, for every type of the default GGUFs. (With the default kernels the panel types differ
/// there in the last bits: one row keeps candle's loop.)
#[test]
fn row_invariant_single_rows_equal_rows_among_many() {
    let _turn = KERNEL.lock().unwrap_or_else(|e| e.into_inner());
    for_each_isa(row_invariance_on);
    QuantKernel::WeightStationary.select();
}

fn row_invariance_on(isa: &str) {
    let mut rng = XorShift(7);
    let dev = Device::Cpu;
    for dtype in [
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q8_0,
        GgmlDType::Q5_0,
        GgmlDType::Q4_1,
    ] {
        let (n, k) = (67, if dtype.block_size() == 256 { 1536 } else { 1024 });
        let w = weights(&mut rng, dtype, n, k);
        let xs = values(&mut rng, 9, k);
        let all = Tensor::from_slice(&xs, (9, k), &dev).unwrap();
        let among_many = forward_bits(QuantKernel::RowInvariant, &w, &all);
        for r in 0..9 {
            let one = Tensor::from_slice(&xs[r * k..(r + 1) * k], (1, k), &dev).unwrap();
            let alone = forward_bits(QuantKernel::RowInvariant, &w, &one);
            assert!(
                alone == among_many[r * n..(r + 1) * n],
                "{isa} {dtype:?}: row {r} multiplied alone differs from the same row among 9"
            );
        }
    }
}

/// On a CPU that runs both instruction sets, the AVX2 and AVX-512 VNNI panel kernels give every
/// output the same bits for every row count (their integer sums are exact and their f32
/// operations the same, block after block), so which set runs never changes a decode. On a CPU
/// with one set there is nothing to compare, and the test says so.
#[test]
fn both_instruction_sets_give_the_same_bits() {
    let _turn = KERNEL.lock().unwrap_or_else(|e| e.into_inner());
    let isas = KernelIsa::available();
    if isas.len() < 2 {
        eprintln!("only {isas:?} runs on this CPU: nothing to compare");
        return;
    }
    let mut rng = XorShift(8);
    let dev = Device::Cpu;
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
        for (k, n) in shapes(dtype) {
            let w = weights(&mut rng, dtype, n, k);
            let xs = values(&mut rng, 17, k);
            for m in [1, 2, 5, 8, 17] {
                let x = Tensor::from_slice(&xs[..m * k], (1, m, k), &dev).unwrap();
                let bits: Vec<Vec<u32>> = isas
                    .iter()
                    .map(|&isa| {
                        set_kernel_isa(isa).unwrap();
                        forward_bits(QuantKernel::RowInvariant, &w, &x)
                    })
                    .collect();
                if let Some(i) = (0..bits[0].len()).find(|&i| bits.iter().any(|b| b[i] != bits[0][i])) {
                    panic!(
                        "{dtype:?} k={k} n={n} m={m}: row {} col {}: {:?} give {:?}",
                        i / n,
                        i % n,
                        isas.iter().map(|isa| isa.name()).collect::<Vec<_>>(),
                        bits.iter().map(|b| f32::from_bits(b[i])).collect::<Vec<_>>()
                    );
                }
            }
        }
    }
    set_kernel_isa(*isas.last().unwrap()).unwrap();
    QuantKernel::WeightStationary.select();
}

/// An instruction set the CPU cannot run is refused by name, and the one in use stays.
#[test]
fn kernels_the_cpu_cannot_run_are_refused() {
    let _turn = KERNEL.lock().unwrap_or_else(|e| e.into_inner());
    let before = candle_core::quantized::kernel_isa();
    for isa in KernelIsa::ALL.into_iter().filter(|isa| !isa.runs_here()) {
        let err = set_kernel_isa(isa).unwrap_err();
        assert!(err.contains(isa.name()), "{err}");
        assert_eq!(candle_core::quantized::kernel_isa(), before);
    }
    if std::env::var_os("CANDLE_WS_ISA").is_none() {
        assert_eq!(before, KernelIsa::available().last().copied(), "the default is the fastest set the CPU runs");
    }
}

/// Weights held once: panels that replace a matrix's blocks give the blocks back byte for
/// byte, dequantize to the same values, and multiply as the blocks do on the row-invariant
/// kernels, whichever kernel is selected (they have no other).
#[test]
fn panels_held_alone_are_the_blocks() {
    let _turn = KERNEL.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = XorShift(7);
    let dev = Device::Cpu;
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0] {
        for (k, n) in shapes(dtype) {
            let blocks = weights(&mut rng, dtype, n, k);
            let QMatMul::QTensor(q) = &blocks else { panic!("expected a quantized weight") };
            let Some(panels) = q.panels_replacing_blocks() else {
                assert!(!panel_kernel(dtype), "{dtype:?} {n}x{k}: no panels on a CPU with the kernels");
                continue;
            };
            assert!(panels.holds_panels() && !q.holds_panels());
            assert!(panels.data().unwrap() == q.data().unwrap(), "{dtype:?} {n}x{k}: blocks rebuilt differ");
            assert_eq!(panels.storage_size_in_bytes(), q.storage_size_in_bytes());
            let dequantized = |t: &QTensor| t.dequantize(&dev).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let same_bits = |a: Vec<f32>, b: Vec<f32>| a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same_bits(dequantized(&panels), dequantized(q)), "{dtype:?} {n}x{k}: dequantized values differ");
            let held_once = QMatMul::from_qtensor(panels).unwrap();
            let xs = values(&mut rng, 9, k);
            for m in [1, 2, 5, 8, 9] {
                let x = Tensor::from_slice(&xs[..m * k], (1, m, k), &dev).unwrap();
                let expected = forward_bits(QuantKernel::RowInvariant, &blocks, &x);
                assert_eq!(forward_bits(QuantKernel::RowInvariant, &held_once, &x), expected, "{dtype:?} {n}x{k} m={m}");
                assert_eq!(forward_bits(QuantKernel::Stock, &held_once, &x), expected, "{dtype:?} {n}x{k} m={m}");
            }
        }
    }
    // With the switch on, a matrix made ready for multiplication keeps only its panels.
    candle_core::quantized::set_panels_replace_blocks(true);
    let blocks = weights(&mut rng, GgmlDType::Q4K, 37, 256);
    candle_core::quantized::set_panels_replace_blocks(false);
    let QMatMul::QTensor(q) = &blocks else { panic!("expected a quantized weight") };
    assert_eq!(q.holds_panels(), panel_kernel(GgmlDType::Q4K));
    QuantKernel::WeightStationary.select();
}
