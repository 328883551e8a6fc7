//! Q4_K x Q8_K over m rows on AVX2: candle-core patch 0001's weight-stationary kernel (a
//! copy, one weight row against up to 8 input rows) against 8-row panels whose 32-value
//! groups are summed in i16 before the scale, and the same on candle-core `0002`'s 16-row
//! panels (`panels16`, what `0006` runs). See README.md.
#![allow(clippy::needless_range_loop)]
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
)))]
compile_error!("an AVX2 probe: build on x86-64 with AVX2, FMA and F16C (the repository's .cargo/config.toml sets target-cpu=native)");

use core::arch::x86_64::*;
use half::f16;
use std::time::Instant;

mod panels16;
mod rates;

const QK_K: usize = 256;
const MAX_TILE: usize = 8;

/// candle's `BlockQ4K` layout.
#[repr(C)]
#[derive(Clone)]
pub struct BlockQ4K {
    d: f16,
    dmin: f16,
    scales: [u8; 12],
    qs: [u8; 128],
}
/// candle's `BlockQ8K` layout.
#[repr(C)]
#[derive(Clone)]
pub struct BlockQ8K {
    d: f32,
    qs: [i8; 256],
    bsums: [i16; 16],
}
#[inline(always)]
unsafe fn hsum_float_8(x: __m256) -> f32 {
    let res = _mm256_extractf128_ps(x, 1);
    let res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    let res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    let res = _mm_add_ss(res, _mm_movehdup_ps(res));
    _mm_cvtss_f32(res)
}
#[inline(always)]
unsafe fn bcast_i16_ctrl(i: i32) -> __m256i {
    _mm256_set1_epi16((((2 * i + 1) << 8) | (2 * i)) as i16)
}

struct Q8KActs<'a> {
    qs: &'a [BlockQ8K],
    m: usize,
    nb: usize,
    d: Vec<f32>,
    nd4: Vec<[f32; 4]>,
    bsums2: Vec<[i16; 8]>,
}
impl<'a> Q8KActs<'a> {
    fn new(qs: &'a [BlockQ8K], m: usize, nb: usize) -> Self {
        let len = m * nb + 1;
        let mut d = vec![0f32; len];
        let mut nd4 = vec![[0f32; 4]; len];
        let mut bsums2 = vec![[0i16; 8]; len];
        for r in 0..m {
            for b in 0..nb {
                let y = &qs[r * nb + b];
                let i = b * m + r;
                d[i] = y.d;
                nd4[i] = [-y.d; 4];
                for (j, s) in bsums2[i].iter_mut().enumerate() {
                    *s = y.bsums[2 * j].wrapping_add(y.bsums[2 * j + 1]);
                }
            }
        }
        Self {
            qs,
            m,
            nb,
            d,
            nd4,
            bsums2,
        }
    }
    #[inline(always)]
    fn idx(&self, b: usize, r: usize) -> usize {
        b * self.m + r
    }
    #[inline(always)]
    unsafe fn q8(&self, b: usize, r: usize) -> *const i8 {
        self.qs.get_unchecked(r * self.nb + b).qs.as_ptr()
    }
}

#[inline(always)]
unsafe fn q4k_values(x: &BlockQ4K) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0xF);
    let mut v = [_mm256_setzero_si256(); 8];
    for j in 0..4 {
        let bits = _mm256_loadu_si256(x.qs.as_ptr().add(32 * j) as *const __m256i);
        v[2 * j] = _mm256_and_si256(bits, m4);
        v[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
    }
    v
}
#[inline(always)]
unsafe fn q4k_scales_mins(x: &BlockQ4K) -> (__m256i, __m128i) {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let s = &x.scales;
    let u0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let u1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let u2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    let t3 = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let t2 = u1 & KMASK1;
    let t1 = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let t0 = u0 & KMASK1;
    let ms = _mm256_cvtepu8_epi16(_mm_set_epi32(t3 as i32, t2 as i32, t1 as i32, t0 as i32));
    let sc128 = _mm256_castsi256_si128(ms);
    let scales = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(sc128), sc128);
    (scales, _mm256_extracti128_si256::<1>(ms))
}

