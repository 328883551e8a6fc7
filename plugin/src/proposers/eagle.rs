//! EAGLE-3 chain drafting for one sequence: the head's cache follows the target's committed
//! positions, whose keys always come from target features (what the head saw in training),
//! and drafted positions live in the cache only while a step drafts.
//!
//! Alignment (EAGLE-3 runtime): the target's features `a_p` at position `p` pair with the
//! token at `p + 1`; the head row at `p` reads `embed(t_{p+1}) ⊕ fc(a_p)` and predicts
//! `t_{p+2}`. After a target forward, the committed positions' rows enter the cache; the last
//! one's output gives the first draft, and each later draft feeds the previous draft's
//! embedding with the head's own output.

use anyhow::{ensure, Context, Result};
use candle_core::Tensor;
use verdict_heads::{eagle3::CacheSegment, Eagle3Head, HeadCache};

/// The target's input embeddings of tokens (the head shares them, frozen).
pub trait TokenEmbeddings: Send + Sync {
    /// (tokens, hidden) rows.
    fn embed(&self, tokens: &[u32]) -> Result<Tensor>;
}

/// Embeddings held as one dense (vocab, hidden) matrix.
pub struct DenseEmbeddings(pub Tensor);

impl TokenEmbeddings for DenseEmbeddings {
    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let ids = Tensor::new(tokens, self.0.device())?;
        Ok(self.0.index_select(&ids, 0)?)
    }
}

/// Draws a draft from a `[vocab]` row of draft logits (the accept rule's sampler).
pub type DraftSampler<'a> = dyn FnMut(&Tensor) -> Result<u32> + 'a;

/// γ drafted tokens (target ids) and the head's logits over the full target vocabulary for
/// each (draft-vocabulary columns; every other token at −∞).
pub struct Drafts {
    pub tokens: Vec<u32>,
    pub logits: Tensor,
    /// The probability the head gave its best token at each draft, before drawing it.
    pub confidences: Vec<f32>,
}

/// One sequence's drafting state.
#[derive(Default)]
pub struct SequenceDrafter {
    cache: HeadCache,
    /// Position of the cache's first entry: non-zero when the target's first forward started
    /// past a prefix it had cached (a prefix-cache hit), whose features the head never saw.
    offset: usize,
    /// The last committed row's output (the hidden input of the second draft) and logits
    /// (the first draft's).
    last_row: Option<(Tensor, Tensor)>,
}

/// The confidence cut: the head's best-token probability for the candidate draft (the last
/// of `confidences`) is at least `min_confidence`. The first draft is always made, and a cut
/// of 0 keeps everything.
pub fn sure_enough(confidences: &[f32], min_confidence: f32) -> bool {
    match confidences {
        [] | [_] => true,
        [.., candidate] => min_confidence <= 0.0 || *candidate >= min_confidence,
    }
}

impl SequenceDrafter {
    /// A drafter whose cache holds positions `0..cache.len()`, restored from an earlier
    /// sequence with the same prefix; the next commit starts at `cache.len()`.
    pub fn resumed(cache: HeadCache) -> Self {
        Self {
            cache,
            offset: 0,
            last_row: None,
        }
    }

    /// The position after the last committed one the head's cache holds.
    pub fn committed_len(&self) -> usize {
        self.offset + self.cache.len()
    }

    /// The committed cache, when it covers the sequence from position 0 (worth keeping for
    /// sequences that share the prefix).
    pub fn cache_from_start(&self) -> Option<&HeadCache> {
        (self.offset == 0 && !self.cache.is_empty()).then_some(&self.cache)
    }

    /// Take the target's features of positions `start..start + n` (fused input rows, or the
    /// three captured layers concatenated, (n, 3H)) together with the tokens that followed
    /// each of them (`next_tokens[i]` is the token at `start + i + 1`). Positions at or past
    /// `start` that the cache held from an earlier call are replaced.
    pub fn commit(
        &mut self,
        head: &Eagle3Head,
        embeddings: &dyn TokenEmbeddings,
        start: usize,
        aux: &Tensor,
        next_tokens: &[u32],
    ) -> Result<()> {
        commit_together(
            head,
            embeddings,
            &mut [Commit {
                drafter: self,
                start,
                aux,
                next_tokens,
            }],
        )
    }

