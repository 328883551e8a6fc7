//! Greedy drafting replayed offline on held-out problems: the runtime drafter commits the
//! target's recorded features step by step and drafts where greedy `exact` speculation would,
//! so the figure is the τ a bench of those responses would measure. The per-step accuracies
//! of validation count every position alike; steps start more often right after a miss,
//! where the head tends to miss again, so they overstate τ.
//!
//! A draft tree is replayed too, to learn whether one would pay before building tree
//! verification: its τ against the chain's, at the cost of its node count in verify rows.

use std::{fmt, path::PathBuf, str::FromStr};

use anyhow::{bail, ensure, Result};
use candle_core::{DType, Tensor};
use serde::Serialize;
use verdict::proposers::eagle::{SequenceDrafter, TokenEmbeddings};
use verdict_heads::Eagle3Head;

use crate::eagle_capture::SequenceFeatures;

/// A draft tree as the root-to-leaf paths of its leaves, each the rank (0 = the head's best)
/// of the token chosen at each depth: `0000` is a γ 4 chain; `0000,1000` adds a second chain
/// from the first draft's runner-up. Every prefix of a path is a node.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftTree {
    pub paths: Vec<Vec<usize>>,
}

impl DraftTree {
    pub fn chain(gamma: usize) -> Self {
        Self { paths: vec![vec![0; gamma]] }
    }

    /// The longest path: the most drafts one step can keep.
    pub fn depth(&self) -> usize {
        self.paths.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Distinct drafted tokens: the rows a tree verify would add to the target's forward.
    pub fn nodes(&self) -> usize {
        let mut prefixes: Vec<&[usize]> = self.paths.iter().flat_map(|p| (1..=p.len()).map(move |n| &p[..n])).collect();
        prefixes.sort();
        prefixes.dedup();
        prefixes.len()
    }
}

impl FromStr for DraftTree {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<Self> {
        let mut paths = Vec::new();
        for path in text.split(',').map(str::trim) {
            let ranks: Option<Vec<usize>> = path.chars().map(|c| c.to_digit(10).map(|d| d as usize)).collect();
            match ranks {
                Some(ranks) if !ranks.is_empty() => paths.push(ranks),
                _ => bail!("draft tree path {path:?} in {text:?}: expected digits, each the rank of a draft at its depth (e.g. 0000,1000)"),
            }
        }
        Ok(Self { paths })
    }
}

impl fmt::Display for DraftTree {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let paths: Vec<String> = self.paths.iter().map(|p| p.iter().map(usize::to_string).collect()).collect();
        write!(f, "{}", paths.join(","))
    }
}

/// The `rank`-th best token of a full-vocabulary row (−∞ outside the draft vocabulary).
fn ranked_token(row: &Tensor, rank: usize) -> Result<u32> {
    let values = row.to_vec1::<f32>()?;
    let mut finite: Vec<(u32, f32)> = values.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v)).collect();
    ensure!(rank < finite.len(), "rank {rank} asked of a row with {} candidates", finite.len());
    // Ties go to the lower id, as argmax's do.
    finite.select_nth_unstable_by(rank, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    Ok(finite[rank].0)
}

/// What greedy drafting of a tree accepted over some responses.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct DraftReplay {
    /// The tree's depth (a chain's γ).
    pub gamma: usize,
    /// The tree, and how many drafts a step verifies.
    pub tree: String,
    pub nodes: usize,
    /// A chain stops drafting before a draft the head gives less than this probability (the
    /// first draft is always made): fewer verify rows where drafts are unlikely to be kept.
    /// 0 drafts every position.
    pub min_confidence: f32,
    /// Drafts verified in all (γ per step without a confidence cut).
    pub drafted: u64,
    /// Verify steps.
    pub steps: u64,
    pub accepted: u64,
    /// `accepted_per_position[i]`: steps whose draft i was kept.
    pub accepted_per_position: Vec<u64>,
}

