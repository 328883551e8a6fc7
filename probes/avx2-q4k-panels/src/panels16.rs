//! The VNNI kernels' 16-row Q4_K panels (candle-core patch `0002`'s layout) multiplied with
//! AVX2: each 64-byte register of the panel is two 32-byte halves of 8 weight rows, and each
//! 32-value group of a half is summed in i16 (8 `vpmaddubsw` + `vpaddw` per input row) before
//! one `vpmaddwd` applies the rows' scales. The integer sums are the VNNI kernel's, and so are
//! the f32 operations per lane, so the outputs are the same bits.
use super::{BlockQ4K, BlockQ8K, QK_K};
use core::arch::x86_64::*;

const LANES: usize = 16;

/// One Q4K block (256 values) of 16 weight rows, as in candle-core patch `0002`.
#[repr(C, align(64))]
#[derive(Clone)]
pub struct Q4KPanel {
    qs: [[u8; 64]; 32],
    scales: [[u8; 16]; 8],
    mins: [[u8; 32]; 4],
    d: [u16; LANES],
    dmin: [u16; LANES],
}

fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn q4k_panel(out: &mut Q4KPanel, lane: usize, x: &BlockQ4K) {
    let q: [u8; QK_K] = std::array::from_fn(|v| {
        let byte = x.qs[32 * (v / 64) + v % 32];
        if v % 64 < 32 {
            byte & 0xF
        } else {
            byte >> 4
        }
    });
    for g in 0..8 {
        let (scale, min) = get_scale_min_k4(g, &x.scales);
        out.scales[g][lane] = scale;
        out.mins[g / 2][2 * lane + g % 2] = min;
        for c in 0..4 {
            for t in 0..4 {
                let v = 32 * g + 4 * c + t;
                out.qs[4 * g + c][4 * lane + t] = q[v] | (q[v + 16] << 4);
            }
        }
    }
    out.d[lane] = x.d.to_bits();
    out.dmin[lane] = x.dmin.to_bits();
}

pub fn repack(w: &[BlockQ4K], n: usize, nb: usize) -> Vec<Q4KPanel> {
    (0..n.div_ceil(LANES) * nb)
        .map(|i| {
            let (p, b) = (i / nb, i % nb);
            let mut out: Q4KPanel = unsafe { std::mem::zeroed() };
            for lane in 0..LANES.min(n - p * LANES) {
                q4k_panel(&mut out, lane, &w[(p * LANES + lane) * nb + b])
            }
            out
        })
        .collect()
}

fn group_sum_pairs(y: &BlockQ8K) -> [i32; 4] {
    std::array::from_fn(|j| {
        let sum = |g: usize| (y.bsums[2 * g] + y.bsums[2 * g + 1]) as u16 as u32;
        (sum(2 * j) | (sum(2 * j + 1) << 16)) as i32
    })
}

#[inline(always)]
unsafe fn bcast4(y: &BlockQ8K, i: usize) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(y.qs.as_ptr().add(i) as *const i32))
}

fn prefetch_bytes() -> usize {
    static PF: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PF.get_or_init(|| std::env::var("PREFETCH16").ok().and_then(|v| v.parse().ok()).unwrap_or(4736))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize>(
    w: &[Q4KPanel],
    acts: &[BlockQ8K],
    sums: &[[i32; 4]],
    nb: usize,
    r0: usize,
    out: &mut [[__m256; 2]; 8],
) {
    let nibble = _mm256_set1_epi8(0xF);
    let pf = prefetch_bytes();
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for (b, x) in w.iter().enumerate() {
        let ahead = (x as *const Q4KPanel as *const i8).wrapping_add(pf);
        let y: [&BlockQ8K; R] = std::array::from_fn(|r| acts.get_unchecked((r0 + r) * nb + b));
        for h in 0..2 {
            let mut sumi = [_mm256_setzero_si256(); R];
            for g in 0..8 {
                if pf > 0 && h == 0 {
                    // 37 lines a panel block, 5 requested per group.
                    for l in 0..5 {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * (5 * g + l)));
                    }
                }
                let mut acc16 = [_mm256_setzero_si256(); R];
                for c in 0..4 {
                    let bits = _mm256_load_si256(x.qs[4 * g + c].as_ptr().add(32 * h) as *const __m256i);
                    let lo = _mm256_and_si256(bits, nibble);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), nibble);
                    for r in 0..R {
                        // |pair| ≤ 2·15·128, 8 pairs a lane per group: fits in i16.
                        acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(lo, bcast4(y[r], 32 * g + 4 * c)));
                        acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(hi, bcast4(y[r], 32 * g + 16 + 4 * c)));
                    }
                }
                let s8 = _mm_loadl_epi64(x.scales[g].as_ptr().add(8 * h) as *const __m128i);
                let scale = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8));
                for r in 0..R {
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(acc16[r], scale));
                }
            }
            let mins: [__m256i; 4] = std::array::from_fn(|j| {
                _mm256_cvtepu8_epi16(_mm_load_si128(x.mins[j].as_ptr().add(16 * h) as *const __m128i))
            });
            let d = _mm256_cvtph_ps(_mm_load_si128(x.d.as_ptr().add(8 * h) as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_load_si128(x.dmin.as_ptr().add(8 * h) as *const __m128i));
            for r in 0..R {
                let s = sums.get_unchecked((r0 + r) * nb + b);
                let mut summ = _mm256_setzero_si256();
                for j in 0..4 {
                    summ = _mm256_add_epi32(summ, _mm256_madd_epi16(mins[j], _mm256_set1_epi32(s[j])));
                }
                let dy = _mm256_set1_ps(y[r].d);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(d, dy), acc[r][h]);
                acc[r][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(dmin, dy), acc[r][h]);
            }
        }
    }
    out[..R].copy_from_slice(&acc);
}

pub fn matmul(m: usize, n: usize, nb: usize, acts: &[BlockQ8K], p: &[Q4KPanel], dst: &mut [f32], max_r: usize) {
    let sums: Vec<[i32; 4]> = acts.iter().map(group_sum_pairs).collect();
    let tiles = super::row_tiles(m, max_r);
    let mut out = [[unsafe { _mm256_setzero_ps() }; 2]; 8];
    for pi in 0..n.div_ceil(LANES) {
        let ps = &p[pi * nb..(pi + 1) * nb];
        for &(r0, rn) in &tiles {
            unsafe {
                match rn {
                    1 => tile::<1>(ps, acts, &sums, nb, r0, &mut out),
                    2 => tile::<2>(ps, acts, &sums, nb, r0, &mut out),
                    3 => tile::<3>(ps, acts, &sums, nb, r0, &mut out),
                    4 => tile::<4>(ps, acts, &sums, nb, r0, &mut out),
                    5 => tile::<5>(ps, acts, &sums, nb, r0, &mut out),
                    6 => tile::<6>(ps, acts, &sums, nb, r0, &mut out),
                    7 => tile::<7>(ps, acts, &sums, nb, r0, &mut out),
                    8 => tile::<8>(ps, acts, &sums, nb, r0, &mut out),
                    _ => unreachable!(),
                }
            }
            for i in 0..rn {
                let mut v = [0f32; 16];
                unsafe {
                    _mm256_storeu_ps(v.as_mut_ptr(), out[i][0]);
                    _mm256_storeu_ps(v.as_mut_ptr().add(8), out[i][1]);
                }
                let valid = LANES.min(n - pi * LANES);
                dst[(r0 + i) * n + LANES * pi..(r0 + i) * n + LANES * pi + valid].copy_from_slice(&v[..valid]);
            }
        }
    }
}
