//! What `--prefix-caching-hash-algo sha256` costs per block: `BlockHasher::hash_block`
//! over a chain of 16-token blocks of random token ids, for each algorithm, best of 5
//! runs of 200,000 blocks (runs alternate, so a change in the machine's load falls on
//! both). A plain `Instant` loop: `cargo bench -p fastsched-core --bench block_hash`.

use std::hint::black_box;
use std::time::Instant;

use fastsched_core::kv::BlockHasher;
use fastsched_core::HashAlgo;

const BLOCK_SIZE: usize = 16;
const NUM_BLOCKS: usize = 200_000;
const RUNS: usize = 5;

fn ns_per_block(hasher: &BlockHasher, tokens: &[u32]) -> f64 {
    let start = Instant::now();
    let mut parent = hasher.root(None, None);
    for block in tokens.chunks_exact(BLOCK_SIZE) {
        parent = hasher.hash_block(black_box(parent), black_box(block));
    }
    black_box(parent);
    start.elapsed().as_nanos() as f64 / NUM_BLOCKS as f64
}

fn main() {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let tokens: Vec<u32> = (0..NUM_BLOCKS * BLOCK_SIZE)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 50_000) as u32
        })
        .collect();
    let algos = [HashAlgo::Builtin, HashAlgo::Sha256];
    let mut best = [f64::MAX; 2];
    for _ in 0..RUNS {
        for (i, &algo) in algos.iter().enumerate() {
            let hasher = BlockHasher::with_algo(BLOCK_SIZE, algo);
            best[i] = best[i].min(ns_per_block(&hasher, &tokens));
        }
    }
    for (algo, ns) in algos.iter().zip(best) {
        println!(
            "{:8} {ns:7.1} ns per {BLOCK_SIZE}-token block",
            algo.as_str()
        );
    }
}