// ---------------- candle-core patch 0001's AVX2 Q4K kernel (a copy) ----------------
#[inline(always)]
unsafe fn k_block_rows<const R: usize>(
    w: &[__m256i; 8],
    sc: &[__m256i; 8],
    q8: &[*const i8; R],
    sumi: &mut [__m256i; R],
) {
    for g in 0..8 {
        for r in 0..R {
            let y = _mm256_loadu_si256(q8[r].add(32 * g) as *const __m256i);
            let p = _mm256_madd_epi16(sc[g], _mm256_maddubs_epi16(w[g], y));
            sumi[r] = _mm256_add_epi32(sumi[r], p);
        }
    }
}
#[inline(always)]
unsafe fn k_block<const R: usize>(
    w: &[__m256i; 8],
    sc: &[__m256i; 8],
    acts: &Q8KActs,
    b: usize,
    r0: usize,
    sumi: &mut [__m256i; R],
) {
    let mut c0 = 0;
    while c0 < R {
        let c = usize::min(4, R - c0);
        macro_rules! chunk {
            ($c:literal) => {{
                let q8: [*const i8; $c] = std::array::from_fn(|i| acts.q8(b, r0 + c0 + i));
                let mut s: [__m256i; $c] = std::array::from_fn(|i| sumi[c0 + i]);
                k_block_rows::<$c>(w, sc, &q8, &mut s);
                sumi[c0..c0 + $c].copy_from_slice(&s);
            }};
        }
        match c {
            4 => chunk!(4),
            3 => chunk!(3),
            2 => chunk!(2),
            _ => chunk!(1),
        }
        c0 += c;
    }
}
#[inline(always)]
unsafe fn finish<const R: usize>(
    acc: &[__m256; R],
    acc_m: &[__m256; MAX_TILE / 2],
    out: &mut [f32],
) {
    for r in 0..R {
        let am = if r % 2 == 0 {
            _mm256_castps256_ps128(acc_m[r / 2])
        } else {
            _mm256_extractf128_ps::<1>(acc_m[r / 2])
        };
        let am = _mm_add_ps(am, _mm_movehl_ps(am, am));
        let am = _mm_add_ss(am, _mm_movehdup_ps(am));
        out[r] = hsum_float_8(acc[r]) + _mm_cvtss_f32(am);
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn q4k_tile_ws<const R: usize>(w: &[BlockQ4K], acts: &Q8KActs, r0: usize, out: &mut [f32]) {
    let nb = acts.nb;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_m = [_mm256_setzero_ps(); MAX_TILE / 2];
    let pf = prefetch_bytes();
    for (b, x) in w[..nb].iter().enumerate() {
        if pf > 0 {
            let base = (x as *const BlockQ4K as *const i8).wrapping_add(pf);
            _mm_prefetch::<_MM_HINT_T0>(base);
            _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(64));
            _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(128));
        }
        let (scales, mins) = q4k_scales_mins(x);
        let mins2 = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(mins), mins);
        let xd = _mm256_set1_ps(x.d.to_f32());
        let xdmin = _mm256_set1_ps(x.dmin.to_f32());
        let i0 = acts.idx(b, r0);
        for p in 0..R.div_ceil(2) {
            let s = _mm256_loadu_si256(acts.bsums2.as_ptr().add(i0 + 2 * p) as *const __m256i);
            let prod = _mm256_madd_epi16(mins2, s);
            let dmin = _mm256_mul_ps(xdmin, _mm256_loadu_ps(acts.nd4[i0 + 2 * p].as_ptr()));
            acc_m[p] = _mm256_fmadd_ps(dmin, _mm256_cvtepi32_ps(prod), acc_m[p]);
        }
        let wq = q4k_values(x);
        let sc: [__m256i; 8] =
            std::array::from_fn(|g| _mm256_shuffle_epi8(scales, bcast_i16_ctrl(g as i32)));
        let mut sumi = [_mm256_setzero_si256(); R];
        k_block::<R>(&wq, &sc, acts, b, r0, &mut sumi);
        for r in 0..R {
            let d = _mm256_mul_ps(xd, _mm256_broadcast_ss(acts.d.get_unchecked(i0 + r)));
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    finish::<R>(&acc, &acc_m, out);
}

// ---------------- AVX2 panels of 8 weight rows, i16 sums over each 32-value group ----------------
/// One Q4K block of 8 weight rows. `qs[g][v]`: lane L byte i = row L's value 32g+4v+i (low
/// nibble) and 32g+4(v+4)+i (high nibble). `scales[g][L]`, `mins[g][L]` the 6-bit values.
#[repr(C, align(32))]
#[derive(Clone)]
pub struct PanelQ4K {
    qs: [[[u8; 32]; 4]; 8],
    scales: [[u8; 8]; 8],
    mins: [[u8; 8]; 8],
    d: [f16; 8],
    dmin: [f16; 8],
}

fn unpack_scales_mins(x: &BlockQ4K) -> ([u8; 8], [u8; 8]) {
    let q = &x.scales;
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        if j < 4 {
            sc[j] = q[j] & 63;
            mn[j] = q[j + 4] & 63;
        } else {
            sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
            mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }
    (sc, mn)
}
fn q4k_value(x: &BlockQ4K, i: usize) -> u8 {
    // element order of q4k_values: register g = 32 values of group g; j = g/2 chunk of 32 bytes
    let g = i / 32;
    let within = i % 32;
    let byte = x.qs[32 * (g / 2) + within];
    if g % 2 == 0 {
        byte & 0xF
    } else {
        byte >> 4
    }
}
fn repack(w: &[BlockQ4K], n: usize, nb: usize) -> Vec<PanelQ4K> {
    assert!(n % 8 == 0);
    let mut out = Vec::with_capacity(n / 8 * nb);
    for p in 0..n / 8 {
        for b in 0..nb {
            let mut pb = PanelQ4K {
                qs: [[[0; 32]; 4]; 8],
                scales: [[0; 8]; 8],
                mins: [[0; 8]; 8],
                d: [f16::ZERO; 8],
                dmin: [f16::ZERO; 8],
            };
            for l in 0..8 {
                let x = &w[(8 * p + l) * nb + b];
                let (sc, mn) = unpack_scales_mins(x);
                for g in 0..8 {
                    pb.scales[g][l] = sc[g];
                    pb.mins[g][l] = mn[g];
                    for v in 0..4 {
                        for i in 0..4 {
                            let lo = q4k_value(x, 32 * g + 4 * v + i);
                            let hi = q4k_value(x, 32 * g + 4 * (v + 4) + i);
                            pb.qs[g][v][4 * l + i] = lo | (hi << 4);
                        }
                    }
                }
                pb.d[l] = x.d;
                pb.dmin[l] = x.dmin;
            }
            out.push(pb);
        }
    }
    out
}

static SC_PAIR_CTRL: [u8; 32] = {
    // lane L (i32): bytes [L, 0x80, L, 0x80] of the 8 broadcast bytes (L within its half: +0 or +4)
    let mut t = [0x80u8; 32];
    let mut l = 0;
    while l < 8 {
        t[4 * l] = l as u8;
        t[4 * l + 2] = l as u8;
        l += 1;
    }
    t
};
static MIN_PAIR_CTRL: [u8; 32] = {
    // lane L: [L, 0x80, 8 + L, 0x80] of 16 broadcast bytes (min_{2p}[0..8], min_{2p+1}[0..8])
    let mut t = [0x80u8; 32];
    let mut l = 0;
    while l < 8 {
        t[4 * l] = l as u8;
        t[4 * l + 2] = 8 + l as u8;
        l += 1;
    }
    t
};

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_tile<const R: usize>(
    panels: &[PanelQ4K],
    acts: &Q8KActs,
    r0: usize,
    out: &mut [[f32; 8]; 4],
) {
    let nb = acts.nb;
    let m4 = _mm256_set1_epi8(0xF);
    let sc_ctrl = _mm256_loadu_si256(SC_PAIR_CTRL.as_ptr() as *const __m256i);
    let mn_ctrl = _mm256_loadu_si256(MIN_PAIR_CTRL.as_ptr() as *const __m256i);
    let mut accf = [_mm256_setzero_ps(); R];
    let pf = prefetch_bytes();
    for b in 0..nb {
        let pb = panels.get_unchecked(b);
        let q8: [*const i8; R] = std::array::from_fn(|i| acts.q8(b, r0 + i));
        let mut acc32 = [_mm256_setzero_si256(); R];
        for g in 0..8 {
            if pf > 0 {
                let base = (pb as *const PanelQ4K as *const i8).wrapping_add(pf + 160 * g);
                _mm_prefetch::<_MM_HINT_T0>(base);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(64));
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(128));
            }
            let mut acc16 = [_mm256_setzero_si256(); R];
            for v in 0..4 {
                let bits = _mm256_load_si256(pb.qs[g][v].as_ptr() as *const __m256i);
                let lo = _mm256_and_si256(bits, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
                for r in 0..R {
                    let ylo = _mm256_set1_epi32(
                        (q8[r].add(32 * g + 4 * v) as *const i32).read_unaligned(),
                    );
                    let yhi = _mm256_set1_epi32(
                        (q8[r].add(32 * g + 4 * (v + 4)) as *const i32).read_unaligned(),
                    );
                    acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(lo, ylo));
                    acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(hi, yhi));
                }
            }
            let sc = _mm256_shuffle_epi8(
                _mm256_set1_epi64x((pb.scales[g].as_ptr() as *const i64).read_unaligned()),
                sc_ctrl,
            );
            for r in 0..R {
                acc32[r] = _mm256_add_epi32(acc32[r], _mm256_madd_epi16(acc16[r], sc));
            }
        }
        // mins: sum_g min_g[L] * bsum_g(r)
        let mut accm = [_mm256_setzero_si256(); R];
        for p in 0..4 {
            let mb = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                pb.mins[2 * p].as_ptr() as *const __m128i
            ));
            let mv = _mm256_shuffle_epi8(mb, mn_ctrl);
            for r in 0..R {
                let bs = &acts.bsums2[acts.idx(b, r0 + r)];
                let pair = (bs[2 * p] as u16 as u32 | ((bs[2 * p + 1] as u16 as u32) << 16)) as i32;
                accm[r] = _mm256_add_epi32(accm[r], _mm256_madd_epi16(mv, _mm256_set1_epi32(pair)));
            }
        }
        let d = _mm256_cvtph_ps(_mm_loadu_si128(pb.d.as_ptr() as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(pb.dmin.as_ptr() as *const __m128i));
        for r in 0..R {
            let yd = _mm256_broadcast_ss(acts.d.get_unchecked(acts.idx(b, r0 + r)));
            accf[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(acc32[r]), accf[r]);
            accf[r] = _mm256_fnmadd_ps(
                _mm256_mul_ps(dmin, yd),
                _mm256_cvtepi32_ps(accm[r]),
                accf[r],
            );
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(out[r].as_mut_ptr(), accf[r]);
    }
}

