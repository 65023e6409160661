//! Cutting files into blocks.
//!
//! Every file is cut into [`BLOCK_SIZE`] blocks, the last one shorter; an empty file has no
//! blocks. A block is named by its digest, so identical blocks (the zero blocks of a sparse
//! writable layer, files shared by two templates) are stored once.

use std::io::{self, Read};
use std::sync::OnceLock;

use crate::digest::Digest;

/// The size of every block but the last one of a file: 4 MiB.
pub const BLOCK_SIZE: usize = 4 * 1024 * 1024;

/// How many blocks a file of `size` bytes has.
pub fn block_count(size: u64) -> u64 {
    size.div_ceil(BLOCK_SIZE as u64)
}

/// The length of block `index` of a file of `size` bytes (0 when the file has no such block).
pub fn block_len(size: u64, index: u64) -> usize {
    let start = index.saturating_mul(BLOCK_SIZE as u64);
    size.saturating_sub(start).min(BLOCK_SIZE as u64) as usize
}

/// The digest of a full block of zeros: sparse files are mostly this block, which
/// materialization writes as a hole without fetching it.
pub fn zero_block_digest() -> Digest {
    static ZERO: OnceLock<Digest> = OnceLock::new();
    *ZERO.get_or_init(|| Digest::of(&vec![0u8; BLOCK_SIZE]))
}

/// One block cut from a reader.
#[derive(Debug)]
pub struct Block<'a> {
    /// The digest of `bytes`.
    pub digest: Digest,
    /// The block's content: [`BLOCK_SIZE`] bytes, fewer for the last block.
    pub bytes: &'a [u8],
}

/// Cuts a reader into blocks, reusing one buffer.
#[derive(Debug)]
pub struct BlockReader<R> {
    reader: R,
    buf: Vec<u8>,
    done: bool,
}

impl<R: Read> BlockReader<R> {
    /// Blocks of everything `reader` yields.
    pub fn new(reader: R) -> Self {
        BlockReader {
            reader,
            buf: Vec::with_capacity(BLOCK_SIZE),
            done: false,
        }
    }

    /// The next block, or None at the end. Only the last block is shorter than
    /// [`BLOCK_SIZE`]: short reads are retried until the buffer is full or the reader ends.
    pub fn next_block(&mut self) -> io::Result<Option<Block<'_>>> {
        if self.done {
            return Ok(None);
        }
        self.buf.clear();
        let limit = BLOCK_SIZE as u64;
        (&mut self.reader).take(limit).read_to_end(&mut self.buf)?;
        if self.buf.len() < BLOCK_SIZE {
            self.done = true;
        }
        if self.buf.is_empty() {
            return Ok(None);
        }
        Ok(Some(Block {
            digest: Digest::of(&self.buf),
            bytes: &self.buf,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(len: usize) -> Vec<usize> {
        let data = vec![7u8; len];
        let mut reader = BlockReader::new(&data[..]);
        let mut lens = Vec::new();
        while let Some(block) = reader.next_block().unwrap() {
            assert_eq!(block.digest, Digest::of(block.bytes));
            lens.push(block.bytes.len());
        }
        lens
    }

    #[test]
    fn cuts_at_exact_block_boundaries() {
        assert_eq!(cut(0), Vec::<usize>::new());
        assert_eq!(cut(1), vec![1]);
        assert_eq!(cut(BLOCK_SIZE), vec![BLOCK_SIZE]);
        assert_eq!(cut(BLOCK_SIZE + 1), vec![BLOCK_SIZE, 1]);
        assert_eq!(cut(2 * BLOCK_SIZE), vec![BLOCK_SIZE, BLOCK_SIZE]);
    }

    #[test]
    fn counts_and_lengths_agree_with_cutting() {
        for size in [0, 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE - 1] {
            let lens = cut(size);
            assert_eq!(block_count(size as u64), lens.len() as u64, "size {size}");
            for (i, len) in lens.iter().enumerate() {
                assert_eq!(
                    block_len(size as u64, i as u64),
                    *len,
                    "size {size} block {i}"
                );
            }
            assert_eq!(block_len(size as u64, lens.len() as u64), 0);
        }
    }

    #[test]
    fn short_reads_still_fill_whole_blocks() {
        struct Trickle<'a>(&'a [u8]);
        impl Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = self.0.len().min(buf.len()).min(1000);
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let data = vec![1u8; BLOCK_SIZE + 10];
        let mut reader = BlockReader::new(Trickle(&data));
        assert_eq!(
            reader.next_block().unwrap().unwrap().bytes.len(),
            BLOCK_SIZE
        );
        assert_eq!(reader.next_block().unwrap().unwrap().bytes.len(), 10);
        assert!(reader.next_block().unwrap().is_none());
    }
}