impl DraftReplay {
    pub fn new(tree: &DraftTree) -> Self {
        Self {
            gamma: tree.depth(),
            tree: tree.to_string(),
            nodes: tree.nodes(),
            min_confidence: 0.0,
            drafted: 0,
            steps: 0,
            accepted: 0,
            accepted_per_position: vec![0; tree.depth()],
        }
    }

    /// A chain that stops before a draft of probability below `min_confidence`.
    pub fn with_confidence_cut(tree: &DraftTree, min_confidence: f32) -> Result<Self> {
        ensure!(
            min_confidence == 0.0 || tree.paths.len() == 1,
            "a confidence cut applies to a chain, not to the tree {tree}"
        );
        ensure!((0.0..1.0).contains(&min_confidence), "min confidence {min_confidence} outside 0..1");
        Ok(Self { min_confidence, ..Self::new(tree) })
    }

    /// τ = 1 + accepted / steps, as the bench reports it.
    pub fn tau(&self) -> f64 {
        1.0 + self.accepted as f64 / self.steps.max(1) as f64
    }

    /// Drafts verified per step.
    pub fn drafts_per_step(&self) -> f64 {
        self.drafted as f64 / self.steps.max(1) as f64
    }

    /// Replay one problem: from the prompt's features (the target's first forward) to the end
    /// of its response, draft every path of the tree, keep the longest path prefix that equals
    /// the response, commit the kept positions' features (the target's verify), repeat.
    pub fn add(
        &mut self,
        head: &Eagle3Head,
        embeddings: &dyn TokenEmbeddings,
        tree: &DraftTree,
        features: &SequenceFeatures,
        vocab_size: usize,
    ) -> Result<()> {
        let tokens = &features.tokens;
        let t = tokens.len();
        let start = features.response_start;
        ensure!(start >= 1 && start < t, "response start {start} outside 1..{t}");
        let aux = features.aux.to_dtype(DType::F32)?;
        let mut drafter = SequenceDrafter::default();
        drafter.commit(head, embeddings, 0, &aux.narrow(0, 0, start)?, &tokens[1..=start])?;
        // `committed` positions have features; the token at `committed` is known (the
        // target's), the drafts guess the ones after it.
        let mut committed = start;
        while committed + 1 < t {
            let (mut kept, mut chain_drafts) = (0, 0);
            for path in &tree.paths {
                let mut depth = 0;
                let drafts = drafter.draft_confident(head, embeddings, path.len(), self.min_confidence, vocab_size, &mut |row: &Tensor| {
                    let token = ranked_token(row, path[depth])?;
                    depth += 1;
                    Ok(token)
                })?;
                chain_drafts = drafts.tokens.len();
                let matched = drafts.tokens.iter().zip(&tokens[committed + 1..]).take_while(|(d, r)| d == r).count();
                kept = kept.max(matched);
            }
            // A tree verifies each node once; a chain its drafts (fewer after a cut).
            self.drafted += if tree.paths.len() == 1 { chain_drafts } else { self.nodes } as u64;
            self.steps += 1;
            self.accepted += kept as u64;
            for slot in &mut self.accepted_per_position[..kept] {
                *slot += 1;
            }
            // The verify forward's features: positions committed..=committed + kept, each with
            // the token after it (the last one the target's correction or bonus). A tree
            // verify computes the kept path's rows as a chain would.
            let rows = (kept + 1).min(t - 1 - committed);
            drafter.commit(
                head,
                embeddings,
                committed,
                &aux.narrow(0, committed, rows)?,
                &tokens[committed + 1..committed + 1 + rows],
            )?;
            committed += rows;
        }
        Ok(())
    }
}

