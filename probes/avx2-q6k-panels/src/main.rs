//! Q6_K x Q8_K over m rows on AVX2, on candle-core `0002`'s 16-row Q6_K panels: candle-core
//! `0007`'s kernel (a copy, `tile_0007`) against a variant that unpacks one register of a
//! group at a time and applies the scale after each pair of products (`tile_stream`), so fewer
//! registers are live and a tile can take more input rows. See README.md.
#![allow(clippy::needless_range_loop)]
#[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c")))]
compile_error!("an AVX2 probe: build on x86-64 with AVX2, FMA and F16C (the repository's .cargo/config.toml sets target-cpu=native)");

use core::arch::x86_64::*;
use std::time::Instant;

const QK_K: usize = 256;
const LANES: usize = 16;
const MAX_TILE: usize = 8;

/// candle's `BlockQ8K` layout.
#[repr(C)]
#[derive(Clone)]
struct BlockQ8K {
    d: f32,
    qs: [i8; 256],
    bsums: [i16; 16],
}

/// candle-core `0002`'s Q6_K panel (see its doc there): 16 weight rows, one block each.
#[repr(C, align(64))]
#[derive(Clone)]
struct Q6KPanel {
    ql: [[u8; 64]; 32],
    qh: [[u8; 64]; 16],
    scales: [[i8; 16]; 16],
    d: [u16; LANES],
}

/// The activations' 16 group sums of a block in pairs, as `0007`.
fn group_sum_pairs(y: &BlockQ8K) -> [i32; 8] {
    std::array::from_fn(|j| (y.bsums[2 * j] as u16 as u32 | ((y.bsums[2 * j + 1] as u16 as u32) << 16)) as i32)
}

#[inline(always)]
unsafe fn bcast4(y: &BlockQ8K, i: usize) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(y.qs.as_ptr().add(i) as *const i32))
}

/// A software prefetch of the line at `p` into L1 (0), L2 (1), L3 (2) or non-temporally (3).
#[inline(always)]
unsafe fn prefetch(p: *const i8, hint: i32) {
    match hint {
        0 => _mm_prefetch::<_MM_HINT_T0>(p),
        1 => _mm_prefetch::<_MM_HINT_T1>(p),
        2 => _mm_prefetch::<_MM_HINT_T2>(p),
        _ => _mm_prefetch::<_MM_HINT_NTA>(p),
    }
}

type Out = [[__m256; 2]; MAX_TILE];

/// Group `h`'s values (0..=63) of register `c`, from its `ql` and `qh` registers.
#[inline(always)]
unsafe fn unpack(ql: __m256i, qh: __m256i, h: usize) -> __m256i {
    let low = if h % 2 == 0 { ql } else { _mm256_srli_epi16::<4>(ql) };
    let high = match h % 4 {
        0 => _mm256_slli_epi16::<4>(qh),
        1 => _mm256_slli_epi16::<2>(qh),
        2 => qh,
        _ => _mm256_srli_epi16::<2>(qh),
    };
    _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x0F)), _mm256_and_si256(high, _mm256_set1_epi8(0x30)))
}

/// The `−32` correction and the f32 accumulation of one half-block, as `0007`.
#[inline(always)]
unsafe fn finish_half<const R: usize>(
    x: &Q6KPanel,
    half: usize,
    y: &[&BlockQ8K; R],
    s: &[&[i32; 8]; R],
    sumi: &[__m256i; R],
    acc: &mut [[__m256; 2]; R],
) {
    let scale_pairs: [__m256i; 8] = std::array::from_fn(|j| {
        let a = _mm_loadl_epi64(x.scales[2 * j].as_ptr().add(8 * half) as *const __m128i);
        let b = _mm_loadl_epi64(x.scales[2 * j + 1].as_ptr().add(8 * half) as *const __m128i);
        _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b))
    });
    let d = _mm256_cvtph_ps(_mm_load_si128(x.d.as_ptr().add(8 * half) as *const __m128i));
    for r in 0..R {
        let mut corr = _mm256_setzero_si256();
        for j in 0..8 {
            corr = _mm256_add_epi32(corr, _mm256_madd_epi16(scale_pairs[j], _mm256_set1_epi32(s[r][j])));
        }
        let sumi = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32::<5>(corr));
        let dy = _mm256_set1_ps(y[r].d);
        acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, dy), acc[r][half]);
    }
}

