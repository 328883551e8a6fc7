//! AdamW whose moments can be saved and restored: candle-nn's `AdamW` keeps them private, and
//! a training run killed mid-way must resume to the very parameters an uninterrupted run
//! reaches.

use std::{collections::HashMap, path::Path};

use anyhow::{Context, Result};
use candle_core::{backprop::GradStore, Tensor, Var};

pub struct AdamW {
    /// (name, variable) in name order, so moments line up across runs.
    vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Updates applied so far.
    pub step: usize,
}

impl AdamW {
    pub fn new(mut vars: Vec<(String, Var)>, beta1: f64, beta2: f64, weight_decay: f64) -> Result<Self> {
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let zeros = |v: &Var| v.as_tensor().zeros_like();
        let m = vars.iter().map(|(_, v)| zeros(v)).collect::<candle_core::Result<_>>()?;
        let v = vars.iter().map(|(_, v)| zeros(v)).collect::<candle_core::Result<_>>()?;
        Ok(Self { vars, m, v, beta1, beta2, eps: 1e-8, weight_decay, step: 0 })
    }

    /// Global L2 norm of the gradients; when above `max_norm`, every gradient is scaled
    /// down to it. Returns the norm before clipping.
    pub fn clip_grad_norm(&self, grads: &mut GradStore, max_norm: f64) -> Result<f64> {
        let mut total = 0f64;
        for (_, var) in &self.vars {
            if let Some(g) = grads.get(var) {
                total += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        let norm = total.sqrt();
        if norm > max_norm {
            let scale = max_norm / (norm + 1e-6);
            for (_, var) in &self.vars {
                if let Some(g) = grads.remove(var) {
                    grads.insert(var, (g * scale)?);
                }
            }
        }
        Ok(norm)
    }

    /// One decoupled-weight-decay Adam update at learning rate `lr`.
    pub fn apply(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.step += 1;
        let t = self.step as i32;
        let (c1, c2) = (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t));
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let Some(g) = grads.get(var) else { continue };
            self.m[i] = ((&self.m[i] * self.beta1)? + (g * (1.0 - self.beta1))?)?;
            self.v[i] = ((&self.v[i] * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
            let m_hat = (&self.m[i] / c1)?;
            let v_hat = (&self.v[i] / c2)?;
            let update = (m_hat / (v_hat.sqrt()? + self.eps)?)?;
            let theta = var.as_tensor();
            let next = ((theta * (1.0 - lr * self.weight_decay))? - (update * lr)?)?;
            var.set(&next)?;
        }
        Ok(())
    }

    /// Moments and step count, to [`Self::load_state`] after a restart.
    pub fn save_state(&self, path: &Path) -> Result<()> {
        let mut tensors = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            tensors.insert(format!("m.{name}"), self.m[i].clone());
            tensors.insert(format!("v.{name}"), self.v[i].clone());
        }
        tensors.insert("step".into(), Tensor::new(&[self.step as u32], &candle_core::Device::Cpu)?);
        candle_core::safetensors::save(&tensors, path)?;
        Ok(())
    }

    pub fn load_state(&mut self, path: &Path) -> Result<()> {
        let mut tensors = candle_core::safetensors::load(path, &candle_core::Device::Cpu)
            .with_context(|| format!("cannot read optimizer state {}", path.display()))?;
        for (i, (name, _)) in self.vars.iter().enumerate() {
            self.m[i] = tensors.remove(&format!("m.{name}")).with_context(|| format!("no m.{name} in {}", path.display()))?;
            self.v[i] = tensors.remove(&format!("v.{name}")).with_context(|| format!("no v.{name} in {}", path.display()))?;
        }
        self.step = tensors.remove("step").context("no step")?.to_vec1::<u32>()?[0] as usize;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn first_update_moves_each_weight_by_lr_against_its_gradient_sign() {
        // Step 1: m̂ = g, v̂ = g², so the update is lr · g / |g| = ±lr (plus decay lr·wd·θ).
        let w = Var::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
        let loss = (w.as_tensor() * Tensor::new(&[3.0f32, -0.5], &Device::Cpu).unwrap()).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let mut opt = AdamW::new(vec![("w".into(), w.clone())], 0.9, 0.95, 0.1).unwrap();
        opt.apply(&grads, 0.01).unwrap();
        let got = w.as_tensor().to_vec1::<f32>().unwrap();
        let want = [1.0 * (1.0 - 0.001) - 0.01, -2.0 * (1.0 - 0.001) + 0.01];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn clipping_scales_the_global_norm_down() {
        let w = Var::new(&[0.0f32, 0.0], &Device::Cpu).unwrap();
        let loss = (w.as_tensor() * Tensor::new(&[3.0f32, 4.0], &Device::Cpu).unwrap()).unwrap().sum_all().unwrap();
        let mut grads = loss.backward().unwrap();
        let opt = AdamW::new(vec![("w".into(), w.clone())], 0.9, 0.95, 0.0).unwrap();
        assert!((opt.clip_grad_norm(&mut grads, 1.0).unwrap() - 5.0).abs() < 1e-6);
        let g = grads.get(&w).unwrap().to_vec1::<f32>().unwrap();
        assert!((g[0] - 0.6).abs() < 1e-5 && (g[1] - 0.8).abs() < 1e-5, "{g:?}");
    }
}
