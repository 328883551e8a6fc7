//! The EAGLE head's half of prefix caching. On a prefix-cache hit the target restores its
//! KV for the shared prefix and computes only what follows, so the head never sees the
//! prefix's features; without its own entries it would draft from the new tokens alone.
//! Finished sequences leave their head cache here, keyed by the tokens its rows depend on,
//! and a later sequence sharing the prefix takes the rows it needs.
//!
//! Row `p` of a head cache reads the target's features at `p` (which depend on tokens
//! `0..=p`) and the token at `p + 1`: it is valid for another sequence iff the two agree on
//! tokens `0..=p + 1`.

use std::collections::VecDeque;

use anyhow::Result;
use verdict_heads::HeadCache;

struct Entry {
    /// Tokens `0..=len` of the sequence the cache's `len` rows came from.
    tokens: Vec<u32>,
    cache: HeadCache,
    bytes: usize,
}

/// Head caches of finished sequences, the least recently used evicted first once their
/// bytes pass the bound.
pub struct HeadPrefixCache {
    /// Least recently used first.
    entries: VecDeque<Entry>,
    bytes: usize,
    max_bytes: usize,
}

impl HeadPrefixCache {
    pub fn new(max_bytes: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            bytes: 0,
            max_bytes,
        }
    }

    /// Bytes the entries hold.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keep `cache`, whose rows came from a sequence of `tokens` (at least one more token
    /// than rows; later tokens are ignored). An entry whose rows all hold for the new one is
    /// replaced by it.
    pub fn insert(&mut self, tokens: &[u32], cache: &HeadCache) -> Result<()> {
        let rows = cache.len();
        if rows == 0 || tokens.len() <= rows {
            return Ok(());
        }
        let cache = cache.compacted()?;
        let bytes = cache.bytes();
        if bytes > self.max_bytes {
            return Ok(());
        }
        let tokens = tokens[..=rows].to_vec();
        let covered: Vec<usize> = (0..self.entries.len())
            .filter(|&i| valid_rows(&self.entries[i], &tokens) == self.entries[i].cache.len())
            .collect();
        for i in covered.into_iter().rev() {
            let old = self.entries.remove(i).expect("index from the same deque");
            self.bytes -= old.bytes;
        }
        self.entries.push_back(Entry { tokens, cache, bytes });
        self.bytes += bytes;
        while self.bytes > self.max_bytes {
            let old = self.entries.pop_front().expect("bytes > 0 means entries");
            self.bytes -= old.bytes;
        }
        Ok(())
    }

    /// A cache of exactly `rows` rows valid for a sequence starting with `tokens` (which holds
    /// at least `rows + 1` tokens), from the entry that shares it, or `None`.
    pub fn restore(&mut self, tokens: &[u32], rows: usize) -> Result<Option<HeadCache>> {
        if rows == 0 || tokens.len() <= rows {
            return Ok(None);
        }
        let Some(i) = (0..self.entries.len()).rev().find(|&i| valid_rows(&self.entries[i], tokens) >= rows) else {
            return Ok(None);
        };
        let entry = self.entries.remove(i).expect("index from the same deque");
        let mut cache = entry.cache.clone();
        cache.truncate(rows)?;
        self.entries.push_back(entry);
        Ok(Some(cache))
    }
}

/// Rows of `entry` that hold for a sequence starting with `tokens`.
fn valid_rows(entry: &Entry, tokens: &[u32]) -> usize {
    let shared = entry.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
    shared.saturating_sub(1).min(entry.cache.len())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};
    use verdict_heads::HeadCache;

    use super::*;

    /// A head cache of `rows` rows whose values say which row they are.
    fn cache(rows: usize) -> HeadCache {
        let k = Tensor::arange(0f32, rows as f32, &Device::Cpu).unwrap().reshape((1, rows, 1)).unwrap();
        HeadCache::from_tensors(k.clone(), k).unwrap()
    }

    fn rows_of(cache: &HeadCache) -> Vec<f32> {
        cache.keys().unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn rows_hold_while_the_tokens_up_to_the_next_one_agree() {
        let mut store = HeadPrefixCache::new(1 << 20);
        // Rows 0..4 of a sequence 10 11 12 13 14 (row p pairs features at p with token p+1).
        store.insert(&[10, 11, 12, 13, 14, 15], &cache(4)).unwrap();
        // Tokens agree on 0..=2: rows 0 and 1 hold (row 2 read token 3, which differs).
        let got = store.restore(&[10, 11, 12, 99, 98], 2).unwrap().unwrap();
        assert_eq!(rows_of(&got), vec![0.0, 1.0]);
        assert!(store.restore(&[10, 11, 12, 99, 98], 3).unwrap().is_none());
        // Every row holds for a longer sequence with the same start.
        let got = store.restore(&[10, 11, 12, 13, 14, 20, 21], 4).unwrap().unwrap();
        assert_eq!(rows_of(&got), vec![0.0, 1.0, 2.0, 3.0]);
        assert!(store.restore(&[10, 11, 12, 13, 14, 20, 21], 5).unwrap().is_none());
        // A different first token shares nothing.
        assert!(store.restore(&[9, 11, 12], 1).unwrap().is_none());
    }

    #[test]
    fn the_bound_evicts_the_least_recently_used() {
        let one = cache(4).bytes();
        let mut store = HeadPrefixCache::new(2 * one);
        store.insert(&[1, 2, 3, 4, 5], &cache(4)).unwrap();
        store.insert(&[2, 2, 3, 4, 5], &cache(4)).unwrap();
        // Using the first makes the second the oldest.
        assert!(store.restore(&[1, 2, 3], 1).unwrap().is_some());
        store.insert(&[3, 2, 3, 4, 5], &cache(4)).unwrap();
        assert_eq!(store.len(), 2);
        assert!(store.bytes() <= 2 * one);
        assert!(store.restore(&[2, 2, 3], 1).unwrap().is_none());
        assert!(store.restore(&[1, 2, 3], 1).unwrap().is_some());
        assert!(store.restore(&[3, 2, 3], 1).unwrap().is_some());
    }

    #[test]
    fn a_longer_entry_replaces_the_one_it_covers() {
        let mut store = HeadPrefixCache::new(1 << 20);
        store.insert(&[1, 2, 3], &cache(2)).unwrap();
        store.insert(&[1, 2, 3, 4, 5], &cache(4)).unwrap();
        assert_eq!(store.len(), 1);
        assert_eq!(store.bytes(), cache(4).bytes());
        // Too few tokens for the rows, or no rows: nothing kept.
        store.insert(&[7, 8], &cache(2)).unwrap();
        store.insert(&[7, 8], &HeadCache::default()).unwrap();
        assert_eq!(store.len(), 1);
    }
}