/// candle-core `0007`'s `q6k_tile`.
#[inline(always)]
unsafe fn tile_0007<const R: usize>(w: &[Q6KPanel], acts: &[BlockQ8K], sums: &[[i32; 8]], nb: usize, r0: usize, out: &mut Out, pf: usize, hint: i32) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for (b, x) in w.iter().enumerate() {
        let ahead = (x as *const Q6KPanel).wrapping_add(pf) as *const i8;
        let y: [&BlockQ8K; R] = std::array::from_fn(|r| acts.get_unchecked((r0 + r) * nb + b));
        let s: [&[i32; 8]; R] = std::array::from_fn(|r| sums.get_unchecked((r0 + r) * nb + b));
        for half in 0..2 {
            let mut sumi = [_mm256_setzero_si256(); R];
            for j in 0..4 {
                let qh: [__m256i; 4] = std::array::from_fn(|c| _mm256_load_si256(x.qh[4 * j + c].as_ptr().add(32 * half) as *const __m256i));
                for e in 0..2 {
                    let i = 2 * j + e;
                    if half == 0 && pf > 0 {
                        for l in 0..7 {
                            prefetch(ahead.wrapping_add(64 * (7 * i + l)), hint);
                        }
                    }
                    let ql: [__m256i; 4] = std::array::from_fn(|c| _mm256_load_si256(x.ql[4 * i + c].as_ptr().add(32 * half) as *const __m256i));
                    for nibble in 0..2 {
                        let h = 2 * i + nibble;
                        let s8 = _mm_loadl_epi64(x.scales[h].as_ptr().add(8 * half) as *const __m128i);
                        let scale = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8));
                        let q: [__m256i; 4] = std::array::from_fn(|c| unpack(ql[c], qh[c], h));
                        for r in 0..R {
                            let base = 16 * h;
                            let p01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], bcast4(y[r], base)), _mm256_maddubs_epi16(q[1], bcast4(y[r], base + 4)));
                            let p23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], bcast4(y[r], base + 8)), _mm256_maddubs_epi16(q[3], bcast4(y[r], base + 12)));
                            let sm = _mm256_add_epi32(_mm256_madd_epi16(p01, scale), _mm256_madd_epi16(p23, scale));
                            sumi[r] = _mm256_add_epi32(sumi[r], sm);
                        }
                    }
                }
            }
            finish_half(x, half, &y, &s, &sumi, &mut acc);
        }
    }
    out[..R].copy_from_slice(&acc);
}

/// The same sums, one register of a group unpacked at a time; the scale applied after each
/// pair of products.
#[inline(always)]
unsafe fn tile_stream<const R: usize>(w: &[Q6KPanel], acts: &[BlockQ8K], sums: &[[i32; 8]], nb: usize, r0: usize, out: &mut Out, pf: usize, hint: i32) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for (b, x) in w.iter().enumerate() {
        let ahead = (x as *const Q6KPanel).wrapping_add(pf) as *const i8;
        let y: [&BlockQ8K; R] = std::array::from_fn(|r| acts.get_unchecked((r0 + r) * nb + b));
        let s: [&[i32; 8]; R] = std::array::from_fn(|r| sums.get_unchecked((r0 + r) * nb + b));
        for half in 0..2 {
            let mut sumi = [_mm256_setzero_si256(); R];
            for h in 0..16 {
                if half == 0 && pf > 0 && h % 2 == 0 {
                    for l in 0..7 {
                        prefetch(ahead.wrapping_add(64 * (7 * (h / 2) + l)), hint);
                    }
                }
                let s8 = _mm_loadl_epi64(x.scales[h].as_ptr().add(8 * half) as *const __m128i);
                let scale = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8));
                for pair in 0..2 {
                    let mut p = [_mm256_setzero_si256(); R];
                    for c in 2 * pair..2 * pair + 2 {
                        let ql = _mm256_load_si256(x.ql[4 * (h / 2) + c].as_ptr().add(32 * half) as *const __m256i);
                        let qh = _mm256_load_si256(x.qh[4 * (h / 4) + c].as_ptr().add(32 * half) as *const __m256i);
                        let q = unpack(ql, qh, h);
                        for r in 0..R {
                            let prod = _mm256_maddubs_epi16(q, bcast4(y[r], 16 * h + 4 * c));
                            p[r] = if c % 2 == 0 { prod } else { _mm256_add_epi16(p[r], prod) };
                        }
                    }
                    for r in 0..R {
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p[r], scale));
                    }
                }
            }
            finish_half(x, half, &y, &s, &sumi, &mut acc);
        }
    }
    out[..R].copy_from_slice(&acc);
}

