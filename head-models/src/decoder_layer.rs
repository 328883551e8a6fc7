//! The decoder-layer pieces EAGLE heads share: attention with its cache and RoPE (and the
//! unrolled attention of EAGLE-3's training-time test), RMS norm, SwiGLU MLP, and opening
//! a checkpoint folder (its `config.json`, its weights in either file format).

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::VarBuilder;

use crate::projection::{projection, Projection, WeightFormat};

/// Widths of an attention block: `input` columns in (2H for EAGLE-3's midlayer, H for
/// EAGLE-1's layer), `output` columns out.
pub struct AttentionShape {
    pub input: usize,
    pub output: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    /// Biases on q/k/v (EAGLE-1 heads for Qwen2 targets have them; EAGLE-3 midlayers never).
    pub qkv_bias: bool,
}

/// `dir/config.json` read as a `kind` head's config ("EAGLE-3").
pub fn read_config<T: serde::de::DeserializeOwned>(dir: &Path, kind: &str) -> Result<T> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not an {kind} config", path.display()))
}

/// The weights of a head folder: `model.safetensors`, else `pytorch_model.bin` (the
/// reference's PyTorch checkpoints), as f32.
pub fn open_weights(dir: &Path, device: &Device) -> Result<VarBuilder<'static>> {
    let safetensors = dir.join("model.safetensors");
    let pickle = dir.join("pytorch_model.bin");
    if safetensors.is_file() {
        // SAFETY: the file is mapped read-only and not modified while the head lives.
        Ok(unsafe { VarBuilder::from_mmaped_safetensors(&[&safetensors], DType::F32, device)? })
    } else if pickle.is_file() {
        Ok(VarBuilder::from_pth(&pickle, DType::F32, device)?)
    } else {
        bail!("{} holds neither model.safetensors nor pytorch_model.bin", dir.display());
    }
}

/// The head's attention cache: keys and values of every position it has seen, (kv heads,
/// positions, head dim) each.
#[derive(Clone, Debug, Default)]
pub struct HeadCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
}

impl HeadCache {
    pub fn len(&self) -> usize {
        self.k.as_ref().map_or(0, |k| k.dim(1).unwrap_or(0))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A cache holding keys `k` and values `v`, (kv heads, positions, head dim) each.
    pub fn from_tensors(k: Tensor, v: Tensor) -> Result<Self> {
        ensure!(k.rank() == 3 && k.dims() == v.dims(), "head cache keys {:?} and values {:?} are not (kv heads, positions, head dim) alike", k.dims(), v.dims());
        Ok(Self { k: Some(k), v: Some(v) })
    }

    /// The keys, (kv heads, positions, head dim), if any position is held.
    pub fn keys(&self) -> Option<&Tensor> {
        self.k.as_ref()
    }

    /// Bytes of the positions held (a truncated cache may keep a larger storage alive until
    /// [`Self::compacted`]).
    pub fn bytes(&self) -> usize {
        [&self.k, &self.v]
            .into_iter()
            .flatten()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// The same positions in storage of their own, exactly as large as they are: for keeping
    /// the cache after its sequence ends.
    pub fn compacted(&self) -> Result<Self> {
        let copy = |t: &Option<Tensor>| t.as_ref().map(Tensor::force_contiguous).transpose();
        Ok(Self {
            k: copy(&self.k)?,
            v: copy(&self.v)?,
        })
    }

    /// Forget every position from `len` on (rejected drafts, draft steps after a verify).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.len() {
            return Ok(());
        }
        if len == 0 {
            *self = Self::default();
            return Ok(());
        }
        self.k = Some(self.k.as_ref().unwrap().narrow(1, 0, len)?);
        self.v = Some(self.v.as_ref().unwrap().narrow(1, 0, len)?);
        Ok(())
    }

    fn append(&mut self, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = match (&self.k, &self.v) {
            (Some(pk), Some(pv)) => (Tensor::cat(&[pk, &k], 1)?, Tensor::cat(&[pv, &v], 1)?),
            _ => (k, v),
        };
        self.k = Some(k.clone());
        self.v = Some(v.clone());
        Ok((k, v))
    }
}

/// One sequence's rows in a batched call ([`Attention::forward_segments`]): `rows`
/// consecutive input rows at positions `start..start + rows`, attending to `cache` (which
/// must hold exactly `start` positions) and appended to it.
pub struct CacheSegment<'a> {
    pub start: usize,
    pub rows: usize,
    pub cache: &'a mut HeadCache,
}

