//! EAGLE-3's training objective over the unrolled steps (training spec §2.5): at step `j`,
//! soft cross-entropy between the target's distribution over the draft vocabulary and the
//! head's, on the rows whose position mask is set, averaged over all rows, weighted 0.8^j.

use anyhow::{ensure, Result};
use candle_core::{Tensor, D};
use verdict_heads::eagle3::HeadOutput;

/// Weight of step `j`'s loss: `STEP_DECAY^j` (the reference's `ploss_weight`).
pub const STEP_DECAY: f64 = 0.8;

/// One step's labels: the target's probabilities over the draft vocabulary (t, N), and a
/// 0/1 mask (t) of the rows that count (response tokens whose target top-1 is drafted).
pub struct StepTargets {
    pub probs: Tensor,
    pub mask: Tensor,
}

/// Σ_j 0.8^j · mean over rows of mask · (−Σ_v p(v) log q(v)), and per step the share of
/// masked rows whose arg-max agrees with the target's.
pub fn ttt_loss(outputs: &[HeadOutput], targets: &[StepTargets]) -> Result<(Tensor, Vec<f64>)> {
    ensure!(
        outputs.len() == targets.len() && !outputs.is_empty(),
        "{} unrolled steps but {} label sets",
        outputs.len(),
        targets.len()
    );
    let mut total: Option<Tensor> = None;
    let mut accuracies = Vec::with_capacity(outputs.len());
    for (j, (out, target)) in outputs.iter().zip(targets).enumerate() {
        let log_q = candle_nn::ops::log_softmax(&out.logits, D::Minus1)?;
        let row_loss = (&target.probs * &log_q)?.sum(D::Minus1)?.neg()?;
        let step = ((row_loss * &target.mask)?.mean_all()? * STEP_DECAY.powi(j as i32))?;
        total = Some(match total {
            None => step,
            Some(t) => (t + step)?,
        });
        let agree = out
            .logits
            .argmax(D::Minus1)?
            .eq(&target.probs.argmax(D::Minus1)?)?
            .to_dtype(candle_core::DType::F32)?;
        let masked = target.mask.sum_all()?.to_scalar::<f32>()?;
        let hits = (agree * &target.mask)?.sum_all()?.to_scalar::<f32>()?;
        accuracies.push(if masked > 0.0 { (hits / masked) as f64 } else { 0.0 });
    }
    Ok((total.expect("at least one step"), accuracies))
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn output(logits: &[[f32; 2]; 2]) -> HeadOutput {
        let logits = Tensor::new(logits, &Device::Cpu).unwrap();
        HeadOutput { hidden: logits.clone(), logits }
    }

    #[test]
    fn loss_and_accuracy_match_hand_computed_values() {
        // Step 0: logits (ln 2, 0) give q = (⅔, ⅓); label p = (1, 0) → −ln ⅔ = 0.4055 on row
        // 0; row 1 is masked out but counts in the mean: 0.4055 / 2.
        // Step 1: logits (ln 3, 0) give q = (¾, ¼); p = (0.6, 0.4) → −(0.6 ln ¾ + 0.4 ln ¼)
        // = 0.7271 on both rows, weighted 0.8.
        let outputs = [
            output(&[[2f32.ln(), 0.0], [5.0, 0.0]]),
            output(&[[3f32.ln(), 0.0], [0.0, 3f32.ln()]]),
        ];
        let targets = [
            StepTargets {
                probs: Tensor::new(&[[1f32, 0.0], [0.0, 1.0]], &Device::Cpu).unwrap(),
                mask: Tensor::new(&[1f32, 0.0], &Device::Cpu).unwrap(),
            },
            StepTargets {
                probs: Tensor::new(&[[0.6f32, 0.4], [0.6, 0.4]], &Device::Cpu).unwrap(),
                mask: Tensor::new(&[1f32, 1.0], &Device::Cpu).unwrap(),
            },
        ];
        let (loss, accuracy) = ttt_loss(&outputs, &targets).unwrap();
        // Row 1 of step 1 has q = (¼, ¾): −(0.6 ln ¼ + 0.4 ln ¾) = 0.9469.
        let expected = -(2f64 / 3.0).ln() / 2.0
            + 0.8 * (-(0.6 * 0.75f64.ln() + 0.4 * 0.25f64.ln()) - (0.6 * 0.25f64.ln() + 0.4 * 0.75f64.ln())) / 2.0;
        assert!((loss.to_scalar::<f32>().unwrap() as f64 - expected).abs() < 1e-5);
        // Step 0: row 0 agrees (row 1, which would not, is masked); step 1: one of two.
        assert_eq!(accuracy, vec![1.0, 0.5]);
    }

    #[test]
    fn steps_and_labels_must_match() {
        let outputs = [output(&[[0.0, 0.0], [0.0, 0.0]])];
        assert!(ttt_loss(&outputs, &[]).is_err());
    }

    /// A tiny head and a synthetic chain: the label of each row is a fixed function of the
    /// token it reads, so the head can learn it from the embeddings.
    fn tiny_setup() -> (candle_nn::VarMap, verdict_heads::Eagle3Head, Tensor, Vec<Tensor>, Vec<StepTargets>) {
        use candle_core::DType;
        use candle_nn::{VarBuilder, VarMap};
        let (t, steps, hidden, vocab) = (12, 3, 16, 10);
        let config: verdict_heads::Eagle3Config = serde_json::from_value(serde_json::json!({
            "hidden_size": hidden, "intermediate_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": vocab,
        }))
        .unwrap();
        let varmap = VarMap::new();
        let head = verdict_heads::Eagle3Head::new(config, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), None).unwrap();
        let table = Tensor::randn(0f32, 1.0, (vocab, hidden), &Device::Cpu).unwrap();
        let tokens: Vec<u32> = (0..t + steps).map(|i| ((i * 7 + 3) % vocab) as u32).collect();
        let aux = Tensor::randn(0f32, 1.0, (t, 3 * hidden), &Device::Cpu).unwrap();
        let mut embeds = Vec::new();
        let mut targets = Vec::new();
        for j in 0..steps {
            let ids = &tokens[j..j + t];
            embeds.push(table.index_select(&Tensor::new(ids, &Device::Cpu).unwrap(), 0).unwrap());
            let labels: Vec<u32> = ids.iter().map(|&x| (x * 3 + 1) % vocab as u32).collect();
            let probs = candle_nn::encoding::one_hot(Tensor::new(labels.as_slice(), &Device::Cpu).unwrap(), vocab, 1f32, 0f32).unwrap();
            targets.push(StepTargets { probs, mask: Tensor::ones(t, DType::F32, &Device::Cpu).unwrap() });
        }
        (varmap, head, aux, embeds, targets)
    }

    #[test]
    fn loss_falls_when_training_through_the_unrolled_steps() {
        use candle_nn::Optimizer;
        let (varmap, head, aux, embeds, targets) = tiny_setup();
        let mut optimizer = candle_nn::AdamW::new(
            varmap.all_vars(),
            candle_nn::ParamsAdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, weight_decay: 0.0, ..Default::default() },
        )
        .unwrap();
        let loss_now = || ttt_loss(&head.forward_ttt(&aux, &embeds).unwrap(), &targets).unwrap();
        let (first, _) = loss_now();
        let first = first.to_scalar::<f32>().unwrap();
        for _ in 0..80 {
            let (loss, _) = loss_now();
            optimizer.backward_step(&loss).unwrap();
        }
        let (last, accuracy) = loss_now();
        let last = last.to_scalar::<f32>().unwrap();
        assert!(last < 0.3 * first, "loss {first} -> {last}");
        assert!(accuracy.iter().all(|&a| a > 0.9), "{accuracy:?}");
    }

    #[test]
    fn the_last_step_trains_the_fusion_layer_through_the_earlier_steps() {
        // Only the fused features reach `fc`; at step 2 they arrive through steps 0 and 1
        // (the hidden input is the previous step's output, not detached).
        let (varmap, head, aux, embeds, targets) = tiny_setup();
        let outputs = head.forward_ttt(&aux, &embeds).unwrap();
        let last = &outputs[2..];
        let (loss, _) = ttt_loss(last, &targets[2..]).unwrap();
        let grads = loss.backward().unwrap();
        let fc = varmap.data().lock().unwrap().get("fc.weight").unwrap().as_tensor().clone();
        let grad = grads.get(&fc).expect("fc gets a gradient from step 2");
        assert!(grad.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);
    }
}