macro_rules! dispatch { ($rn:expr, $k:ident, $($a:expr),*) => { match $rn {
    1 => $k::<1>($($a),*), 2 => $k::<2>($($a),*), 3 => $k::<3>($($a),*), 4 => $k::<4>($($a),*),
    5 => $k::<5>($($a),*), 6 => $k::<6>($($a),*), 7 => $k::<7>($($a),*), 8 => $k::<8>($($a),*), _ => unreachable!() } } }

fn row_tiles(m: usize, max_r: usize) -> Vec<(usize, usize)> {
    let ntiles = m.div_ceil(max_r);
    let (base, extra) = (m / ntiles, m % ntiles);
    let mut r0 = 0;
    (0..ntiles)
        .map(|t| {
            let rn = base + usize::from(t < extra);
            r0 += rn;
            (r0 - rn, rn)
        })
        .collect()
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kernel {
    K0007,
    Stream,
}

#[allow(clippy::too_many_arguments)]
fn matmul(c: &Config, m: usize, n: usize, nb: usize, acts: &[BlockQ8K], sums: &[[i32; 8]], p: &[Q6KPanel], dst: &mut [f32]) {
    let panels = n / LANES;
    let per = panels.div_ceil(c.threads);
    if c.threads == 1 {
        return matmul_panels(c, m, n, nb, acts, sums, p, dst, 0..panels);
    }
    let dst_ptr = dst.as_mut_ptr() as usize;
    std::thread::scope(|s| {
        for t in 0..c.threads {
            let range = t * per..((t + 1) * per).min(panels);
            s.spawn(move || {
                // Safety: each thread writes its own panels' columns.
                let dst = unsafe { std::slice::from_raw_parts_mut(dst_ptr as *mut f32, m * n) };
                matmul_panels(c, m, n, nb, acts, sums, p, dst, range)
            });
        }
    });
}

#[allow(clippy::too_many_arguments)]
fn matmul_panels(c: &Config, m: usize, n: usize, nb: usize, acts: &[BlockQ8K], sums: &[[i32; 8]], p: &[Q6KPanel], dst: &mut [f32], range: std::ops::Range<usize>) {
    let (kernel, max_r, pf, hint) = (c.kernel, c.max_r, c.pf, c.hint);
    let tiles = row_tiles(m, max_r);
    let mut out: Out = [[unsafe { _mm256_setzero_ps() }; 2]; MAX_TILE];
    for pi in range {
        let ps = &p[pi * nb..(pi + 1) * nb];
        for &(r0, rn) in &tiles {
            unsafe {
                let rk = if c.pad { max_r } else { rn };
                match kernel {
                    Kernel::K0007 => dispatch!(rk, tile_0007, ps, acts, sums, nb, r0, &mut out, pf, hint),
                    Kernel::Stream => dispatch!(rk, tile_stream, ps, acts, sums, nb, r0, &mut out, pf, hint),
                }
            }
            for i in 0..rn {
                let mut v = [0f32; 16];
                unsafe {
                    _mm256_storeu_ps(v.as_mut_ptr(), out[i][0]);
                    _mm256_storeu_ps(v.as_mut_ptr().add(8), out[i][1]);
                }
                dst[(r0 + i) * n + LANES * pi..(r0 + i) * n + LANES * pi + LANES].copy_from_slice(&v);
            }
        }
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let k: usize = args.get(1).map(|s| s.parse().expect("k")).unwrap_or(8960);
    let n: usize = args.get(2).map(|s| s.parse().expect("n")).unwrap_or(1536);
    assert!(k % QK_K == 0 && n % LANES == 0, "k must be a multiple of 256 and n of 16");
    let nb = k / QK_K;
    let mut rng = Rng(0x1234567);
    let panel = |rng: &mut Rng| {
        let mut p: Q6KPanel = unsafe { std::mem::zeroed() };
        p.ql.iter_mut().flatten().chain(p.qh.iter_mut().flatten()).for_each(|b| *b = rng.next() as u8);
        p.scales.iter_mut().flatten().for_each(|s| *s = rng.next() as i8);
        // f16 bits of small positive scales (exponent 1..=10, any mantissa).
        p.d.iter_mut().for_each(|d| *d = (((rng.next() % 10 + 1) << 10) | (rng.next() % 1024)) as u16);
        p
    };
    let panels: Vec<Q6KPanel> = (0..n / LANES * nb).map(|_| panel(&mut rng)).collect();
    let copies = env("COPIES", 1);
    let pss: Vec<Vec<Q6KPanel>> = (0..copies).map(|_| panels.clone()).collect();
    let acts: Vec<BlockQ8K> = (0..MAX_TILE * nb)
        .map(|_| {
            let mut y = BlockQ8K { d: ((rng.next() % 1000) as f32 + 1.0) * 1e-4, qs: [0; 256], bsums: [0; 16] };
            y.qs.iter_mut().for_each(|q| *q = rng.next() as i8);
            for (i, s) in y.bsums.iter_mut().enumerate() {
                *s = y.qs[16 * i..16 * i + 16].iter().map(|&v| v as i16).sum();
            }
            y
        })
        .collect();
    let sums: Vec<[i32; 8]> = acts.iter().map(group_sum_pairs).collect();
    let threads = env("THREADS", 1);
    let configs: Vec<Config> = std::env::var("CONFIGS")
        .unwrap_or_else(|_| "0007:4:2:0,stream:4:2:0".into())
        .split(',')
        .map(|c| {
            let f: Vec<&str> = c.split(':').collect();
            Config {
                kernel: if f[0].starts_with("stream") { Kernel::Stream } else { Kernel::K0007 },
                pad: f[0].ends_with("pad"),
                max_r: f[1].parse().unwrap(),
                pf: f[2].parse().unwrap(),
                hint: f[3].parse().unwrap(),
                threads,
            }
        })
        .collect();
    let runs = env("RUNS", 20);
    println!("Q6_K {n}x{k}, {threads} threads, {copies} copies, best of {runs}, ms (G MAC/s); configs kernel:max rows:prefetch blocks:hint");
    println!("| m | {} |", configs.iter().map(|c| format!("{:?}{}:{}:{}:{}", c.kernel, if c.pad { "pad" } else { "" }, c.max_r, c.pf, c.hint)).collect::<Vec<_>>().join(" | "));
    println!("|---|{}", "---|".repeat(configs.len()));
    for m in std::env::var("MS").unwrap_or_else(|_| "1,2,3,4,5,8".into()).split(',').map(|m| m.parse::<usize>().unwrap()) {
        let mut d: Vec<Vec<f32>> = configs.iter().map(|_| vec![0f32; m * n]).collect();
        let mut t = vec![f64::MAX; configs.len()];
        for it in 0..runs {
            for (ci, c) in configs.iter().enumerate() {
                let s = Instant::now();
                matmul(c, m, n, nb, &acts, &sums, &pss[(it * configs.len() + ci) % copies], &mut d[ci]);
                t[ci] = t[ci].min(s.elapsed().as_secs_f64());
            }
        }
        for ci in 1..configs.len() {
            assert!(d[0].iter().zip(&d[ci]).all(|(a, b)| a.to_bits() == b.to_bits()), "config {ci} disagrees at m = {m}");
        }
        let macs = (m * n * k) as f64;
        println!("| {m} | {} |", t.iter().map(|t| format!("{:.3} ({:.1})", t * 1e3, macs / t / 1e9)).collect::<Vec<_>>().join(" | "));
    }
}

struct Config {
    /// Every tile computes `max_r` rows (the extra ones discarded), to time one code path.
    pad: bool,
    kernel: Kernel,
    max_r: usize,
    pf: usize,
    hint: i32,
    threads: usize,
}