/// Which rows of each segment a batched call computes outputs for. Every row's keys and
/// values enter the cache either way; a commit drafts only from its last row, so the rows
/// before it need no query, no MLP and no LM head (on a prompt, most of the layer's work).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outputs {
    EveryRow,
    LastRow,
}

impl Outputs {
    /// How many of a segment's `rows` get outputs (its last ones).
    fn of(self, rows: usize) -> usize {
        match self {
            Outputs::EveryRow => rows,
            Outputs::LastRow => rows.min(1),
        }
    }

    /// The rows of `t` (each segment's rows in turn) that get outputs.
    pub fn select(self, t: &Tensor, segments: &[CacheSegment<'_>]) -> Result<Tensor> {
        if self == Outputs::EveryRow {
            return Ok(t.clone());
        }
        let mut picked = Vec::with_capacity(segments.len());
        let mut row = 0;
        for segment in segments {
            let n = self.of(segment.rows);
            picked.push(t.narrow(0, row + segment.rows - n, n)?);
            row += segment.rows;
        }
        Ok(Tensor::cat(&picked, 0)?)
    }
}

/// The midlayer's attention: q/k/v over [normed embedding ⊕ normed hidden] (2H), RoPE.
pub struct Attention {
    q_proj: Projection,
    k_proj: Projection,
    v_proj: Projection,
    o_proj: Projection,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rope_theta: f64,
}

impl Attention {
    /// Store q/k/v/o as `format` (drafting only).
    pub fn quantize(&mut self, format: WeightFormat) -> Result<()> {
        for p in [&mut self.q_proj, &mut self.k_proj, &mut self.v_proj, &mut self.o_proj] {
            p.quantize(format)?;
        }
        Ok(())
    }

    pub fn new(shape: &AttentionShape, vb: VarBuilder) -> Result<Self> {
        let s = shape;
        let qkv = |rows: usize, name: &str| projection(s.input, rows, s.qkv_bias, vb.pp(name));
        Ok(Self {
            q_proj: qkv(s.heads * s.head_dim, "q_proj")?,
            k_proj: qkv(s.kv_heads * s.head_dim, "k_proj")?,
            v_proj: qkv(s.kv_heads * s.head_dim, "v_proj")?,
            o_proj: projection(s.heads * s.head_dim, s.output, false, vb.pp("o_proj"))?,
            heads: s.heads,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            rope_theta: s.rope_theta,
        })
    }

