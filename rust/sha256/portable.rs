//! One stream through the `sha2` crate's compression function, which picks
//! SHA-NI, ARMv8 SHA2 or software at run time. This is the fallback on every
//! CPU and the reference the multi-stream kernels are tested against.

use super::BLOCK_LEN;

#[inline]
pub(super) fn compress(state: &mut [u32; 8], blocks: &[u8]) {
    let (blocks, rest) = blocks.as_chunks::<BLOCK_LEN>();
    debug_assert!(rest.is_empty());
    sha2::block_api::compress256(state, blocks);
}