    /// Make room for `n` committed rows from sequence position `start`: forget cached rows
    /// from there on. Returns the cache position the rows start at, `None` when `n` is 0.
    fn begin_commit(&mut self, start: usize, n: usize) -> Result<Option<usize>> {
        if self.cache.is_empty() {
            self.offset = start;
        }
        ensure!(
            (self.offset..=self.committed_len()).contains(&start),
            "features start at position {start} but the head's cache holds positions {}..{}",
            self.offset,
            self.committed_len()
        );
        if n == 0 {
            return Ok(None);
        }
        self.cache.truncate(start - self.offset)?;
        // The head sees positions counted from its cache's first entry: RoPE only sees
        // relative positions, so the offset changes nothing it computes.
        Ok(Some(start - self.offset))
    }

    /// Keep the last committed row's output `(1, H)`, `(1, draft vocab)`: where the next
    /// drafts start.
    fn end_commit(&mut self, hidden: Tensor, logits: Tensor) {
        self.last_row = Some((hidden, logits));
    }

    /// Draft `gamma` tokens after the token that follows the last committed position (that
    /// row was fed it, so its logits are the first draft's), each drawn by `sample` from its
    /// full-vocabulary row. The cache is left as it was: drafted positions are scratch.
    pub fn draft(
        &mut self,
        head: &Eagle3Head,
        embeddings: &dyn TokenEmbeddings,
        gamma: usize,
        vocab_size: usize,
        sample: &mut dyn FnMut(&Tensor) -> Result<u32>,
    ) -> Result<Drafts> {
        self.draft_confident(head, embeddings, gamma, 0.0, vocab_size, sample)
    }

    /// [`Self::draft`], stopping before a draft whose best token the head gives less than
    /// `min_confidence` (the first draft is always made). Each draft costs a verify row: drafts
    /// the target is unlikely to keep do not pay for theirs. The cut reads only the head's own distribution, so rejection
    /// sampling stays lossless.
    pub fn draft_confident(
        &mut self,
        head: &Eagle3Head,
        embeddings: &dyn TokenEmbeddings,
        gamma: usize,
        min_confidence: f32,
        vocab_size: usize,
        sample: &mut dyn FnMut(&Tensor) -> Result<u32>,
    ) -> Result<Drafts> {
        let keep = |c: &[f32]| sure_enough(c, min_confidence);
        self.draft_while(head, embeddings, gamma, &keep, vocab_size, sample)
    }

    /// Draft up to `gamma` tokens while `keep` accepts the next one, judged by the head's
    /// confidences: the drafts made so far, then the candidate's, before it is drawn (so
    /// the choice never depends on the draft itself).
    pub fn draft_while(
        &mut self,
        head: &Eagle3Head,
        embeddings: &dyn TokenEmbeddings,
        gamma: usize,
        keep: &dyn Fn(&[f32]) -> bool,
        vocab_size: usize,
        sample: &mut dyn FnMut(&Tensor) -> Result<u32>,
    ) -> Result<Drafts> {
        let mut drafts = draft_together(head, embeddings, &mut [self], &[gamma], &|_, c| keep(c), vocab_size, &mut [sample])?;
        Ok(drafts.pop().expect("one drafter, one chain"))
    }

    /// A chain of at most `gamma` drafts from the last committed row.
    fn start_chain(&self, gamma: usize) -> Result<DraftChain> {
        let (hidden, logits) = self.committed_row()?.clone();
        Ok(DraftChain {
            cached: self.cache.len(),
            gamma,
            hidden,
            logits,
            tokens: Vec::with_capacity(gamma),
            rows: Vec::with_capacity(gamma),
            confidences: Vec::with_capacity(gamma),
            done: false,
        })
    }

