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

/// Magic and version of an exported chain state ([`Sha256::export`]).
const STATE_MAGIC: &[u8; 4] = b"WCS1";
/// Bytes of an exported state before its pending tail.
const STATE_HEAD: usize = 4 + 32 + 8 + 1 + 1;

impl Sha256 {
    /// The chain state as bytes another process can continue from
    /// ([`Sha256::import`]): magic `WCS1`, the eight state words (big
    /// endian), the length so far (little endian u64), a flags byte (bit 0:
    /// a non-zero byte was seen), the pending tail's length and the tail
    /// itself (under 64 bytes). At most 109 bytes: SHA-256 is a chain, so a
    /// digest begun on one rank can be finished on another, bit-identical to
    /// hashing the whole message in one place.
    pub fn export(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(STATE_HEAD + self.buf_len);
        out.extend_from_slice(STATE_MAGIC);
        for word in self.h {
            out.extend_from_slice(&word.to_be_bytes());
        }
        out.extend_from_slice(&self.len.to_le_bytes());
        out.push(u8::from(self.nonzero));
        out.push(self.buf_len as u8);
        out.extend_from_slice(&self.buf[..self.buf_len]);
        out
    }

    /// A state exported by [`Sha256::export`], checked: the magic, the tail
    /// under one block and consistent with the length (every byte before
    /// the tail was compressed in whole blocks), no trailing bytes.
    pub fn import(bytes: &[u8]) -> Result<Sha256, String> {
        if bytes.len() < STATE_HEAD || &bytes[..4] != STATE_MAGIC {
            return Err(format!(
                "not a weight-checker SHA-256 chain state ({} bytes; one starts with {:?} and has at least {STATE_HEAD})",
                bytes.len(),
                std::str::from_utf8(STATE_MAGIC).unwrap_or("WCS1")
            ));
        }
        let mut h = [0u32; 8];
        for (word, chunk) in h.iter_mut().zip(bytes[4..36].chunks_exact(4)) {
            *word = u32::from_be_bytes(chunk.try_into().expect("4 bytes"));
        }
        let len = u64::from_le_bytes(bytes[36..44].try_into().expect("8 bytes"));
        let flags = bytes[44];
        let tail_len = bytes[45] as usize;
        if flags > 1 {
            return Err(format!("chain state flags {flags:#04x}: only bit 0 is defined"));
        }
        if tail_len >= BLOCK_LEN || bytes.len() != STATE_HEAD + tail_len {
            return Err(format!(
                "chain state of {} bytes with a pending tail of {tail_len}: the tail must be under {BLOCK_LEN} bytes \
                 and end the state",
                bytes.len()
            ));
        }
        if len % BLOCK_LEN as u64 != tail_len as u64 {
            return Err(format!(
                "chain state of length {len} with a pending tail of {tail_len}: the length less the tail must be \
                 whole {BLOCK_LEN}-byte blocks"
            ));
        }
        let mut buf = [0u8; BLOCK_LEN];
        buf[..tail_len].copy_from_slice(&bytes[STATE_HEAD..]);
        Ok(Sha256 {
            h,
            buf,
            buf_len: tail_len,
            len,
            nonzero: flags & 1 == 1,
        })
    }
}

#[cfg(test)]
mod chain_tests {
    use super::*;
    use sha2::Digest as _;

    fn message(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 131 + 7) as u8).collect()
    }

    #[test]
    fn a_chain_exported_and_imported_at_any_cut_gives_sha2s_digest() {
        let kernel = crate::sha256::Kernel::best_available();
        for n in [0usize, 1, 55, 56, 63, 64, 65, 127, 128, 1000, 4096 + 17] {
            let data = message(n);
            let want: [u8; 32] = sha2::Sha256::digest(&data).into();
            for cut in [0, 1, n / 3, n / 2, n.saturating_sub(1), n] {
                let cut = cut.min(n);
                let mut first = Sha256::new();
                first.update_with(kernel, &data[..cut]);
                let exported = first.export();
                assert!(exported.len() <= STATE_HEAD + 63);
                let mut second = Sha256::import(&exported).expect("a state just exported");
                second.update_with(kernel, &data[cut..]);
                let got = second.finalize_with(kernel);
                assert_eq!(got.bytes, want, "n={n} cut={cut}");
                assert_eq!(got.all_zero, data.iter().all(|&b| b == 0));
            }
        }
    }

    fn refusal(bytes: &[u8]) -> String {
        match Sha256::import(bytes) {
            Ok(_) => panic!("a bad state was accepted"),
            Err(why) => why,
        }
    }

    #[test]
    fn a_bad_state_is_refused_with_a_reason() {
        let mut s = Sha256::new();
        s.update_with(crate::sha256::Kernel::best_available(), &message(70));
        let good = s.export();
        assert!(Sha256::import(&good).is_ok());
        assert!(refusal(&good[..good.len() - 1]).contains("tail"));
        let mut wrong_len = good.clone();
        wrong_len[36] ^= 1; // the length no longer ends in the tail
        assert!(refusal(&wrong_len).contains("whole 64-byte blocks"));
        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(refusal(&magic).contains("not a weight-checker"));
        let mut flags = good;
        flags[44] = 2;
        assert!(refusal(&flags).contains("flags"));
    }
}