/// [`DraftReplay`] over the features files of held-out problems.
pub fn replay_problems(
    head: &Eagle3Head,
    embeddings: &dyn TokenEmbeddings,
    problems: &[PathBuf],
    tree: &DraftTree,
    min_confidence: f32,
    vocab_size: usize,
) -> Result<DraftReplay> {
    ensure!(!tree.paths.is_empty(), "an empty draft tree");
    let mut replay = DraftReplay::with_confidence_cut(tree, min_confidence)?;
    for path in problems {
        replay.add(head, embeddings, tree, &SequenceFeatures::load(path)?, vocab_size)?;
    }
    Ok(replay)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use verdict::proposers::eagle::DenseEmbeddings;

    use super::*;

    const VOCAB: usize = 30;
    const HIDDEN: usize = 16;
    const GAMMA: usize = 3;

    fn head_and_embeddings() -> (Eagle3Head, DenseEmbeddings) {
        // Draft ids map to the even target ids 2..=24; odd ids are never drafted.
        verdict::tiny_model::random_eagle3_head(HIDDEN, VOCAB, (1..=12).map(|i| i * 2).collect()).unwrap()
    }

    fn features(tokens: Vec<u32>, response_start: usize, aux: &Tensor) -> SequenceFeatures {
        let t = tokens.len();
        SequenceFeatures {
            tokens,
            response_start,
            aux: aux.narrow(0, 0, t).unwrap().to_dtype(DType::F16).unwrap(),
            top_ids: Tensor::zeros((t, 1), DType::U32, &Device::Cpu).unwrap(),
            top_logits: Tensor::zeros((t, 1), DType::F16, &Device::Cpu).unwrap(),
        }
    }

    /// A response written by the drafter itself in the replay's own step pattern: every step
    /// drafts `path` (the tokens of those ranks), then an odd "correction" token no draft can
    /// be. Returns the tokens, where the response starts, and the features.
    fn own_drafts_response(head: &Eagle3Head, embeddings: &DenseEmbeddings, path: &[usize], steps: usize) -> (Vec<u32>, usize, Tensor) {
        let gamma = path.len();
        let prompt: Vec<u32> = vec![1, 3, 5, 7, 9];
        let total = prompt.len() + 1 + steps * (gamma + 1);
        let aux = Tensor::randn(0f32, 1.0, (total, 3 * HIDDEN), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let mut tokens = prompt.clone();
        tokens.push(11);
        let mut drafter = SequenceDrafter::default();
        let start = prompt.len();
        drafter.commit(head, embeddings, 0, &aux.narrow(0, 0, start).unwrap(), &tokens[1..=start]).unwrap();
        let mut committed = start;
        for _ in 0..steps {
            let mut depth = 0;
            let drafts = drafter
                .draft(head, embeddings, gamma, VOCAB, &mut |row: &Tensor| {
                    depth += 1;
                    ranked_token(row, path[depth - 1])
                })
                .unwrap();
            assert!(drafts.tokens.iter().all(|t| t % 2 == 0), "{:?}", drafts.tokens);
            tokens.extend(&drafts.tokens);
            tokens.push(13);
            drafter
                .commit(head, embeddings, committed, &aux.narrow(0, committed, gamma + 1).unwrap(), &tokens[committed + 1..])
                .unwrap();
            committed += gamma + 1;
        }
        assert_eq!(tokens.len(), total);
        (tokens, start, aux)
    }

    /// Replayed, a response of the chain's own drafts keeps all γ drafts every step — unless
    /// the replay commits other rows or tokens than the runtime.
    #[test]
    fn a_response_of_the_heads_own_drafts_is_accepted_whole() {
        let (head, embeddings) = head_and_embeddings();
        let steps = 5;
        let (tokens, start, aux) = own_drafts_response(&head, &embeddings, &[0; GAMMA], steps);
        let chain = DraftTree::chain(GAMMA);
        let mut replay = DraftReplay::new(&chain);
        replay.add(&head, &embeddings, &chain, &features(tokens.clone(), start, &aux), VOCAB).unwrap();
        assert_eq!(replay.steps, steps as u64);
        assert_eq!(replay.accepted_per_position, vec![steps as u64; GAMMA]);
        assert_eq!(replay.tau(), 1.0 + GAMMA as f64);
        assert_eq!(replay.drafts_per_step(), GAMMA as f64);

        // A response of tokens the head never drafts: one step per token, nothing kept.
        let odd: Vec<u32> = tokens[..start].iter().copied().chain((0..9).map(|i| 2 * i + 1)).collect();
        let mut replay = DraftReplay::new(&chain);
        replay.add(&head, &embeddings, &chain, &features(odd, start, &aux), VOCAB).unwrap();
        assert_eq!((replay.steps, replay.accepted, replay.tau()), (8, 0, 1.0));
    }

    /// A response that always takes the first draft's runner-up: a tree with that branch keeps
    /// every draft; the chain keeps fewer.
    #[test]
    fn a_tree_keeps_the_branch_the_response_took() {
        let (head, embeddings) = head_and_embeddings();
        let steps = 5;
        let (tokens, start, aux) = own_drafts_response(&head, &embeddings, &[1, 0, 0], steps);
        let features = features(tokens, start, &aux);
        let tree: DraftTree = "000,100".parse().unwrap();
        let mut with_branch = DraftReplay::new(&tree);
        with_branch.add(&head, &embeddings, &tree, &features, VOCAB).unwrap();
        assert_eq!((with_branch.steps, with_branch.tau()), (steps as u64, 4.0));
        let chain = DraftTree::chain(GAMMA);
        let mut chain_only = DraftReplay::new(&chain);
        chain_only.add(&head, &embeddings, &chain, &features, VOCAB).unwrap();
        assert!(chain_only.tau() < 4.0 && chain_only.steps > steps as u64, "{chain_only:?}");
    }

    /// A cut no draft reaches verifies one draft a step; a cut every draft passes changes
    /// nothing; a tree verifies its nodes and refuses a cut.
    #[test]
    fn a_confidence_cut_verifies_fewer_drafts() {
        let (head, embeddings) = head_and_embeddings();
        let (tokens, start, aux) = own_drafts_response(&head, &embeddings, &[0; GAMMA], 5);
        let features = features(tokens, start, &aux);
        let chain = DraftTree::chain(GAMMA);
        let replay = |cut: f32| {
            let mut r = DraftReplay::with_confidence_cut(&chain, cut).unwrap();
            r.add(&head, &embeddings, &chain, &features, VOCAB).unwrap();
            r
        };
        let uncut = replay(0.0);
        assert_eq!(replay(1e-6), DraftReplay { min_confidence: 1e-6, ..uncut });
        let cut = replay(0.999_999);
        assert_eq!(cut.drafts_per_step(), 1.0, "{cut:?}");
        assert!(cut.tau() <= 2.0 && cut.steps > 5, "{cut:?}");

        let tree: DraftTree = "000,100".parse().unwrap();
        let mut r = DraftReplay::new(&tree);
        r.add(&head, &embeddings, &tree, &features, VOCAB).unwrap();
        assert_eq!(r.drafts_per_step(), 6.0);
        assert!(DraftReplay::with_confidence_cut(&tree, 0.5).is_err());
    }

    #[test]
    fn draft_trees_parse_count_their_nodes_and_print_back() {
        let tree: DraftTree = "0000, 1000".parse().unwrap();
        assert_eq!((tree.depth(), tree.nodes(), tree.to_string()), (4, 8, "0000,1000".to_string()));
        // Paths share their common prefix.
        let tree: DraftTree = "0000,0100,01".parse().unwrap();
        assert_eq!((tree.depth(), tree.nodes()), (4, 7));
        assert_eq!(DraftTree::chain(3).to_string(), "000");
        let err = "0000,0x".parse::<DraftTree>().unwrap_err().to_string();
        assert!(err.contains("\"0x\""), "{err}");
        assert!("0000,".parse::<DraftTree>().is_err());
    }
}
