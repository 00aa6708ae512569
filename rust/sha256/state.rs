//! The SHA-256 state machine (partial block, length, padding, the all-zero
//! flag) and the finished digest; the kernels only compress whole blocks.

use std::fmt;

use super::{Kernel, BLOCK_LEN, H0, STEP_BYTES};

/// A finished digest, with whether every hashed byte was zero (an empty
/// message counts as all-zero): a tensor still all-zero after a reset is the
/// typical sign that a weight update never reached it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest {
    pub bytes: [u8; 32],
    pub all_zero: bool,
}

impl Digest {
    /// The digest of a finished state (the padding already compressed).
    pub(super) fn from_state(h: &[u32; 8], all_zero: bool) -> Digest {
        let mut bytes = [0u8; 32];
        for (out, word) in bytes.chunks_exact_mut(4).zip(h) {
            out.copy_from_slice(&word.to_be_bytes());
        }
        Digest { bytes, all_zero }
    }

    pub fn hex(&self) -> String {
        String::from_utf8(self.hex_ascii().to_vec()).expect("hex digits are ASCII")
    }

    /// The lowercase hex digest as ASCII bytes, without allocating.
    pub fn hex_ascii(&self) -> [u8; 64] {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 64];
        for (pair, b) in out.chunks_exact_mut(2).zip(self.bytes) {
            pair[0] = HEX[(b >> 4) as usize];
            pair[1] = HEX[(b & 15) as usize];
        }
        out
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({}, all_zero={})", self.hex(), self.all_zero)
    }
}

/// True when every byte is zero. Folds 64-byte blocks with OR so the
/// compiler vectorises it, and stops at the first non-zero block: on real
/// weights that is the first one, so the check costs nothing.
#[inline]
pub(crate) fn is_all_zero(data: &[u8]) -> bool {
    let mut blocks = data.chunks_exact(64);
    for block in &mut blocks {
        let mut acc = 0u64;
        for word in block.chunks_exact(8) {
            acc |= u64::from_ne_bytes(word.try_into().unwrap());
        }
        if acc != 0 {
            return false;
        }
    }
    blocks.remainder().iter().all(|&b| b == 0)
}

/// An incremental SHA-256 state. The scheduler in [`crate::scheduler`] drives
/// its fields directly so that whole blocks go to multi-stream kernels; this
/// type keeps the partial block, the length and the all-zero flag.
#[derive(Clone)]
pub struct Sha256 {
    pub(crate) h: [u32; 8],
    pub(crate) buf: [u8; BLOCK_LEN],
    pub(crate) buf_len: usize,
    pub(crate) len: u64,
    pub(crate) nonzero: bool,
}

impl Default for Sha256 {
    fn default() -> Self {
        Self::new()
    }
}

impl Sha256 {
    pub fn new() -> Self {
        Sha256 {
            h: H0,
            buf: [0; BLOCK_LEN],
            buf_len: 0,
            len: 0,
            nonzero: false,
        }
    }

    /// Bytes absorbed so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Notes whether `data` (about to be hashed) has a non-zero byte. Once
    /// one is seen the check is skipped for the rest of the message.
    #[inline]
    pub(crate) fn observe(&mut self, data: &[u8]) {
        if !self.nonzero && !is_all_zero(data) {
            self.nonzero = true;
        }
    }

    /// Absorbs bytes into the partial block until it is full (then compresses
    /// it) or `data` runs out. Returns how many bytes were taken. Afterwards
    /// either `buf_len == 0` or all of `data` was taken.
    #[inline]
    pub(crate) fn absorb_into_buffer(&mut self, kernel: Kernel, data: &[u8]) -> usize {
        let take = (BLOCK_LEN - self.buf_len).min(data.len());
        self.observe(&data[..take]);
        self.buf[self.buf_len..self.buf_len + take].copy_from_slice(&data[..take]);
        self.buf_len += take;
        self.len += take as u64;
        if self.buf_len == BLOCK_LEN {
            let block = self.buf;
            kernel.compress1(&mut self.h, &block);
            self.buf_len = 0;
        }
        take
    }

    /// Records that whole blocks were compressed into `h` by a kernel.
    #[inline]
    pub(crate) fn note_blocks(&mut self, nbytes: usize) {
        self.len += nbytes as u64;
    }

    /// Feeds `data`, one stream, with the given kernel.
    pub fn update_with(&mut self, kernel: Kernel, mut data: &[u8]) {
        if self.buf_len > 0 {
            let took = self.absorb_into_buffer(kernel, data);
            data = &data[took..];
        }
        let whole = data.len() / BLOCK_LEN * BLOCK_LEN;
        if whole > 0 {
            // Observe and compress in L2-sized steps so the zero check reads
            // bytes the hash is about to read anyway.
            for piece in data[..whole].chunks(STEP_BYTES) {
                self.observe(piece);
                kernel.compress1(&mut self.h, piece);
            }
            self.note_blocks(whole);
        }
        if whole < data.len() {
            self.absorb_into_buffer(kernel, &data[whole..]);
        }
    }

    /// Pads, compresses the last block(s) and returns the digest.
    pub fn finalize_with(mut self, kernel: Kernel) -> Digest {
        let bit_len = self.len.wrapping_mul(8);
        let mut tail = [0u8; 2 * BLOCK_LEN];
        tail[..self.buf_len].copy_from_slice(&self.buf[..self.buf_len]);
        tail[self.buf_len] = 0x80;
        let total = if self.buf_len < BLOCK_LEN - 8 {
            BLOCK_LEN
        } else {
            2 * BLOCK_LEN
        };
        tail[total - 8..total].copy_from_slice(&bit_len.to_be_bytes());
        kernel.compress1(&mut self.h, &tail[..total]);
        Digest::from_state(&self.h, !self.nonzero)
    }
}

/// One-shot digest of one buffer on the calling thread.
pub fn digest_with(kernel: Kernel, data: &[u8]) -> Digest {
    let mut s = Sha256::new();
    s.update_with(kernel, data);
    s.finalize_with(kernel)
}