    /// The chain's drafts; the drafted positions leave the cache.
    fn finish_chain(&mut self, chain: DraftChain, vocab_size: usize) -> Result<Drafts> {
        self.cache.truncate(chain.cached)?;
        let logits = match chain.rows.is_empty() {
            true => Tensor::zeros((0, vocab_size), chain.logits.dtype(), chain.logits.device())?,
            false => Tensor::cat(&chain.rows, 0)?,
        };
        Ok(Drafts {
            tokens: chain.tokens,
            logits,
            confidences: chain.confidences,
        })
    }

    /// The probability the head gives its best first draft, before drafting it.
    pub fn first_draft_confidence(&self) -> Result<f32> {
        best_probability(&self.committed_row()?.1)
    }

    /// The head's (hidden, logits) at the last committed position: where drafting starts.
    fn committed_row(&self) -> Result<&(Tensor, Tensor)> {
        self.last_row
            .as_ref()
            .context("the head has no committed target features to draft from")
    }
}

/// One sequence's draft chain between head forwards: the head's last output, the drafts so
/// far, and whether the chain stopped.
struct DraftChain {
    /// Cache length before drafting (drafted positions go after it).
    cached: usize,
    gamma: usize,
    hidden: Tensor,
    logits: Tensor,
    tokens: Vec<u32>,
    rows: Vec<Tensor>,
    confidences: Vec<f32>,
    done: bool,
}

impl DraftChain {
    /// Draw the next draft if the chain goes on (`keep` accepts its confidence, fewer than
    /// γ drafted). Returns the draft when the head must run on it for the one after.
    fn advance(
        &mut self,
        head: &Eagle3Head,
        keep: &dyn Fn(&[f32]) -> bool,
        vocab_size: usize,
        sample: &mut dyn FnMut(&Tensor) -> Result<u32>,
    ) -> Result<Option<u32>> {
        if self.done || self.tokens.len() == self.gamma {
            return Ok(None);
        }
        self.confidences.push(best_probability(&self.logits)?);
        if !keep(&self.confidences) {
            self.confidences.pop();
            self.done = true;
            return Ok(None);
        }
        let row = full_vocab_row(head, &self.logits, vocab_size)?;
        let token = sample(&row.squeeze(0)?)?;
        self.rows.push(row);
        self.tokens.push(token);
        Ok((self.tokens.len() < self.gamma).then_some(token))
    }

    /// The cache position of the head row that reads the newest draft.
    fn next_position(&self) -> usize {
        self.cached + self.tokens.len() - 1
    }

    /// The head's output on the newest draft: where the next one comes from.
    fn take(&mut self, hidden: Tensor, logits: Tensor) {
        self.hidden = hidden;
        self.logits = logits;
    }
}

/// [`SequenceDrafter::draft_while`] for several sequences at once: one head forward per
/// draft position over every chain still going, instead of one per sequence and position.
/// `drafters[i]` drafts at most `gammas[i]` tokens, each drawn by `samples[i]`, while
/// `keep(i, confidences)` accepts the next.
pub fn draft_together(
    head: &Eagle3Head,
    embeddings: &dyn TokenEmbeddings,
    drafters: &mut [&mut SequenceDrafter],
    gammas: &[usize],
    keep: &dyn Fn(usize, &[f32]) -> bool,
    vocab_size: usize,
    samples: &mut [&mut DraftSampler<'_>],
) -> Result<Vec<Drafts>> {
    ensure!(
        drafters.len() == gammas.len() && drafters.len() == samples.len(),
        "{} drafters, {} γs and {} samplers",
        drafters.len(),
        gammas.len(),
        samples.len()
    );
    let mut chains = drafters
        .iter()
        .zip(gammas)
        .map(|(d, &gamma)| d.start_chain(gamma))
        .collect::<Result<Vec<_>>>()?;
    loop {
        let mut fed = Vec::new();
        for (i, chain) in chains.iter_mut().enumerate() {
            if let Some(token) = chain.advance(head, &|c| keep(i, c), vocab_size, &mut *samples[i])? {
                fed.push((i, token));
            }
        }
        if fed.is_empty() {
            break;
        }
        let tokens: Vec<u32> = fed.iter().map(|&(_, t)| t).collect();
        let hidden = Tensor::cat(&fed.iter().map(|&(i, _)| &chains[i].hidden).collect::<Vec<_>>(), 0)?;
        let mut segments: Vec<CacheSegment<'_>> = drafters
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| fed.iter().any(|&(j, _)| j == *i))
            .map(|(i, d)| CacheSegment {
                start: chains[i].next_position(),
                rows: 1,
                cache: &mut d.cache,
            })
            .collect();
        let out = head.forward_segments(&embeddings.embed(&tokens)?, &hidden, &mut segments)?;
        for (row, &(i, _)) in fed.iter().enumerate() {
            chains[i].take(out.hidden.narrow(0, row, 1)?, out.logits.narrow(0, row, 1)?);
        }
    }
    drafters
        .iter_mut()
        .zip(chains)
        .map(|(d, chain)| d.finish_chain(chain, vocab_size))
        .collect()
}