fn mm_panels(m: usize, n: usize, nb: usize, acts: &Q8KActs, p: &[PanelQ4K], dst: &mut [f32]) {
    let tiles = row_tiles(m, 4);
    let mut out = [[0f32; 8]; 4];
    for pi in 0..n / 8 {
        for &(r0, rn) in &tiles {
            let ps = &p[pi * nb..(pi + 1) * nb];
            unsafe {
                match rn {
                    1 => panel_tile::<1>(ps, acts, r0, &mut out),
                    2 => panel_tile::<2>(ps, acts, r0, &mut out),
                    3 => panel_tile::<3>(ps, acts, r0, &mut out),
                    4 => panel_tile::<4>(ps, acts, r0, &mut out),
                    _ => unreachable!(),
                }
            }
            for i in 0..rn {
                dst[(r0 + i) * n + 8 * pi..(r0 + i) * n + 8 * pi + 8].copy_from_slice(&out[i]);
            }
        }
    }
}

// ---------------- drivers (single thread) ----------------
fn row_tiles(m: usize, max_r: usize) -> Vec<(usize, usize)> {
    let ntiles = m.div_ceil(max_r);
    let base = m / ntiles;
    let extra = m % ntiles;
    let mut v = vec![];
    let mut r0 = 0;
    for t in 0..ntiles {
        let rn = base + usize::from(t < extra);
        v.push((r0, rn));
        r0 += rn;
    }
    v
}
macro_rules! dispatch { ($rn:expr, $k:ident, $($a:expr),*) => { match $rn {
    1 => $k::<1>($($a),*), 2 => $k::<2>($($a),*), 3 => $k::<3>($($a),*), 4 => $k::<4>($($a),*),
    5 => $k::<5>($($a),*), 6 => $k::<6>($($a),*), 7 => $k::<7>($($a),*), 8 => $k::<8>($($a),*), _ => unreachable!() } } }

