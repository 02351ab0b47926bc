//! Chained page hashes: one 64-bit key per whole page of tokens, the same in every process.
//!
//! The key of page `i` of a token sequence is a function of the namespace, of every token up to
//! the end of page `i`, and of a seed the caller chooses (the same on every instance that must
//! agree, e.g. a router and the engines it routes to). It is what KV events announce and what a
//! shared page store is keyed by, so it must never depend on the process: no randomized hashing.
//!
//! Definition (version 1), with XXH3-64 (`xxh3_64_with_seed`, the xxHash specification,
//! <https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md>):
//!
//! ```text
//! h[-1] = XXH3_64(seed, "kvpool.page_hash.v1" || namespace bytes)
//! h[i]  = XXH3_64(seed, le_u64(h[i-1]) || le_i32(tokens[i*P .. (i+1)*P]))
//! ```
//!
//! where `P` is the page size and the namespace bytes are [`Namespace::as_bytes`] (a tagged,
//! injective encoding of the caller's key). A partial last page has no hash. Two sequences get
//! the same `h[i]` only if they agree on the namespace and on all tokens up to page `i` (up to
//! 64-bit collisions: a store that must never serve foreign KV also compares the tokens).

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

use crate::radix::Namespace;

/// The domain tag that starts every chain (bumped if the definition ever changes).
pub const DOMAIN: &[u8] = b"kvpool.page_hash.v1";

/// `h[-1]`: the hash a chain starts from, for `ns` and `seed`.
pub fn root_hash(ns: &Namespace, seed: u64) -> u64 {
    let mut h = Xxh3::with_seed(seed);
    h.update(DOMAIN);
    h.update(ns.as_bytes());
    h.digest()
}

/// The hash of one page of `tokens` whose predecessor (or chain root) hashed to `parent`.
/// `buf` is scratch space, reused across calls.
pub fn next_hash(parent: u64, tokens: &[i32], seed: u64, buf: &mut Vec<u8>) -> u64 {
    buf.clear();
    buf.resize(8 + 4 * tokens.len(), 0);
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    // (one sized buffer, filled in a loop the compiler turns into a copy on little-endian)
    for (d, t) in buf[8..].chunks_exact_mut(4).zip(tokens) {
        d.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(buf, seed)
}

/// The hashes of the whole pages of `tokens` (`tokens.len() / page_size` of them), continuing
/// the chain from `parent` (`None`: from [`root_hash`] of `ns`).
///
/// # Panics
/// Never; `page_size` 0 gives no hashes.
pub fn page_hashes(
    ns: &Namespace,
    tokens: &[i32],
    page_size: usize,
    seed: u64,
    parent: Option<u64>,
) -> Vec<u64> {
    if page_size == 0 {
        return Vec::new();
    }
    let mut prev = parent.unwrap_or_else(|| root_hash(ns, seed));
    let mut buf = Vec::with_capacity(8 + 4 * page_size);
    tokens
        .chunks_exact(page_size)
        .map(|page| {
            prev = next_hash(prev, page, seed, &mut buf);
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_every_earlier_token_and_the_namespace() {
        let ns = Namespace::none();
        let a = page_hashes(&ns, &[1, 2, 3, 4, 5], 2, 7, None);
        assert_eq!(a.len(), 2);
        let b = page_hashes(&ns, &[9, 2, 3, 4], 2, 7, None);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1]); // same second page, different first page
        let mut nb = Namespace::builder();
        nb.str("lora-1");
        assert_ne!(page_hashes(&nb.finish(), &[1, 2], 2, 7, None)[0], a[0]);
        assert_ne!(page_hashes(&ns, &[1, 2], 2, 8, None)[0], a[0]);
        // continuing a chain equals hashing the whole sequence
        let tail = page_hashes(&ns, &[3, 4], 2, 7, Some(a[0]));
        assert_eq!(tail[0], a[1]);
    }

    #[test]
    fn definition_spelled_out() {
        let ns = Namespace::none();
        let mut root = DOMAIN.to_vec();
        root.extend_from_slice(ns.as_bytes());
        let r = xxh3_64_with_seed(&root, 42);
        assert_eq!(root_hash(&ns, 42), r);
        let mut page = r.to_le_bytes().to_vec();
        for t in [5i32, -1] {
            page.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(
            page_hashes(&ns, &[5, -1], 2, 42, None),
            vec![xxh3_64_with_seed(&page, 42)]
        );
    }
}