/// One sequence's share of [`commit_together`]: what [`SequenceDrafter::commit`] takes.
pub struct Commit<'a> {
    pub drafter: &'a mut SequenceDrafter,
    pub start: usize,
    pub aux: &'a Tensor,
    pub next_tokens: &'a [u32],
}

/// [`SequenceDrafter::commit`] for several sequences in one head forward (one `fc` and one
/// layer over every committed row), as after a batched verify.
pub fn commit_together(head: &Eagle3Head, embeddings: &dyn TokenEmbeddings, commits: &mut [Commit<'_>]) -> Result<()> {
    let mut froms = Vec::with_capacity(commits.len());
    for c in commits.iter_mut() {
        let n = c.aux.dim(0)?;
        ensure!(n == c.next_tokens.len(), "{n} feature rows but {} next tokens", c.next_tokens.len());
        froms.push(c.drafter.begin_commit(c.start, n)?);
    }
    let fed: Vec<usize> = (0..commits.len()).filter(|&i| froms[i].is_some()).collect();
    if fed.is_empty() {
        return Ok(());
    }
    let aux = Tensor::cat(&fed.iter().map(|&i| commits[i].aux).collect::<Vec<_>>(), 0)?;
    let tokens: Vec<u32> = fed.iter().flat_map(|&i| commits[i].next_tokens.iter().copied()).collect();
    let rows: Vec<usize> = fed.iter().map(|&i| commits[i].next_tokens.len()).collect();
    let fused = head.fuse(&aux)?;
    let mut segments: Vec<CacheSegment<'_>> = commits
        .iter_mut()
        .zip(&froms)
        .filter_map(|(c, from)| from.map(|start| (c, start)))
        .zip(&rows)
        .map(|((c, start), &rows)| CacheSegment {
            start,
            rows,
            cache: &mut c.drafter.cache,
        })
        .collect();
    // Drafting starts from each sequence's last committed row: the head computes only that
    // row's output, the others enter its cache as keys and values.
    let out = head.forward_last_rows(&embeddings.embed(&tokens)?, &fused, &mut segments)?;
    drop(segments);
    for (row, &i) in fed.iter().enumerate() {
        commits[i]
            .drafter
            .end_commit(out.hidden.narrow(0, row, 1)?, out.logits.narrow(0, row, 1)?);
    }
    Ok(())
}

/// A `(1, draft vocab)` row of head logits over the full target vocabulary (−∞ outside the
/// draft vocabulary).
fn full_vocab_row(head: &Eagle3Head, logits: &Tensor, vocab_size: usize) -> Result<Tensor> {
    let draft_logits = logits.squeeze(0)?.to_vec1::<f32>()?;
    let mut full = vec![f32::NEG_INFINITY; vocab_size];
    for (draft_id, &value) in draft_logits.iter().enumerate() {
        full[head.target_id(draft_id as u32) as usize] = value;
    }
    Ok(Tensor::from_vec(full, (1, vocab_size), logits.device())?)
}

/// The softmax probability of the best entry of a `(1, n)` row of logits.
fn best_probability(logits: &Tensor) -> Result<f32> {
    let values = logits.flatten_all()?.to_vec1::<f32>()?;
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f32 = values.iter().filter(|v| v.is_finite()).map(|v| (v - max).exp()).sum();
    Ok(1.0 / total)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, D};

    use super::*;

    const VOCAB: usize = 30;
    const HIDDEN: usize = 16;

    #[test]
    fn the_confidence_cut_reads_the_candidate_and_spares_the_first_draft() {
        assert!(sure_enough(&[0.01], 0.5), "the first draft is always made");
        assert!(sure_enough(&[0.9, 0.5], 0.5), "a candidate at the cut is kept");
        assert!(!sure_enough(&[0.9, 0.49], 0.5));
        // Only the candidate counts, not the drafts already made.
        assert!(sure_enough(&[0.1, 0.2, 0.7], 0.5));
        assert!(sure_enough(&[0.9, 0.0], 0.0), "a cut of 0 keeps everything");
    }

    /// A random tiny head over a reduced draft vocabulary, and random embeddings.
    fn head_and_embeddings() -> (Eagle3Head, DenseEmbeddings) {
        crate::tiny_model::random_eagle3_head(HIDDEN, VOCAB, (0..12).map(|i| i * 2 + 3).collect()).unwrap()
    }

    fn greedy(row: &Tensor) -> Result<u32> {
        Ok(row.argmax(D::Minus1)?.to_scalar::<u32>()?)
    }

    fn features(n: usize) -> Tensor {
        Tensor::randn(0f32, 1.0, (n, 3 * HIDDEN), &Device::Cpu).unwrap()
    }

    #[test]
    fn drafting_leaves_the_committed_cache_alone() {
        let (head, embeddings) = head_and_embeddings();
        let mut drafter = SequenceDrafter::default();
        drafter.commit(&head, &embeddings, 0, &features(5), &[1, 2, 3, 4, 5]).unwrap();
        let first = drafter.draft(&head, &embeddings, 4, VOCAB, &mut greedy).unwrap();
        assert_eq!(drafter.committed_len(), 5);
        let again = drafter.draft(&head, &embeddings, 4, VOCAB, &mut greedy).unwrap();
        assert_eq!(first.tokens, again.tokens);
        assert_eq!(first.logits.dims(), &[4, VOCAB]);
    }

    #[test]
    fn committing_in_steps_or_after_a_rollback_drafts_as_committing_at_once() {
        let (head, embeddings) = head_and_embeddings();
        let aux = features(6);
        let next = [7u32, 8, 9, 10, 11, 12];
        let mut at_once = SequenceDrafter::default();
        at_once.commit(&head, &embeddings, 0, &aux, &next).unwrap();
        let expected = at_once.draft(&head, &embeddings, 3, VOCAB, &mut greedy).unwrap();

        let mut stepwise = SequenceDrafter::default();
        stepwise.commit(&head, &embeddings, 0, &aux.narrow(0, 0, 4).unwrap(), &next[..4]).unwrap();
        // A verify that computed positions 4.. with other features and tokens, rolled back.
        stepwise.commit(&head, &embeddings, 4, &features(2), &[1, 1]).unwrap();
        stepwise.commit(&head, &embeddings, 4, &aux.narrow(0, 4, 2).unwrap(), &next[4..]).unwrap();
        let got = stepwise.draft(&head, &embeddings, 3, VOCAB, &mut greedy).unwrap();
        assert_eq!(got.tokens, expected.tokens);
        let diff = (got.logits - &expected.logits).unwrap();
        // −∞ − −∞ is NaN outside the draft vocabulary: compare the finite columns.
        let finite = diff.to_vec2::<f32>().unwrap().into_iter().flatten().filter(|v| !v.is_nan());
        assert!(finite.map(f32::abs).fold(0f32, f32::max) < 1e-5);
    }

    #[test]
    fn drafts_are_target_ids_and_the_best_of_their_full_vocabulary_row() {
        let (head, embeddings) = head_and_embeddings();
        let mut drafter = SequenceDrafter::default();
        drafter.commit(&head, &embeddings, 0, &features(3), &[4, 5, 6]).unwrap();
        let drafts = drafter.draft(&head, &embeddings, 3, VOCAB, &mut greedy).unwrap();
        let best: Vec<u32> = drafts.logits.argmax(D::Minus1).unwrap().to_vec1().unwrap();
        assert_eq!(best, drafts.tokens);
        for (row, token) in drafts.logits.to_vec2::<f32>().unwrap().iter().zip(&drafts.tokens) {
            assert!(*token >= 3 && (*token - 3) % 2 == 0, "{token} is not in the draft vocabulary");
            assert_eq!(row.iter().filter(|v| v.is_finite()).count(), 12);
        }
    }

    #[test]
    fn a_first_commit_past_position_zero_drafts_as_one_at_zero() {
        let (head, embeddings) = head_and_embeddings();
        let aux = features(4);
        let next = [3u32, 5, 7, 9];
        let mut at_zero = SequenceDrafter::default();
        at_zero.commit(&head, &embeddings, 0, &aux, &next).unwrap();
        let mut after_prefix = SequenceDrafter::default();
        after_prefix.commit(&head, &embeddings, 10, &aux, &next).unwrap();
        assert_eq!(after_prefix.committed_len(), 14);
        let a = at_zero.draft(&head, &embeddings, 3, VOCAB, &mut greedy).unwrap();
        let b = after_prefix.draft(&head, &embeddings, 3, VOCAB, &mut greedy).unwrap();
        assert_eq!(a.tokens, b.tokens);
        // Positions past the prefix roll back like any others.
        after_prefix.commit(&head, &embeddings, 12, &features(1), &[2]).unwrap();
        assert_eq!(after_prefix.committed_len(), 13);
        assert!(after_prefix.commit(&head, &embeddings, 9, &features(1), &[1]).is_err());
        assert!(after_prefix.commit(&head, &embeddings, 15, &features(1), &[1]).is_err());
    }

    #[test]
    fn a_confidence_cut_drafts_a_prefix_of_the_uncut_drafts() {
        let (head, embeddings) = head_and_embeddings();
        let mut drafter = SequenceDrafter::default();
        drafter.commit(&head, &embeddings, 0, &features(3), &[4, 5, 6]).unwrap();
        let uncut = drafter.draft(&head, &embeddings, 5, VOCAB, &mut greedy).unwrap();
        let everything = drafter.draft_confident(&head, &embeddings, 5, 1e-9, VOCAB, &mut greedy).unwrap();
        assert_eq!(everything.tokens, uncut.tokens);
        // No draft of a random head is that sure: only the first, always made.
        let first = drafter.draft_confident(&head, &embeddings, 5, 0.999_999, VOCAB, &mut greedy).unwrap();
        assert_eq!(first.tokens, uncut.tokens[..1]);
        assert_eq!(first.logits.dims(), &[1, VOCAB]);
        assert_eq!(drafter.committed_len(), 3);
    }

    #[test]
    fn best_probability_is_the_softmax_maximum() {
        let logits = Tensor::new(&[[0f32, 1f32.ln(), 2f32.ln(), f32::NEG_INFINITY]], &Device::Cpu).unwrap();
        // exp: 1, 1, 2 (and 0): the best holds 2 / 4.
        assert!((best_probability(&logits).unwrap() - 0.5).abs() < 1e-6);
    }

    #[test]
    fn drafting_before_any_features_is_an_error() {
        let (head, embeddings) = head_and_embeddings();
        let err = SequenceDrafter::default().draft(&head, &embeddings, 2, VOCAB, &mut greedy);
        assert!(err.is_err());
    }
}