fn mm_old(m: usize, n: usize, nb: usize, acts: &Q8KActs, w: &[BlockQ4K], dst: &mut [f32]) {
    let tiles = row_tiles(m, MAX_TILE);
    let mut out = [0f32; MAX_TILE];
    for col in 0..n {
        for &(r0, rn) in &tiles {
            let wr = &w[col * nb..(col + 1) * nb];
            unsafe { dispatch!(rn, q4k_tile_ws, wr, acts, r0, &mut out) }
            for i in 0..rn {
                dst[(r0 + i) * n + col] = out[i];
            }
        }
    }
}
fn prefetch_bytes() -> usize {
    static PF: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PF.get_or_init(|| std::env::var("PREFETCH").ok().and_then(|v| v.parse().ok()).unwrap_or(0))
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

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let k: usize = args.get(1).map(|s| s.parse().expect("k")).unwrap_or(1536);
    let n: usize = args.get(2).map(|s| s.parse().expect("n")).unwrap_or(8960);
    assert!(
        k % QK_K == 0 && n % 8 == 0,
        "k must be a multiple of 256 and n of 8"
    );
    rates::print();
    let nb = k / QK_K;
    let mut rng = Rng(0x1234567);
    let w: Vec<BlockQ4K> = (0..n * nb)
        .map(|_| {
            let mut b = BlockQ4K {
                d: f16::from_f32(((rng.next() % 1000) as f32 + 1.0) * 1e-5),
                dmin: f16::from_f32(((rng.next() % 1000) as f32) * 1e-5),
                scales: [0; 12],
                qs: [0; 128],
            };
            b.scales
                .iter_mut()
                .chain(b.qs.iter_mut())
                .for_each(|s| *s = rng.next() as u8);
            b
        })
        .collect();
    let panels = repack(&w, n, nb);
    // Copies enough to overflow the last-level cache, so every timed run streams from memory
    // as a model's weights do.
    let copies: usize = std::env::var("COPIES").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let ws: Vec<Vec<BlockQ4K>> = (0..copies).map(|_| w.clone()).collect();
    let pss: Vec<Vec<PanelQ4K>> = (0..copies).map(|_| panels.clone()).collect();
    let p16 = panels16::repack(&w, n, nb);
    let p16s: Vec<Vec<panels16::Q4KPanel>> = (0..copies).map(|_| p16.clone()).collect();
    let max_r16: usize = std::env::var("MAXR16").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    // Optional: the 16-row panels timed again, interleaved, with tiles of at most this many rows.
    let max_r16b: Option<usize> = std::env::var("MAXR16B").ok().and_then(|v| v.parse().ok());
    let lhs: Vec<BlockQ8K> = (0..MAX_TILE * nb)
        .map(|_| {
            let mut y = BlockQ8K {
                d: ((rng.next() % 1000) as f32 + 1.0) * 1e-4,
                qs: [0; 256],
                bsums: [0; 16],
            };
            y.qs.iter_mut()
                .for_each(|q| *q = ((rng.next() % 256) as i32 - 128) as i8);
            for (i, s) in y.bsums.iter_mut().enumerate() {
                *s = y.qs[16 * i..16 * i + 16].iter().map(|&v| v as i16).sum();
            }
            y
        })
        .collect();
    println!("Q4_K {n}x{k}, one thread, best of 20:");
    println!(
        "| m | patch 0001 ms | G MAC/s | panels ms | G MAC/s | speed-up | max |diff| / max |out| |"
    );
    println!("|---|---|---|---|---|---|---|");
    for m in [1usize, 2, 3, 4, 5, 6, 8] {
        let acts = Q8KActs::new(&lhs[..m * nb], m, nb);
        let (mut d_ws, mut d_panel) = (vec![0f32; m * n], vec![0f32; m * n]);
        let (mut t_ws, mut t_panel, mut t16) = (f64::MAX, f64::MAX, f64::MAX);
        let mut d16 = vec![0f32; m * n];
        let (mut d16b, mut t16b) = (vec![0f32; m * n], f64::MAX);
        for it in 0..20 {
            if let Some(max_r) = max_r16b {
                let s = Instant::now();
                panels16::matmul(m, n, nb, &lhs[..m * nb], &p16s[(it + 1) % copies], &mut d16b, max_r);
                t16b = t16b.min(s.elapsed().as_secs_f64());
            }
            let s = Instant::now();
            panels16::matmul(m, n, nb, &lhs[..m * nb], &p16s[it % copies], &mut d16, max_r16);
            t16 = t16.min(s.elapsed().as_secs_f64());
            let s = Instant::now();
            mm_old(m, n, nb, &acts, &ws[it % copies], &mut d_ws);
            t_ws = t_ws.min(s.elapsed().as_secs_f64());
            let s = Instant::now();
            mm_panels(m, n, nb, &acts, &pss[it % copies], &mut d_panel);
            t_panel = t_panel.min(s.elapsed().as_secs_f64());
        }
        let max_out = d_ws.iter().fold(0f32, |a, v| a.max(v.abs()));
        let max_diff = d_ws
            .iter()
            .zip(&d_panel)
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        assert!(
            max_diff <= 1e-5 * max_out,
            "panels disagree with the patch kernel at m = {m}"
        );
        let diff16 = d_ws.iter().zip(&d16).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        assert!(diff16 <= 1e-5 * max_out, "16-row panels disagree at m = {m}: {diff16} vs {max_out}");
        let macs = (m * n * k) as f64;
        if let Some(max_r) = max_r16b {
            assert!(d16.iter().zip(&d16b).all(|(a, b)| a.to_bits() == b.to_bits()), "16-row panels change with the tiles at m = {m}");
            println!("  m {m}: 16-row panels, tiles of ≤ {max_r} rows: {:.3} ms, {:.1} G MAC/s, {:.2}x tiles of ≤ {max_r16}", t16b * 1e3, macs / t16b / 1e9, t16 / t16b);
        }
        println!("  m {m}: 16-row panels {:.3} ms, {:.1} G MAC/s, {:.2}x the patch kernel", t16 * 1e3, macs / t16 / 1e9, t_ws / t16);
        println!(
            "| {m} | {:.3} | {:.1} | {:.3} | {:.1} | {:.2}x | {:.1e} |",
            t_ws * 1e3,
            macs / t_ws / 1e9,
            t_panel * 1e3,
            macs / t_panel / 1e9,
            t_ws / t_panel,
            max_diff / max_out
        );
    }
}