    /// (cos, sin) for `t` positions from `start`, (t, head_dim / 2) each.
    fn rope_tables(&self, start: usize, t: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / self.head_dim as f64) as f32)
            .collect();
        let inv_freq = Tensor::from_vec(inv_freq, (1, half), device)?;
        let positions: Vec<f32> = (start..start + t).map(|p| p as f32).collect();
        let positions = Tensor::from_vec(positions, (t, 1), device)?;
        let angles = positions.broadcast_mul(&inv_freq)?;
        Ok((angles.cos()?, angles.sin()?))
    }

    /// q (heads, t, hd) and k, v (kv heads, t, hd) of `x` (t, 2H) at positions
    /// `start..start + t`, RoPE applied.
    fn project(&self, x: &Tensor, start: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = (self.q_proj.forward(x)?, self.k_proj.forward(x)?, self.v_proj.forward(x)?);
        self.split_heads(&q, &k, &v, start)
    }

    /// Projected rows `(t, heads · hd)` split into heads at positions `start..start + t`,
    /// RoPE applied to q and k.
    fn split_heads(&self, q: &Tensor, k: &Tensor, v: &Tensor, start: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let rope = self.rope_tables(start, q.dim(0)?, q.device())?;
        Ok((
            self.heads_at(q, self.heads, Some(&rope))?,
            self.heads_at(k, self.kv_heads, Some(&rope))?,
            self.heads_at(v, self.kv_heads, None)?,
        ))
    }

    /// Projected rows `(t, heads · hd)` as `(heads, t, hd)`, RoPE applied with `rope`'s
    /// (cos, sin) of their positions when given.
    fn heads_at(&self, y: &Tensor, heads: usize, rope: Option<&(Tensor, Tensor)>) -> Result<Tensor> {
        let t = y.dim(0)?;
        let y = y.reshape((1, t, heads, self.head_dim))?.transpose(1, 2)?.contiguous()?;
        let y = match rope {
            Some((cos, sin)) => candle_nn::rotary_emb::rope_slow(&y, cos, sin)?,
            None => y,
        };
        Ok(y.squeeze(0)?)
    }

    /// Keys or values of the kv heads repeated for every query head: (heads, len, hd).
    fn expand(&self, y: &Tensor) -> Result<Tensor> {
        let (kv_heads, len, hd) = y.dims3()?;
        let repeat = self.heads / kv_heads;
        Ok(y.unsqueeze(1)?
            .expand((kv_heads, repeat, len, hd))?
            .reshape((self.heads, len, hd))?)
    }

    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// (heads, t, hd) attention output to the model width.
    fn output(&self, out: &Tensor) -> Result<Tensor> {
        Ok(self.o_proj.forward(&self.merge_heads(out)?)?)
    }

    /// (heads, t, hd) to (t, heads · hd), before `o_proj`.
    fn merge_heads(&self, out: &Tensor) -> Result<Tensor> {
        let t = out.dim(1)?;
        Ok(out.transpose(0, 1)?.reshape((t, self.heads * self.head_dim))?)
    }

    /// `x`: (t, 2H) at positions `start..start + t`; attends to the cache and causally to
    /// itself, then appends its keys and values to the cache.
    pub fn forward(&self, x: &Tensor, start: usize, cache: &mut HeadCache) -> Result<Tensor> {
        let rows = x.dim(0)?;
        self.forward_segments(x, &mut [CacheSegment { start, rows, cache }])
    }

    /// [`Self::forward`] for several sequences at once: `x` holds each segment's rows in
    /// turn. The projections run once over every row (one matmul for all sequences, where
    /// the cost of drafting is); each segment attends only to its own cache.
    pub fn forward_segments(&self, x: &Tensor, segments: &mut [CacheSegment<'_>]) -> Result<Tensor> {
        self.forward_segments_for(x, segments, Outputs::EveryRow)
    }

    /// [`Self::forward_segments`] with outputs for `outputs`' rows only (one row per segment
    /// for [`Outputs::LastRow`]); every row's keys and values still enter the cache.
    pub fn forward_segments_for(&self, x: &Tensor, segments: &mut [CacheSegment<'_>], outputs: Outputs) -> Result<Tensor> {
        let n: usize = segments.iter().map(|s| s.rows).sum();
        ensure!(n == x.dim(0)?, "{} input rows for segments of {n} rows in all", x.dim(0)?);
        let q = self.q_proj.forward(&outputs.select(x, segments)?)?;
        let (k, v) = (self.k_proj.forward(x)?, self.v_proj.forward(x)?);
        let mut outs = Vec::with_capacity(segments.len());
        let (mut row, mut q_row) = (0, 0);
        for segment in segments.iter_mut() {
            let (rows, queried) = (segment.rows, outputs.of(segment.rows));
            // The queried rows are the segment's last: their RoPE rows are the keys' last.
            let (cos, sin) = self.rope_tables(segment.start, rows, x.device())?;
            let q_rope = (cos.narrow(0, rows - queried, queried)?, sin.narrow(0, rows - queried, queried)?);
            let q = self.heads_at(&q.narrow(0, q_row, queried)?, self.heads, Some(&q_rope))?;
            let k = self.heads_at(&k.narrow(0, row, rows)?, self.kv_heads, Some(&(cos, sin)))?;
            let v = self.heads_at(&v.narrow(0, row, rows)?, self.kv_heads, None)?;
            outs.push(self.merge_heads(&self.attend(&q, k, v, segment.start, segment.cache)?)?);
            row += rows;
            q_row += queried;
        }
        let out = match outs.len() {
            1 => outs.pop().expect("one segment"),
            _ => Tensor::cat(&outs, 0)?,
        };
        Ok(self.o_proj.forward(&out)?)
    }

    /// Keys `k`, values `v` (kv heads, n, hd) of positions `start..start + n` appended to
    /// the cache, then queries `q` (heads, t, hd) of the last `t ≤ n` of those positions
    /// against it: (heads, t, hd).
    fn attend(&self, q: &Tensor, k: Tensor, v: Tensor, start: usize, cache: &mut HeadCache) -> Result<Tensor> {
        let t = q.dim(1)?;
        ensure!(cache.len() == start, "head cache holds {} positions, the input starts at {start}", cache.len());
        ensure!(t <= k.dim(1)?, "{t} queries for {} new positions", k.dim(1)?);
        let (k, v) = cache.append(k, v)?;
        let total = k.dim(1)?;
        // Grouped: the query heads sharing a kv head attend as one (kv heads, group · t) block,
        // so the cached keys and values are read in place instead of copied once per query
        // head (that copy was a tenth of a drafted token's time).
        let group = self.heads / self.kv_heads;
        let q = q.reshape((self.kv_heads, group * t, self.head_dim))?;
        let scores = (q.matmul(&k.t()?)? * self.scale())?.reshape((self.kv_heads, group, t, total))?;
        // A lone query is the newest position and sees every key: no mask to add.
        let scores = match t {
            1 => scores,
            _ => scores.broadcast_add(&causal_mask(t, total, total - t, q.device())?)?,
        };
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?.reshape((self.kv_heads, group * t, total))?;
        Ok(probs.matmul(&v)?.reshape((self.heads, t, self.head_dim))?)
    }

    /// Training-time test, step `j` (EAGLE-3 §2.4 of the training spec): row `i` at position
    /// `i + j` sees step 0's keys of positions `0..=i` and, from each later step `s ≤ j`, the
    /// key of its own row only. `steps` holds the (k, v) of steps `0..j`; this step's are
    /// appended. Only rows `first..` are queried: at step 0 `x` holds every row (all are
    /// keys), later steps only rows `first..`; the output is rows `first..`.
    pub fn forward_ttt(&self, x: &Tensor, step: usize, steps: &mut Vec<(Tensor, Tensor)>, first: usize) -> Result<Tensor> {
        let (q, k, v) = match step {
            0 => {
                let (_, k, v) = self.project(x, 0)?;
                let rows = x.dim(0)? - first;
                let (q, _, _) = self.project(&x.narrow(0, first, rows)?, first)?;
                (q, k, v)
            }
            _ => self.project(x, first + step)?,
        };
        steps.push((self.expand(&k)?, self.expand(&v)?));
        let (k0, v0) = &steps[0];
        let (t, keys) = (q.dim(1)?, k0.dim(1)?);
        let mut columns = vec![(q.matmul(&k0.t()?)? * self.scale())?
            .broadcast_add(&causal_mask(t, keys, first, x.device())?)?];
        for (ks, _) in &steps[1..] {
            columns.push(((&q * ks)?.sum_keepdim(D::Minus1)? * self.scale())?);
        }
        let probs = candle_nn::ops::softmax(&Tensor::cat(&columns, D::Minus1)?, D::Minus1)?;
        let mut out = probs.narrow(D::Minus1, 0, keys)?.matmul(v0)?;
        for (s, (_, vs)) in steps.iter().enumerate().skip(1) {
            out = (out + probs.narrow(D::Minus1, keys + s - 1, 1)?.broadcast_mul(vs)?)?;
        }
        self.output(&out)
    }
}

/// (1, t, total): row `i` (at position `start + i`) sees keys at positions `≤ start + i`.
fn causal_mask(t: usize, total: usize, start: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..total).map(move |j| if j <= start + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(mask, (1, t, total), device)?)
}

/// RMS norm from plain tensor ops: candle-nn's fused norm, softmax and RoPE kernels have no
/// backward pass, and the head is trained with the same code it serves with.
pub struct HeadNorm {
    weight: Tensor,
    eps: f64,
}

pub fn head_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<HeadNorm> {
    Ok(HeadNorm {
        weight: vb.get_with_hints(size, "weight", candle_nn::Init::Const(1.0))?,
        eps,
    })
}

impl Module for HeadNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::rms_norm_slow(x, &self.weight, self.eps as f32)
    }
}

pub struct Mlp {
    gate_proj: Projection,
    up_proj: Projection,
    down_proj: Projection,
}

impl Mlp {
    /// Store gate/up/down as `format` (drafting only).
    pub fn quantize(&mut self, format: WeightFormat) -> Result<()> {
        for p in [&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj] {
            p.quantize(format)?;
        }
        Ok(())
    }

    pub fn new(h: usize, i: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            gate_proj: projection(h, i, false, vb.pp("gate_proj"))?,
            up_proj: projection(h, i, false, vb.pp("up_proj"))?,
            down_proj: projection(i, h, false, vb.pp("down_proj"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        self.down_proj.forward(&(gate * self.up_proj.forward(x)?)?)
    }
}

